"""The in-page memory calculator (book/calculator.md, chapter 3) against the command
line.

The page runs ``trainmem.cli.main(["estimate", ..., "--json"])`` under Pyodide, served
from the built site with every request to another host aborted. Each configuration of
the grid is set in the form and its ``data-total-bytes`` (and the byte column of its
table) compared with ``python -m trainmem estimate ... --json`` run as a subprocess; bad
input must give the CLI's stderr line. Screenshots (desktop 1280x800, phone 390x844) go
to _build/screenshots/.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.notebooks import ROOT
from tests.page_audit import english_phrase
from tests.site import (
    CHROMIUM_ARGS,
    DESKTOP,
    HTML,
    SCREENSHOTS,
    SiteServer,
    build_book,
    chromium_path,
    open_offline,
)

sys.path.insert(0, str(ROOT / "_ext"))
import calculator as calc  # noqa: E402  (the Sphinx extension: module list and form fields)

# config.json files a reader might paste (public shapes; the optional fields vary on
# purpose)
GEMMA2_2B = {  # a recorded family with no SDPA path (eager attention, softcapping)
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "torch_dtype": "float32",
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0",
}
LLAMA_MIN = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "tie_word_embeddings": True,
}
QWEN2_SMALL = {
    "model_type": "qwen2",
    "vocab_size": 5000,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
}
QWEN2_NO_KV = {
    "model_type": "qwen2",
    "vocab_size": 500,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
}
MISTRAL_NO_KV = {
    "model_type": "mistral",
    "vocab_size": 500,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "head_dim": 32,
}
GPT2_SMALL = {
    "model_type": "gpt2",
    "vocab_size": 50257,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
}
ALL_LLAMA = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

# (form values named like the CLI options, pasted config.json or None)
GRID: list[tuple[dict, dict | None]] = [
    ({}, None),
    ({"method": "lora", "batch": "4"}, None),
    (
        {
            "method": "qlora",
            "lora-rank": "16",
            "lora-targets": "q_proj,k_proj,v_proj,o_proj",
        },
        None,
    ),
    ({"method": "qlora", "no-double-quant": True, "seq": "2048"}, None),
    ({"precision": "fp32", "optimizer": "sgd"}, None),
    ({"precision": "bf16", "optimizer": "adamw8bit", "checkpointing": True}, None),
    (
        {
            "precision": "fp16-amp",
            "optimizer": "sgd-momentum",
            "attn": "eager",
            "seq": "1024",
        },
        None,
    ),
    (
        {"method": "lora", "grad-accum": "4", "checkpointing": True, "attn": "flash"},
        None,
    ),
    (
        {
            "model": "llama2-13b",
            "method": "lora",
            "lora-dtype": "bf16",
            "lora-alpha": "32",
            "batch": "2",
            "seq": "2048",
        },
        None,
    ),
    ({"model": "llama2-13b", "zero": "1", "gpus": "8"}, None),
    ({"model": "llama2-70b", "zero": "3", "gpus": "64", "checkpointing": True}, None),
    (
        {
            "model": "llama2-70b",
            "method": "qlora",
            "seq": "4096",
            "checkpointing": True,
        },
        None,
    ),
    ({"model": "llama2-7b", "precision": "fp32", "zero": "2", "gpus": "4"}, None),
    ({"model": "qwen2.5-0.5b", "batch": "8", "seq": "1024"}, None),
    (
        {
            "model": "qwen2.5-0.5b",
            "method": "lora",
            "lora-targets": ALL_LLAMA,
            "lora-rank": "64",
            "attn": "eager",
        },
        None,
    ),
    ({"model": "gpt2", "precision": "fp32", "batch": "4", "seq": "1024"}, None),
    ({"model": "gpt2", "method": "lora", "lora-targets": "c_attn"}, None),
    ({"model": "tiny", "batch": "2", "seq": "64"}, None),
    (
        {
            "model": "tiny",
            "method": "lora",
            "lora-targets": ALL_LLAMA,
            "checkpointing": True,
            "precision": "fp16-amp",
        },
        None,
    ),
    (
        {"model": "config.json", "precision": "bf16", "zero": "3", "gpus": "8"},
        MISTRAL_7B,
    ),
    ({"model": "config.json", "method": "lora"}, MISTRAL_7B),
    (
        {
            "model": "config.json",
            "precision": "fp32",
            "checkpointing": True,
            "seq": "128",
        },
        LLAMA_MIN,
    ),
    ({"model": "config.json", "method": "lora", "seq": "256"}, QWEN2_SMALL),
    ({"model": "config.json", "seq": "64"}, QWEN2_NO_KV),
    ({"model": "config.json", "seq": "64", "attn": "eager"}, MISTRAL_NO_KV),
    ({"model": "config.json", "batch": "2"}, GPT2_SMALL),
    (
        {"model": "config.json", "method": "lora", "checkpointing": True, "seq": "64"},
        GEMMA2_2B,
    ),
]

# bad input: the page must show the CLI's own stderr line
ERRORS: list[tuple[dict, str | None]] = [
    ({"batch": "0"}, None),
    ({"seq": "abc"}, None),
    ({"method": "lora", "lora-rank": "100000"}, None),
    ({"method": "lora", "lora-targets": "q_proj,foo"}, None),
    ({"model": "config.json"}, '{"model_type": "llama", "vocab_size": 32000,'),
    ({"model": "config.json"}, json.dumps({"model_type": "bert", "vocab_size": 30522})),
    ({"model": "config.json"}, json.dumps({**LLAMA_MIN, "hidden_size": 0})),
    ({"method": "lora", "lora-dropout": "1.5"}, None),
    ({"versions": "jax=1"}, None),
]


#: the options a choice needs to be valid (DeepSpeed is modelled at ZeRO 2/3)
NEEDS = {
    "zero-impl": {"zero": "3", "gpus": "2"},
    "deepspeed-sizes": {"zero": "3", "gpus": "2", "zero-impl": "deepspeed"},
    # GRPO's group of completions divides the generation batch
    "objective": {"batch": "8"},
    "reference": {"objective": "dpo", "method": "lora"},
    "loss-impl": {"model": "tiny"},
}
#: a choice that needs other values than the rest of its option's
NEEDS_CHOICE = {
    ("reference", "none"): {"objective": "grpo", "batch": "8"},
}


def _coverage_grid() -> list[tuple[dict, None]]:
    """Every preset and every value of every choice option of the CLI once (a preset or
    an option added to the CLI is then compared too, without editing this file)."""
    out = []
    for f in calc.form_fields():
        if f["kind"] == "model":
            out.extend(
                ({"model": m}, None) for m in f["choices"] if m != calc.CONFIG_CHOICE
            )
        if f["kind"] != "choice":
            continue
        for c in f["choices"]:
            if c == f["default"]:
                continue
            needs = NEEDS_CHOICE.get((f["name"], c), NEEDS.get(f["name"], {}))
            values = {**needs, f["name"]: c}
            if f["name"].startswith("lora-"):
                values["method"] = "lora"
            out.append((values, None))
    return out


def _cli(
    values: dict, config_text: str | None, tmp: Path
) -> subprocess.CompletedProcess:
    """What ``python -m trainmem estimate ... --json`` prints for the options of
    ``values`` (cwd ``tmp``): ``trainmem.cli.main`` run in this process, so
    transformers (which reads a pasted config.json) is imported once, not once per
    configuration. ``tests/test_trainmem_cli.py`` runs the ``python -m trainmem``
    entry point itself."""
    from trainmem.cli import main

    argv = ["estimate"]
    for k, v in values.items():
        if v is True:
            argv.append(f"--{k}")
        elif v is not False:
            argv.append(f"--{k}={v}")
    argv.append("--json")
    if config_text is not None:
        (tmp / "config.json").write_text(config_text, encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(tmp)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's own errors
                rc = e.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(argv, rc or 0, out.getvalue(), err.getvalue())


# --------------------------------------------------------------------------------------
# without a browser: what is shipped, and the form
# --------------------------------------------------------------------------------------
def test_shipped_modules_come_from_the_import_graph():
    shipped, left_out = calc.browser_modules()
    for m in (
        "trainmem",
        "trainmem.cli",
        "trainmem.estimate",
        "trainmem.families",
        "trainmem.formats",
    ):
        assert m in shipped
    # the torch side is never shipped: the estimator reaches measure only inside a
    # function (``python -m trainmem measure``), and no demo at all
    assert not any(m.startswith("trainmem.measuring.measure") for m in shipped), shipped
    assert not any(m.startswith("trainmem.demos") for m in shipped), shipped
    assert (
        "trainmem.measuring.measure" in left_out
        and "torch" in left_out["trainmem.measuring.measure"]
    )


def test_shipped_modules_run_without_third_party_packages(tmp_path):
    """The shipped files alone, on a Python without site-packages (no torch, numpy,
    transformers: what Pyodide has), print the same JSON as the CLI of this environment
    — presets and pasted config files, whose transformers-free reading must agree with
    transformers' defaults."""
    shipped, _ = calc.browser_modules()
    lib = tmp_path / "lib"
    for src in [calc._module_file(name) for name in shipped] + calc.browser_data():
        dst = lib / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    cases = [(v, c) for v, c in GRID if c is not None] + [
        ({"model": "tiny", "method": "lora"}, None)
    ]
    runner = (
        "import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom trainmem.cli import "
        "main\n"
        "raise SystemExit(main(json.loads(sys.argv[2])))\n"
    )
    for values, config in cases:
        text = json.dumps(config) if config is not None else None
        ref = _cli(values, text, tmp_path)
        opts = [f"--{k}" if v is True else f"--{k}={v}" for k, v in values.items()]
        argv = ["estimate", *opts, "--json"]
        iso = subprocess.run(
            [sys.executable, "-I", "-S", "-c", runner, str(lib), json.dumps(argv)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert iso.returncode == ref.returncode == 0, (values, iso.stderr, ref.stderr)
        assert iso.stdout == ref.stdout, values


def test_form_is_the_cli_estimate_options():
    parser = calc._estimate_parser()
    want = {
        max(a.option_strings, key=len).lstrip("-"): a
        for a in parser._actions
        if a.option_strings and a.dest not in ("help", "json", "timeline")
    }
    fields = {f["name"]: f for f in calc.form_fields()}
    assert set(fields) == set(want)
    for name in (
        "model",
        "method",
        "precision",
        "optimizer",
        "batch",
        "seq",
        "grad-accum",
        "lora-rank",
        "lora-targets",
        "checkpointing",
        "attn",
        "zero",
        "gpus",
    ):
        assert name in fields, name
    for name, f in fields.items():
        a = want[name]
        if f["kind"] == "choice":
            assert f["choices"] == [str(c) for c in a.choices]
        if f["kind"] in ("choice", "text"):
            assert (
                f["default"] in (None, "")
                if a.default is None
                else f["default"] == str(a.default)
            )
    from trainmem.families import preset_names

    assert fields["model"]["choices"] == preset_names() + ["config.json"]


# --------------------------------------------------------------------------------------
# in the browser
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site():
    exe = chromium_path()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make browser-deps installs it)")
        pytest.skip("chromium not installed; run `make browser-deps`")
    r = build_book()
    assert r.returncode == 0, "book build failed:\n" + (r.stdout + r.stderr)[-3000:]
    from playwright.sync_api import sync_playwright

    with SiteServer(HTML) as server, sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b, server.url
        b.close()


@pytest.fixture(scope="module")
def calc_page(site):
    """One calculator page for the tests that drive its form: Pyodide starts once
    (seconds of CPU a start), each test sets every field it needs (``_ask`` resets
    the form first). Yields ``(page, problems)``; a test empties ``problems`` first,
    so each one is charged with what happened during it."""
    b, base = site
    page, problems = open_offline(b, base, "book/calculator.html")
    try:
        _first_answer(page)
        yield page, problems
    finally:
        page.context.close()


def _fresh(calc_page):
    page, problems = calc_page
    problems.clear()
    page.set_viewport_size({"width": DESKTOP[0], "height": DESKTOP[1]})
    return page, problems


SET_FORM = """({values, config}) => {
  const root = document.querySelector('.tm-calc');
  const form = root.querySelector('form');
  form.reset();
  for (const [k, v] of Object.entries(values)) {
    const el = form.elements[k];
    if (!el) throw new Error('the form has no field ' + k);
    if (el.type === 'checkbox') el.checked = v; else el.value = v;
    if (el.tagName === 'SELECT' && el.value !== v)
      throw new Error(`${k}: no option ${v}`);
  }
  if (config !== null) form.elements['config-json'].value = config;
  const seq = Number(root.querySelector('.tm-calc-result').dataset.seq || 0);
  form.dispatchEvent(new Event('change', {bubbles: true}));
  return seq;
}"""
RESULT = """() => {
  const r = document.querySelector('.tm-calc-result');
  return {total: r.dataset.totalBytes || null, error: r.dataset.error || null,
          argv: JSON.parse(r.dataset.argv),
          bytes: [...r.querySelectorAll('.tm-table:not(.tm-gpu-table) tbody tr')].map(
                   tr => tr.querySelector('td:last-child')
                           .textContent.replaceAll(',', ''))};
}"""


def _ask(page, values: dict, config_text: str | None) -> dict:
    seq = page.evaluate(SET_FORM, {"values": values, "config": config_text})
    page.wait_for_function(
        "s => Number(document.querySelector('.tm-calc-result').dataset.seq) > s",
        arg=seq,
        timeout=60000,
    )
    return page.evaluate(RESULT)


def _first_answer(page):
    page.wait_for_selector(
        ".tm-calc[data-state=ready]", state="attached", timeout=120000
    )


def test_page_matches_cli_byte_for_byte(calc_page, tmp_path):
    page, problems = _fresh(calc_page)
    grid = GRID + _coverage_grid()
    assert len(grid) >= 20
    mismatches = []
    for values, config in grid:
        text = json.dumps(config, indent=2) if config is not None else None
        got = _ask(page, values, text)
        ref = _cli(values, text, tmp_path)
        assert ref.returncode == 0, (values, ref.stderr)
        want = json.loads(ref.stdout)
        for k, v in values.items():  # the page passed what the form says
            assert (f"--{k}" if v is True else f"--{k}={v}") in got["argv"], (
                k,
                got["argv"],
            )
        rows = [str(want["breakdown"][k]) for k in calc_terms()] + [
            str(want["total_bytes"])
        ]
        if got["total"] != str(want["total_bytes"]) or got["bytes"] != rows:
            mismatches.append(
                f"{values}: page {got['total']} {got['error'] or ''} "
                f"vs CLI {want['total_bytes']}"
            )
    assert not mismatches, "\n".join(mismatches)
    assert not problems, "\n".join(problems)


def calc_terms():
    from trainmem.estimate import CATEGORIES

    return CATEGORIES


def test_bad_input_gets_the_cli_message(calc_page, tmp_path):
    page, problems = _fresh(calc_page)
    for values, config_text in ERRORS:
        got = _ask(page, values, config_text)
        ref = _cli(values, config_text, tmp_path)
        assert ref.returncode == 2, (values, ref.stdout)
        line = ref.stderr.strip()
        assert "\n" not in line and line.startswith(
            "python -m trainmem estimate: error: "
        )
        assert got["total"] is None and got["error"] == line, (values, got, line)
        shown = page.locator(".tm-calc-error").inner_text()
        assert line in shown and shown.startswith("输入有误"), shown
        # the field the message names is marked on the form, and named in Chinese
        flag = re.search(r"(--[a-z0-9-]+)", line)
        marked = page.locator("[aria-invalid=true]")
        if flag and page.locator(f"[data-flag='{flag.group(1)}']").count():
            assert marked.count() == 1
            assert marked.get_attribute("data-flag") == flag.group(1)
            assert "标红" in shown
        assert "输入有误" in page.locator(".tm-calc-status").inner_text()
    assert not problems, "\n".join(problems)


def test_typing_recomputes_and_screenshots(calc_page, tmp_path):
    """A reader's edit (typing into the field) is answered; desktop and phone
    screenshots of the answered page; no horizontal overflow on a phone."""
    page, problems = _fresh(calc_page)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    want = json.loads(
        _cli(
            {"method": "lora", "batch": "8", "checkpointing": True}, None, tmp_path
        ).stdout
    )
    for label, vp in (("desktop", (1280, 800)), ("phone", (390, 844))):
        page.set_viewport_size({"width": vp[0], "height": vp[1]})
        _ask(page, {}, None)  # the form as a reader finds it
        assert page.locator(".tm-bar .tm-seg").count() >= 3
        assert page.locator(".tm-calc-phase").get_attribute("data-phase") in (
            "forward",
            "backward",
            "optimizer",
        )
        assert page.locator(".tm-calc-phase").inner_text() in (
            "前向（forward）",
            "反向（backward）",
            "优化器更新（optimizer）",
        )
        head = page.locator(".tm-table thead").inner_text()
        assert "GB" in head and "GiB" in head
        seq = int(page.get_attribute(".tm-calc-result", "data-seq"))
        page.select_option("select[name=method]", "lora")
        page.fill("input[name=batch]", "8")
        page.check("input[name=checkpointing]")
        page.wait_for_function(
            "t => document.querySelector('.tm-calc-result').dataset.totalBytes === t",
            arg=str(want["total_bytes"]),
            timeout=60000,
        )
        assert int(page.get_attribute(".tm-calc-result", "data-seq")) > seq
        page.evaluate("() => document.activeElement && document.activeElement.blur()")
        page.evaluate("() => window.scrollTo(0, 0)")
        page.screenshot(
            path=str(SCREENSHOTS / f"calculator_{label}.png"), full_page=True
        )
        page.locator(".tm-calc-result").scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / f"calculator_{label}_result.png"))
        over = page.evaluate(
            "() => document.documentElement.scrollWidth"
            " - document.documentElement.clientWidth"
        )
        assert over <= 1, f"{label}: page is {over}px wider than the screen"
        assert not problems, "\n".join(problems)


