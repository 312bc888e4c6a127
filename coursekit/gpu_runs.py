"""Recorded runs of the book's GPU cells on a real GPU, shown beside the CPU run.

A GPU cell's stored output is the run CI checks (on the CPU at small size, where the
book was executed without CUDA). Where a section's lesson depends on the hardware
(TFLOPS, allocated / reserved / nvidia-smi bytes, compile speed-ups), the page also
shows what the same cell printed on a real GPU: the text below is that run's output,
kept as data (``coursekit/data/gpu_runs/<run>.json``: the GPU, the library versions,
and each GPU cell's printed text keyed ``<notebook stem>/<cell id>``).

``show_recorded(key)`` prints one cell's recorded output under a label line naming
the GPU, the date and the versions, so the reader can tell it from the CPU run.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).parent / "data" / "gpu_runs"
# : The run the book shows by default.
DEFAULT_RUN = "h200-2026-12-04"
# : First line of a recorded GPU output (the book styles it like the GPU cells' labels).
RECORDED_LABEL = (
    "以下为同一单元在 {gpu}（计算能力 {cc}）上的一次真实运行的输出"
    "（{date}；{versions}）。"
)
VERSION_KEYS = ("torch", "cuda", "transformers", "peft", "bitsandbytes")


@lru_cache(maxsize=None)
def load_run(run: str = DEFAULT_RUN) -> dict:
    """The recorded run ``run`` (a file name under ``coursekit/data/gpu_runs``)."""
    path = DATA / f"{run}.json"
    if not path.is_file():
        known = sorted(p.stem for p in DATA.glob("*.json"))
        raise ValueError(f"run must be one of {known}, got {run!r}")
    return json.loads(path.read_text(encoding="utf-8"))


def recorded_label(run: str = DEFAULT_RUN) -> str:
    """The label line of a recorded output: the GPU, its compute capability, the date
    and the versions that matter."""
    data = load_run(run)
    v = data["versions"]
    versions = "、".join(f"{k} {v[k]}" for k in VERSION_KEYS if k in v)
    cc = ".".join(str(x) for x in data["capability"])
    return RECORDED_LABEL.format(
        gpu=data["gpu"], cc=cc, date=data["date"], versions=versions
    )


def recorded_output(key: str, run: str = DEFAULT_RUN) -> str:
    """The text a GPU cell printed on the recorded run, without its own label line.

    ``key`` is ``"<notebook stem>/<cell id>"``; an unknown key raises ValueError
    naming the keys the run holds.
    """
    cells = load_run(run)["cells"]
    if key not in cells:
        raise ValueError(f"key must be one of {sorted(cells)}, got {key!r}")
    lines = cells[key].splitlines()
    # The cell's own first line is its GPU label ("以下为在 GPU（…）上运行的输出。")
    while lines and (not lines[0].strip() or lines[0].startswith("以下为在 GPU（")):
        lines.pop(0)
    return "\n".join(lines).rstrip() + "\n"


def show_recorded(key: str, run: str = DEFAULT_RUN) -> None:
    """Print the recorded GPU output of one cell under its label line."""
    print(recorded_label(run))
    print(recorded_output(key, run), end="")


def recorded_match(key: str, pattern: str, run: str = DEFAULT_RUN) -> tuple[str, ...]:
    """The groups of the first match of the regular expression ``pattern`` in one
    cell's recorded output (numbers a page cites from the run, as printed)."""
    import re

    m = re.search(pattern, recorded_output(key, run))
    if m is None:
        raise ValueError(
            f"pattern {pattern!r} not found in the recorded output of {key}"
        )
    return m.groups()


def recorded_steps(run: str = DEFAULT_RUN) -> dict[str, dict]:
    """The training steps measured on the recorded run, by id: each with ``job``
    (model shape, method, precision, batch, sequence, checkpointing, attention,
    LoRA settings, recipe), the library ``versions``, ``step_peak``
    (``max_memory_allocated`` of steps 2-3), ``reserved_peak`` and ``nvml_proc``
    (the process's bytes as nvidia-smi counts them). ``job["model"]`` names a
    config of :func:`recorded_models`."""
    return {s["id"]: s for s in load_run(run).get("steps", [])}


def recorded_models(run: str = DEFAULT_RUN) -> dict[str, dict]:
    """The model configs (random weights of published shapes) the recorded training
    steps ran, by the name their ``job["model"]`` gives."""
    return dict(load_run(run).get("models", {}))


def recorded_step(step_id: str, run: str = DEFAULT_RUN) -> dict:
    """One of :func:`recorded_steps` (its ``job`` also says ``recipe`` "loop" or
    "trainer", Trainer ``args`` and the checkpoint's ``save_dtype``). An unknown id
    raises ValueError naming the ids the run holds."""
    steps = recorded_steps(run)
    if step_id not in steps:
        raise ValueError(f"step_id must be one of {sorted(steps)}, got {step_id!r}")
    return steps[step_id]


def trainer_step_inputs(step_id: str, run: str = DEFAULT_RUN) -> dict:
    """What ``trainmem hf`` is given for a recorded ``Trainer`` step: the model's
    ``config.json`` as the run saved it (the shape, with ``dtype`` the checkpoint's
    ``save_dtype``), the ``TrainingArguments`` fields it set, the peft
    ``adapter_config.json`` fields, ``seq`` and the run's library versions (as
    ``--versions`` takes them), as keyword arguments of
    :func:`trainmem.estimate.estimate_from_hf`."""
    row = recorded_step(step_id, run)
    job = row["job"]
    if job["recipe"] != "trainer":
        raise ValueError(f"step_id {step_id!r} is a {job['recipe']!r} run, not Trainer")
    config = dict(recorded_models(run)[job["model"]])
    if job.get("save_dtype"):
        config["dtype"] = job["save_dtype"]
    peft = None
    if job["method"] != "full":
        peft = {
            "peft_type": "LORA",
            "r": job["r"],
            "lora_alpha": job["alpha"],
            "target_modules": list(job["targets"]),
            "lora_dropout": job["dropout"],
        }
    return dict(
        model=config,
        training_args=dict(job["args"]),
        peft_config=peft,
        seq=job["seq"],
        versions=",".join(f"{k}={v}" for k, v in row["versions"].items()),
    )