def test_gpu_numbers_timeline_and_fit(calc_page, tmp_path):
    """With a GPU chosen the page shows the CLI's reserved / nvidia-smi bytes and the
    fit verdict, draws the step's timeline (one area per category, its highest point
    the peak), and the fit button answers what ``python -m trainmem fit`` answers."""
    page, problems = _fresh(calc_page)
    values = {"model": "llama2-7b", "method": "qlora", "batch": "4", "gpu": "T4"}
    got = _ask(page, values, None)
    ref = _cli(values, None, tmp_path)
    want = json.loads(ref.stdout)
    assert got["total"] == str(want["total_bytes"])
    gpu = page.locator(".tm-calc-gpu")
    assert gpu.get_attribute("data-fits") == str(want["fits"]).lower()
    table = page.locator(".tm-gpu-table").inner_text().replace(",", "")
    for key in ("reserved_bytes", "context_bytes", "device_bytes", "capacity_bytes"):
        assert str(want[key]) in table, key
    # the estimator's notes about the card, worded by code (bf16 on a T4)
    codes = [n["code"] for n in want["notes"]]
    assert codes == ["bf16-emulated", "sdpa-math"]
    shown = page.locator(".tm-calc-gpu-note")
    assert [shown.nth(i).get_attribute("data-code") for i in range(2)] == codes
    assert "fp16-amp" in shown.nth(0).inner_text()
    assert page.locator(".tm-calc-timeline polygon").count() == 6
    assert page.locator(".tm-calc-timeline polyline").count() == 1
    page.click(".tm-fit-button")
    page.wait_for_function(
        "() => document.querySelector('.tm-fit-out').dataset.maxBatch !== undefined",
        timeout=120000,
    )
    argv = [sys.executable, "-m", "trainmem", "fit", "--model", "llama2-7b"]
    argv += ["--method", "qlora", "--batch", "4", "--gpu", "T4", "--json"]
    fit = json.loads(
        subprocess.run(
            argv, capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout
    )
    out = page.locator(".tm-fit-out")
    assert out.get_attribute("data-max-batch") == str(fit["max_batch"])
    text = out.inner_text()
    assert f"最大微批 {fit['max_batch']}" in text
    if "cheapest_change" in fit:
        assert "最省事的改法" in text, text
    assert not english_phrase(text), text
    assert not problems, "\n".join(problems)


def test_nvidia_smi_rows_on_more_than_one_gpu(calc_page, tmp_path):
    """On more than one GPU the page breaks nvidia-smi down as the CLI's table does:
    the CUDA context and NCCL's buffers, with the communicators and channels they
    count (two communicators under DeepSpeed, 24 channels between A100s)."""
    page, problems = _fresh(calc_page)
    values = {"model": "llama2-7b", "method": "lora", "zero": "3", "gpus": "2"}
    values.update({"zero-impl": "deepspeed", "gpu": "A100-40GB"})
    _ask(page, values, None)
    want = json.loads(_cli(values, None, tmp_path).stdout)
    table = page.locator(".tm-gpu-table").inner_text()
    assert str(want["nccl_bytes"]) in table.replace(",", "")
    comms, channels = want["nccl_communicators"], want["nccl_channels"]
    assert (comms, channels) == (2, 24)
    assert f"{comms} 个通信器 × {channels} 个通道" in table
    assert not problems, "\n".join(problems)


def test_chapter3_embeds_the_calculator(site, tmp_path):
    b, base = site
    page, problems = open_offline(b, base, "book/03_training_memory.html")
    try:
        calc_el = page.locator(".tm-calc")
        assert calc_el.count() == 1
        # it starts Pyodide when it comes into view
        calc_el.scroll_into_view_if_needed()
        _first_answer(page)
        ref = json.loads(_cli({}, None, tmp_path).stdout)
        assert page.get_attribute(".tm-calc-result", "data-total-bytes") == str(
            ref["total_bytes"]
        )
        assert not problems, "\n".join(problems)
    finally:
        page.context.close()


def test_chapter1_format_explorer_is_live(site):
    """Chapter 1's number-format explorer runs trainmem.formats in the page: the same
    table as describe_value in this Python, for the first value and for typed ones."""
    from trainmem.formats import describe_value

    b, base = site
    page, problems = open_offline(b, base, "book/01_number_formats.html")
    try:
        root = page.locator(".tm-fmt")
        assert root.count() == 1
        root.scroll_into_view_if_needed()
        page.wait_for_selector(
            ".tm-fmt[data-state=ready]", state="attached", timeout=120000
        )
        out = page.locator(".tm-fmt-out")
        first = page.get_attribute(".tm-fmt input[name=x]", "value")
        assert out.inner_text().strip() == describe_value(float(first))
        for text in ("65504", "1e-8", "-2.5", "0.50001", "abc"):
            seq = int(out.get_attribute("data-seq"))
            page.fill(".tm-fmt input[name=x]", text)
            page.wait_for_function(
                "s => Number(document.querySelector('.tm-fmt-out').dataset.seq) > s",
                arg=seq,
                timeout=60000,
            )
            want = (
                describe_value(float(text))
                if text != "abc"
                else "这不是一个数：'abc'（可以试 0.1、65504、1e-8）"
            )
            assert out.inner_text().strip() == want, text
        assert not problems, "\n".join(problems)
    finally:
        page.context.close()


@pytest.mark.parametrize(
    "chapter",
    [
        "06_lora_in_practice",
        "08_attention_inference_troubleshooting",
        "09_beyond_one_gpu",
    ],
)
def test_chapters_link_to_the_calculator(site, chapter):
    nb = nbformat.read(ROOT / "book" / f"{chapter}.ipynb", as_version=4)
    assert any(
        "calculator.md" in c.source for c in nb.cells if c.cell_type == "markdown"
    )
    html = (HTML / "book" / f"{chapter}.html").read_text(encoding="utf-8")
    assert 'href="calculator.html"' in html


def test_site_carries_the_runtime_not_a_cdn(site):
    root = HTML / "_static" / "calculator"
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    shipped, _ = calc.browser_modules()
    assert manifest["files"] == [
        calc._module_file(m).relative_to(ROOT).as_posix() for m in shipped
    ] + [f.relative_to(ROOT).as_posix() for f in calc.browser_data()]
    for f in manifest["files"]:
        assert (root / "py" / f).read_bytes() == (ROOT / f).read_bytes()
    for f in calc.PYODIDE_FILES:
        assert (root / "pyodide" / f).is_file(), f
    js = (root / "calculator.js").read_text(encoding="utf-8")
    # the SVG namespace of the timeline is an identifier, not an address it fetches
    js = js.replace('"http://www.w3.org/2000/svg"', "SVG_NS")
    assert "http://" not in js and "https://" not in js, (
        "the calculator must load nothing from another host"
    )


def _option_values() -> set[str]:
    """The option values and names a Chinese text may quote as they are."""
    out = set()
    for f in calc.form_fields():
        out.add(f["name"])
        out.update(f.get("choices") or [])
    return out


def test_every_option_has_a_chinese_tooltip():
    """The form's tooltips are Chinese (the CLI's --help stays English): an option
    added to the CLI without a line in calculator.TIPS fails here."""
    values = _option_values()
    for f in calc.form_fields():
        assert f["name"] in calc.TIPS, f"no Chinese tooltip for --{f['name']}"
        assert re.search(r"[\u4e00-\u9fff]", f["help"]), f["help"]
        assert not english_phrase(f["help"], values), (f["name"], f["help"])
        assert f["label"] != f["flag"], f"no Chinese label for {f['flag']}"


def test_page_names_every_model_type_it_reads():
    """The page's list of config.json model types is the registry's: a family added to
    trainmem.families.MODEL_TYPES without a word on the calculator page fails here."""
    from pathlib import Path

    from trainmem.families import MODEL_TYPES

    text = (Path(__file__).resolve().parents[1] / "book" / "calculator.md").read_text()
    missing = [m for m in MODEL_TYPES if f"`{m}`" not in text]
    assert not missing, f"book/calculator.md does not name model types {missing}"


_SHOWN_TEXT = """sel => [...document.querySelectorAll(sel)].map(e => {
  const c = e.cloneNode(true);
  c.querySelectorAll('code').forEach(x => x.remove());
  return c.textContent;
}).join('\\n')"""


def test_answers_advice_and_errors_are_chinese(calc_page):
    """What the calculator says (the answer, the phases, the fit's advice, a refused
    input's reason) is Chinese with English terms in parentheses; only the CLI's own
    message, quoted as code, stays English."""
    page, problems = _fresh(calc_page)
    values = _option_values()
    _ask(page, {"model": "llama2-7b", "batch": "8", "gpu": "T4"}, None)
    said = page.evaluate(_SHOWN_TEXT, ".tm-calc-result, .tm-calc-jump")
    assert not english_phrase(said, values), english_phrase(said, values)
    page.click(".tm-fit-button")
    page.wait_for_function(
        "() => document.querySelector('.tm-fit-out').dataset.maxBatch !== undefined",
        timeout=120000,
    )
    fit = page.locator(".tm-fit-out").inner_text()
    assert "最省事的改法" in fit and not english_phrase(fit, values), fit
    for bad in ({"batch": "0"}, {"method": "lora", "lora-dropout": "1.5"}):
        _ask(page, bad, None)
        said = page.evaluate(_SHOWN_TEXT, ".tm-calc-error")
        assert "须为" in said and not english_phrase(said, values), said
    assert not problems, "\n".join(problems)


def test_phone_reader_is_pointed_to_the_answer(calc_page):
    """On a phone the answer is far below the form: a pointer above the form states the
    peak and jumps to the answer."""
    page, problems = _fresh(calc_page)
    page.set_viewport_size({"width": 390, "height": 844})
    _ask(page, {}, None)
    page.evaluate("() => document.querySelector('.tm-calc').scrollIntoView()")
    jump = page.locator(".tm-calc-jump")
    assert jump.is_visible() and "GiB" in jump.inner_text(), jump.inner_text()
    below = page.evaluate(
        "() => document.querySelector('.tm-calc-result').getBoundingClientRect().top"
        " - document.querySelector('.tm-calc-jump').getBoundingClientRect().top"
    )
    assert below > 844, f"the answer is only {below}px below the pointer"
    jump.click()
    page.wait_for_function(
        "() => { const t = document.querySelector('.tm-calc-result')"
        ".getBoundingClientRect().top; return t >= 0 && t < 200; }",
        timeout=5000,
    )
    assert not problems, "\n".join(problems)
