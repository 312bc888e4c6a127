"""The in-page memory calculator: ``python -m trainmem estimate`` run by Pyodide in the
reader's browser.

* ``{format-explorer}`` makes chapter 1's number-format explorer live the same way
  (``trainmem.formats.describe_value``; ``trainmem.formats`` needs only the standard
  library).
* The ``memory-calculator`` directive renders the form from the CLI's own argparse
  definitions (``trainmem.cli.build_parser()``: every option of ``estimate`` with its
  choices and default), so an option added to the CLI appears in the page without
  editing JavaScript.
* The page's script and style (``_ext/calculator_static/calculator/``) go into
  ``_static/calculator/`` and onto the pages that hold a calculator.
* At the end of an HTML build the Pyodide runtime (the npm package ``pyodide``,
  installed by ``npm ci``; never a CDN) and the pure-Python modules the estimator needs
  are copied into ``_static/calculator/``. Which modules: the import graph of
  ``trainmem.cli`` is walked (imports inside functions too) and every module that needs
  a package outside the standard library at import time (torch, numpy, transformers) is
  left out — together with every module that imports such a module at import time. The
  list is written to ``_static/calculator/manifest.json``.
* The page (``_static/calculator/calculator.js``) calls ``trainmem.cli.main(["estimate",
  ..., "--json"])`` — the function the command line calls — so it shows the same bytes
  and the same one-line error messages.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import html
import json
import shutil
import subprocess
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive, directives
from sphinx.errors import ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "trainmem"
ENTRY = "trainmem.cli"  # the calculator: python -m trainmem estimate
ENTRIES = (ENTRY, "trainmem.formats")  # + chapter 1's number-format explorer
PYODIDE_NPM = ROOT / "node_modules" / "pyodide"
# runtime files of the npm package that the browser loads (no source maps, typings,
# demos)
PYODIDE_FILES = (
    "pyodide.mjs",
    "pyodide.asm.mjs",
    "pyodide.asm.wasm",
    "python_stdlib.zip",
    "pyodide-lock.json",
    "package.json",
)
STATIC_DIR = "calculator"  # under _static/ of the built site
# calculator.js/.css live here, not in the book's _static/: Jupyter Book puts every .js
# and .css found in _static/ on every page, and the calculator's belong only on the
# pages that hold one.
ASSETS = Path(__file__).resolve().parent / "calculator_static"

# Chinese labels for the options the course discusses; an option without one shows its
# flag.
LABELS = {
    "model": "模型（model）",
    "method": "方法（method）",
    "precision": "精度（precision）",
    "optimizer": "优化器（optimizer）",
    "optimizer-impl": "优化器实现（optimizer-impl）",
    "batch": "微批大小（batch）",
    "seq": "序列长度（seq）",
    "grad-accum": "梯度累积（grad-accum）",
    "lora-rank": "LoRA 秩（lora-rank）",
    "lora-alpha": "LoRA alpha（lora-alpha）",
    "lora-targets": "LoRA 目标模块（lora-targets）",
    "lora-dtype": "适配器类型（lora-dtype）",
    "load-dtype": "加载 dtype（load-dtype）",
    "checkpointing": "激活检查点（checkpointing）",
    "attn": "注意力实现（attn）",
    "no-double-quant": "QLoRA 不做双重量化（no-double-quant）",
    "zero": "ZeRO 阶段（zero）",
    "gpus": "GPU 数（gpus）",
    "zero-impl": "分片实现（zero-impl）",
    "deepspeed-sizes": "DeepSpeed 桶大小（deepspeed-sizes）",
    "lora-dropout": "LoRA dropout（lora-dropout）",
    "use-cache": "KV 缓存（use-cache）",
    "versions": "库版本（versions）",
    "kbit-prepare": "k-bit 准备（kbit-prepare）",
    "gpu": "GPU 型号（gpu）",
    "kernels": "内核（kernels）",
    "checkpointing-mode": "检查点形式（checkpointing-mode）",
    "framework": "训练框架（framework）",
    "previous-seq": "上一个微批的 token 数（previous-seq，LitGPT）",
    "objective": "训练目标（objective）",
    "reference": "参考模型（reference）",
    "group-size": "每个提示的补全数（group-size，GRPO）",
    "max-completion-length": "补全长度（max-completion-length，GRPO）",
    "loss-impl": "损失实现（loss-impl）",
    "loss-chunk": "分块行数（loss-chunk）",
    "activation-offload": "激活卸载（activation-offload）",
    "context-parallel": "上下文并行 GPU 数（context-parallel）",
}
# The tooltip of each option, in Chinese (the CLI's --help stays English): every option
# the form shows has one (tests/test_calculator.py), so a new option needs a line here.
TIPS = {
    "model": (
        "预设模型名，或选“粘贴 config.json”用 Hugging Face 格式的模型配置；默认 l"
        "lama-7b"
    ),
    "method": "全参数微调（full）、LoRA，或 QLoRA（基座权重 4 位 NF4）；默认 full",
    "precision": (
        "fp32；fp16-amp / bf16-amp：fp32 参数上的自动混合精度（autocast），fp16 "
        "配损失缩放；bf16：参数、梯度、优化器状态都是 bf16；默认 bf16-amp"
    ),
    "optimizer": (
        "adamw：torch 的 AdamW，两个状态（exp_avg、exp_avg_sq）与参数同 dtype；ad"
        "amw8bit：bitsandbytes 的 8 位 AdamW（分块量化的状态）；paged_adamw：bits"
        "andbytes 的分页 AdamW（fp32 状态，大张量的状态放在分配器之外的统一内存）"
        "；sgd：无状态；sgd-momentum：一个动量缓冲；lion：一个动量缓冲；adafactor"
        "：按行、列分解的二阶矩"
    ),
    "optimizer-impl": (
        "优化器更新（step()）的实现，决定这一步的临时显存：foreach（CUDA 上 torch 的默"
        "认）、fused（Trainer 默认的 adamw_torch_fused）、for-loop（逐个参数）；"
        "默认取该优化器自己的"
    ),
    "batch": "微批大小（micro-batch，≥ 1）；默认 1",
    "seq": "序列长度（token 数，≥ 1）；默认 512",
    "grad-accum": "每次优化器更新累积的微批数（梯度累积）；默认 1",
    "lora-rank": "LoRA 的秩 r（1 ≤ r ≤ 目标模块最小的输入/输出宽度）；默认 8",
    "lora-alpha": "LoRA 的 alpha（缩放 alpha/r，不影响显存）；默认 16",
    "lora-targets": (
        "加 LoRA 的模块名，逗号分隔，如 q_proj,k_proj,v_proj,o_proj,gate_proj,up_"
        "proj,down_proj（gpt2：c_attn,attn.c_proj,c_fc,mlp.c_proj）；默认 q_proj,"
        "v_proj"
    ),
    "lora-dtype": "适配器参数的 dtype；默认取 peft 的（fp32 适配器）",
    "load-dtype": (
        "加载权重的 dtype（from_pretrained 的 dtype），与自动混合精度（autocast）"
        "无关。默认：LoRA（hf）在 fp16-amp / bf16-amp 下按自动混合精度的 16 位 dtype"
        " 加载（用户实际跑的配方：16 位底座、fp32 适配器、自动混合精度）；全参数微调与 "
        "QLoRA 取精度的（混合精度下 fp32，纯 bf16 下 bf16）"
    ),
    "no-double-quant": "QLoRA 不对 NF4 的量化常数再做一次量化（双重量化）",
    "checkpointing": (
        "每个 decoder 层做激活检查点（activation / gradient checkpointing）"
    ),
    "attn": (
        "注意力实现：sdpa（flash 显存相同）、eager（保存 b×头数×s×s 的分数）、mat"
        "h（SDPA 的数学路径：fp32 分数与 softmax）；默认 sdpa"
    ),
    "zero": (
        "ZeRO/FSDP 阶段：1 切分优化器状态与主权重，2 再切分梯度，3 再切分权重；0 "
        "不切分；默认 0"
    ),
    "gpus": (
        "数据并行的 GPU 数（≥ 1）；ZeRO 为 0 时是 torch DDP，它的梯度桶再存一份可"
        "训练参数的梯度；默认 1"
    ),
    "zero-impl": (
        "ZeRO 2/3 由谁切分：fsdp（torch FSDP，每个 decoder 层一个单元，预取下一个"
        "）或 deepspeed（DeepSpeed ZeRO：梯度桶、逐模块收集、小参数不切分）；默认"
        " fsdp"
    ),
    "deepspeed-sizes": (
        "DeepSpeed 的桶大小：defaults（DeepSpeed 自己的默认值）或 hf-auto（Traine"
        "r 的 “auto”，按 hidden 算）；默认 defaults"
    ),
    "checkpointing-mode": (
        "检查点的形式：non-reentrant（transformers 5.0 起的默认）或 reentrant（us"
        "e_reentrant=True，整层重算，输出保留到该层反向结束）；默认 non-reentrant"
    ),
    "lora-dropout": (
        "peft 的 lora_dropout（0 ≤ p < 1；大于 0 时每个被适配模块的输入多一份掩码"
        "与丢弃后的副本）；默认 0.0"
    ),
    "use-cache": (
        "前向的 KV 缓存；默认按 transformers 的决定（配置里开启，检查点时关闭）"
    ),
    "versions": (
        "行为随版本变化的库的版本，如 transformers=4.48.1,peft=0.13.2（可只写一部"
        "分；默认是本课程固定的版本）"
    ),
    "kbit-prepare": (
        "QLoRA：peft 表示 prepare_model_for_kbit_training（未量化的权重升为 fp32"
        "），none 表示基座保持 16 位加载 dtype；默认 peft"
    ),
    "kernels": (
        "这一步跑在谁的内核上：cuda（估算描述的情形）或 cpu（trainmem.measure 校"
        "验的情形）；默认 cuda"
    ),
    "previous-seq": (
        "LitGPT：这一步第一个微批之前那个微批的 token 数，它的 logits 在前向时仍"
        "被引用；0 表示没有；默认等于序列长度"
    ),
    "framework": (
        "谁的训练步：hf（transformers + peft，Trainer 的循环）或 litgpt（LitGPT "
        "的 GPT）；默认 hf"
    ),
    "objective": (
        "训练目标：sft（监督微调，batch×seq 上的交叉熵）；dpo（TRL 的 DPOTrainer"
        "：批大小数偏好对，策略模型对 2×batch 条 chosen 与 rejected 前向、反向，参"
        "考模型只前向、不建计算图）；grpo（TRL 的 GRPOTrainer：批大小数补全条数，每"
        "条是 seq 个提示 token 加生成的补全，logits 只算补全部分，先带 KV 缓存生成）"
        "；默认 sft"
    ),
    "reference": (
        "dpo / grpo 的参考模型（reference model）：copy（冻结的第二份模型）、adap"
        "ter（关掉 LoRA 适配器的底座）、precomputed（DPO 预先算好的 log 概率）、non"
        "e（GRPO 默认 beta=0.0，没有参考模型）；auto：LoRA 下用 adapter，否则 DPO "
        "用 copy、GRPO 用 none；默认 auto"
    ),
    "group-size": (
        "grpo：每个提示生成的补全条数（GRPOConfig.num_generations），须整除 批大"
        "小×梯度累积×GPU 数；默认 8"
    ),
    "max-completion-length": (
        "grpo：每条补全生成的 token 数（GRPOConfig.max_completion_length）；默认 512"
    ),
    "loss-impl": (
        "因果语言模型损失的实现：standard（lm_head 的 logits 整块算出，再做 fp32 "
        "交叉熵）或 chunked（融合线性层与交叉熵，按 Cut Cross-Entropy / Liger 的做"
        "法分块算 logits、反向时重算，从不整块保留）；默认 standard"
    ),
    "loss-chunk": "chunked 损失每块的行数（token 数）；默认 1024",
    "activation-offload": (
        "激活卸载（TRL 的 activation_offloading）：自动求导（autograd）保存的张量"
        "前向时拷到主机内存、反向时拷回；参数、小于 1 KiB 的张量、"
        "被保存两次的存储与 lm_head 的输入留在 GPU 上"
    ),
    "context-parallel": (
        "上下文并行（context parallelism）：把序列切到这么多张 GPU 上（torch 的环形"
        "注意力（ring attention），负载均衡，seq 须能被 2×N 整除）；每张卡的激活降为"
        " seq/N 个 token，权重、梯度与优化器状态不变（要切它们再加 ZeRO）；默认 1"
    ),
    "gpu": (
        "GPU 型号：加上缓存分配器保留的显存（reserved）、nvidia-smi 显示的显存（"
        "下限）、是否放得下与余量"
    ),
}
SKIP = {"help", "json", "timeline"}  # the page always asks for --json --timeline
CONFIG_CHOICE = "config.json"  # model value that means: the pasted config.json


# --------------------------------------------------------------------------------------
# which modules go to the browser
# --------------------------------------------------------------------------------------
def _module_file(name: str, root: Path = ROOT) -> Path | None:
    base = root.joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path):
    """(module names imported at import time, module names imported lazily) by
    ``name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    pkg = name if is_pkg else name.rpartition(".")[0]
    eager, lazy = set(), set()

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            parts = pkg.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1])
        else:
            base = ""
        mod = ".".join(p for p in (base, node.module or "") if p)
        # "from . import models" / "from .memory import ops": the names may be
        # submodules
        return [mod] + [f"{mod}.{a.name}" for a in node.names if a.name != "*"]

    def visit(node, at_import: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                return
            (eager if at_import else lazy).update(targets(node))
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, at_import)
            return
        inner = at_import and not isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return eager, lazy


def _optional_imports(path: Path) -> set[str]:
    """Top-level names imported inside ``try: ... except ImportError`` (optional at
    import time)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Try) and any(
            h.type is not None and "ImportError" in ast.unparse(h.type)
            for h in node.handlers
        ):
            for sub in node.body:
                for n in ast.walk(sub):
                    if isinstance(n, ast.Import):
                        out.update(a.name for a in n.names)
                    elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                        out.add(n.module)
    return out


def browser_modules(
    entries: tuple[str, ...] = ENTRIES, root: Path = ROOT
) -> tuple[list[str], dict[str, str]]:
    """The modules of ``trainmem`` reached from ``entries`` that import only the
    standard library (and each other) at import time.

    Returns ``(shipped, left_out)``: ``shipped`` are module names (packages included,
    sorted); ``left_out`` maps each reached module that cannot run without a third-party
    package to the reason. Imports inside functions are followed (the estimator imports
    lazily) but do not disqualify a module: a function that needs torch is simply not
    called by ``estimate``.
    """
    stdlib = set(sys.stdlib_module_names)
    graph: dict[str, tuple[set[str], set[str]]] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in graph:
            continue
        path = _module_file(name, root)
        if path is None:
            continue
        eager, lazy = _imports(name, path)
        optional = _optional_imports(path)
        eager = {m for m in eager if m.split(".")[0] not in optional}
        graph[name] = (eager, lazy)
        parent = name.rpartition(".")[0]
        if parent:
            todo.append(parent)  # importing a.b runs a/__init__.py first
        todo.extend(m for m in eager | lazy if m.split(".")[0] == PACKAGE)

    left_out: dict[str, str] = {}
    for name, (eager, _) in graph.items():
        third = sorted({m.split(".")[0] for m in eager} - stdlib - {PACKAGE})
        if third:
            left_out[name] = "imports " + ", ".join(third) + " at import time"
    changed = True
    while changed:  # a module importing a left-out module is out too
        changed = False
        for name, (eager, _) in graph.items():
            if name in left_out:
                continue
            bad = sorted(m for m in eager if m in left_out)
            parent = name.rpartition(".")[0]
            if parent in left_out:
                bad.append(parent)
            if bad:
                left_out[name] = "imports " + ", ".join(bad) + " at import time"
                changed = True
    shipped = sorted(n for n in graph if n not in left_out)
    for entry in entries:
        if entry not in shipped:
            raise ExtensionError(
                f"calculator: {entry} cannot run in the browser: {left_out.get(entry)}"
            )
    return shipped, left_out


def browser_data(root: Path = ROOT) -> list[Path]:
    """The data files the shipped modules read: the recorded traces of the model
    families (``trainmem/data/families/*.json``, read by
    :mod:`trainmem.memory.traced`)."""
    return sorted((root / PACKAGE / "data" / "families").glob("*.json"))


# --------------------------------------------------------------------------------------
# the form, from argparse
# --------------------------------------------------------------------------------------
def _estimate_parser() -> argparse.ArgumentParser:
    from trainmem.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["estimate"]
    raise ExtensionError("calculator: trainmem.cli has no 'estimate' command")


def form_fields() -> list[dict]:
    """One dict per option of ``python -m trainmem estimate`` (argparse order)."""
    from trainmem.families import preset_names

    out = []
    for a in _estimate_parser()._actions:
        if not a.option_strings or a.dest in SKIP:
            continue
        flag = max(a.option_strings, key=len)
        name = flag.lstrip("-")
        f = {
            "name": name,
            "flag": flag,
            "help": TIPS.get(name, a.help or ""),
            "label": LABELS.get(name, flag),
        }
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            f["kind"] = "flag"
        elif name == "model":
            f.update(
                kind="model",
                choices=preset_names() + [CONFIG_CHOICE],
                default=a.default,
            )
        elif a.choices is not None:
            f.update(
                kind="choice",
                choices=[str(c) for c in a.choices],
                default=None if a.default is None else str(a.default),
            )
        else:
            f.update(kind="text", default="" if a.default is None else str(a.default))
        out.append(f)
    return out


def _field_html(f: dict, uid: str) -> str:
    e = html.escape
    fid = f"{uid}-{f['name']}"
    attrs = (
        f'name="{e(f["name"])}" id="{fid}" data-flag="{e(f["flag"])}" '
        f'data-kind="{f["kind"]}"'
    )
    tip = f' title="{e(f["help"])}"' if f["help"] else ""
    when = ""
    if f["name"].startswith("lora-"):
        when = ' data-when="lora qlora"'
    elif f["name"] in ("no-double-quant", "kbit-prepare"):
        when = ' data-when="qlora"'
    if f["kind"] == "flag":
        return (
            f'<div class="tm-field tm-flag"{when}{tip}><label for="{fid}">'
            f'<input type="checkbox" {attrs}> {e(f["label"])}</label></div>'
        )
    label = f'<label for="{fid}">{e(f["label"])}</label>'
    if f["kind"] in ("choice", "model"):
        opts = []
        if f["kind"] == "choice" and f["default"] is None:
            opts.append('<option value="" selected>默认</option>')
        for c in f["choices"]:
            sel = " selected" if c == f["default"] else ""
            text = (
                "粘贴 config.json…"
                if f["kind"] == "model" and c == CONFIG_CHOICE
                else c
            )
            opts.append(f'<option value="{e(c)}"{sel}>{e(text)}</option>')
        options = "".join(opts)
        return (
            f'<div class="tm-field"{when}{tip}>{label}'
            f"<select {attrs}>{options}</select></div>"
        )
    mode = ' inputmode="numeric"' if f["default"].isdigit() else ""
    return (
        f'<div class="tm-field"{when}{tip}>{label}<input type="text" {attrs}{mode} '
        f'value="{e(f["default"])}" autocomplete="off" spellcheck="false"></div>'
    )


def calculator_html(uid: str, load: str) -> str:
    fields = "".join(_field_html(f, uid) for f in form_fields())
    return f"""<div class="tm-calc" id="{uid}" data-load="{load}">
<form class="tm-calc-form" autocomplete="off" onsubmit="return false">
<div class="tm-calc-grid">{fields}</div>
<div class="tm-calc-config" hidden>
<label for="{uid}-config-json">config.json（Hugging Face 格式，model_type 为
 llama、mistral、qwen2 或 gpt2）</label>
<textarea name="config-json" id="{uid}-config-json" rows="7" spellcheck="false"
 placeholder='{{"model_type": "llama", "vocab_size": 32000,
 "hidden_size": 4096, ...}}'></textarea>
</div>
</form>
<p class="tm-calc-status" role="status">计算器需要 JavaScript：
正在加载浏览器内的 Python（Pyodide）…</p>
<div class="tm-calc-result" aria-live="polite"></div>
</div>"""


class calculator_node(nodes.General, nodes.Element):
    pass


def _visit_html(self, node):
    self.body.append(calculator_html(node["uid"], node["load"]))
    raise nodes.SkipNode


def _skip(self, node):
    raise nodes.SkipNode


class format_node(calculator_node):
    pass


def _visit_format_html(self, node):
    e = html.escape
    uid, value = node["uid"], node["value"]
    load = node["load"]
    self.body.append(f"""<div class="tm-calc tm-fmt" id="{uid}" data-load="{load}">
<form class="tm-calc-form" autocomplete="off" onsubmit="return false">
<div class="tm-field tm-fmt-field"><label for="{uid}-x">x =</label>
<input type="text" name="x" id="{uid}-x" value="{e(value)}"
 placeholder="0.1, 65504, 1e-8, -2.5 …" autocomplete="off" spellcheck="false"></div>
</form>
<p class="tm-calc-status" role="status">这个演示需要 JavaScript：
浏览器内的 Python（Pyodide）运行 trainmem.formats。</p>
<pre class="tm-fmt-out" aria-live="polite"></pre>
</div>""")
    raise nodes.SkipNode


class MemoryCalculator(Directive):
    """``{memory-calculator}`` — the calculator. ``:load: visible`` starts Pyodide only
    when the calculator scrolls into view (for a chapter page); the default
    ``immediate`` starts it at once."""

    has_content = False
    option_spec = {"load": lambda v: directives.choice(v, ("immediate", "visible"))}

    def run(self):
        env = self.state.document.settings.env
        n = env.new_serialno("memory-calculator")
        node = calculator_node()
        node["uid"] = f"tm-calc-{n}"
        node["load"] = self.options.get("load", "immediate")
        return [node]


class FormatExplorer(Directive):
    """``{format-explorer}`` — chapter 1's number-format explorer, live: the table of
    ``trainmem.formats.describe_value(float(x))`` for the number typed (what the
    ipywidgets demo prints). ``:value:`` the first number (default 0.1); ``:load:`` as
    for the calculator (default ``visible``)."""

    has_content = False
    option_spec = {
        "value": directives.unchanged,
        "load": lambda v: directives.choice(v, ("immediate", "visible")),
    }

    def run(self):
        env = self.state.document.settings.env
        node = format_node()
        node["uid"] = f"tm-fmt-{env.new_serialno('format-explorer')}"
        node["value"] = self.options.get("value", "0.1")
        node["load"] = self.options.get("load", "visible")
        return [node]


# --------------------------------------------------------------------------------------
# build steps
# --------------------------------------------------------------------------------------
def ensure_pyodide() -> Path:
    """``node_modules/pyodide`` (runs ``npm ci`` when it is missing, e.g. a fresh
    clone)."""
    if not (PYODIDE_NPM / "pyodide.asm.wasm").is_file():
        npm = shutil.which("npm")
        if npm is None:
            raise ExtensionError(
                "calculator: node_modules/pyodide is missing and npm is not "
                "installed (install Node.js, then run `npm ci`)"
            )
        logger.info("calculator: npm ci (Pyodide runtime for the in-page calculator)")
        r = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0 or not (PYODIDE_NPM / "pyodide.asm.wasm").is_file():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise ExtensionError(f"calculator: `npm ci` failed: {last}")
    return PYODIDE_NPM


# CLI runs that decide which standard modules get bytecode: the page's first answer and
# an error
BYTECODE_RUNS = (
    ["estimate", "--json"],
    ["estimate", "--method=lora", "--json"],
    ["estimate", "--batch=0", "--json"],
)


def compiled_stdlib(npm: Path, lib: Path, cache: Path) -> dict:
    """``python_stdlib.zip`` plus bytecode for the standard modules the estimator's page
    imports (``_ext/calculator_stdlib.mjs``, run with Node.js by the very Pyodide the
    page loads; about halves the time to the first answer). Cached under ``cache`` by
    the inputs' hash."""
    script = Path(__file__).resolve().parent / "calculator_stdlib.mjs"
    h = hashlib.sha256()
    for f in [
        npm / "package.json",
        npm / "python_stdlib.zip",
        script,
        *sorted(lib.rglob("*.py")),
    ]:
        h.update(f.name.encode() + f.read_bytes())
    h.update(json.dumps(BYTECODE_RUNS).encode())
    out = cache / f"python_stdlib-{h.hexdigest()[:16]}.zip"
    info = out.with_suffix(".json")
    if out.is_file() and info.is_file():
        return {"zip": out, **json.loads(info.read_text(encoding="utf-8"))}
    node = shutil.which("node")
    if node is None:
        raise ExtensionError(
            "calculator: Node.js is needed to build the calculator (npm comes with it)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    logger.info(
        "calculator: compiling the standard modules the page imports (Pyodide under "
        "Node)"
    )
    r = subprocess.run(
        [node, str(script), str(npm), str(lib), str(out)]
        + [json.dumps(a) for a in BYTECODE_RUNS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0 or not out.is_file():
        last = ((r.stderr or r.stdout).strip().splitlines() or ["no output"])[-1]
        raise ExtensionError(f"calculator: {script.name} failed: {last}")
    report = json.loads(r.stdout.strip().splitlines()[-1])
    info.write_text(json.dumps(report), encoding="utf-8")
    return {"zip": out, **report}


def _add_assets(app, pagename, templatename, context, doctree):
    """The calculator's script and style on the pages that hold a calculator, and only
    there. (``app.add_js_file`` would also register them in the global registry, i.e. on
    later pages.)"""
    if doctree is None or not any(True for _ in doctree.findall(calculator_node)):
        return
    from sphinx.builders.html._assets import _CascadingStyleSheet, _JavaScript

    # these lists are the builder's; Sphinx restores them after each page
    context["script_files"].append(
        _JavaScript(f"_static/{STATIC_DIR}/calculator.js", defer="defer")
    )
    context["css_files"].append(
        _CascadingStyleSheet(
            f"_static/{STATIC_DIR}/calculator.css", rel="stylesheet", type="text/css"
        )
    )


def _copy_runtime(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    dest = Path(app.outdir) / "_static" / STATIC_DIR
    # the script and style once more: an incremental build that writes no page skips
    # Sphinx's copy of the static files, so an edited calculator.js would otherwise not
    # arrive
    shutil.copytree(ASSETS / STATIC_DIR, dest, dirs_exist_ok=True)
    npm = ensure_pyodide()
    version = json.loads((npm / "package.json").read_text(encoding="utf-8"))["version"]
    shipped, left_out = browser_modules()
    py = dest / "py"
    if py.exists():
        shutil.rmtree(py)
    files = []
    for src in [_module_file(name) for name in shipped] + browser_data():
        rel = src.relative_to(ROOT).as_posix()
        (py / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, py / rel)
        files.append(rel)
    (dest / "pyodide").mkdir(parents=True, exist_ok=True)
    for f in PYODIDE_FILES:
        shutil.copy2(npm / f, dest / "pyodide" / f)
    stdlib = compiled_stdlib(npm, py, Path(app.outdir).parent / ".calculator-cache")
    shutil.copy2(stdlib["zip"], dest / "pyodide" / "python_stdlib.zip")
    manifest = {
        "pyodide": version,
        "entries": list(ENTRIES),
        "files": files,
        "left_out": left_out,
        "stdlib_bytecode": {k: v for k, v in stdlib.items() if k != "zip"},
    }
    (dest / "manifest.json").write_text(
        json.dumps(manifest, indent=1), encoding="utf-8"
    )


def _static_path(app):
    app.config.html_static_path.append(str(ASSETS))


def setup(app):
    app.connect("builder-inited", _static_path)
    app.add_node(
        calculator_node,
        html=(_visit_html, None),
        latex=(_skip, None),
        text=(_skip, None),
        man=(_skip, None),
        texinfo=(_skip, None),
    )
    app.add_directive("memory-calculator", MemoryCalculator)
    app.add_node(
        format_node,
        html=(_visit_format_html, None),
        latex=(_skip, None),
        text=(_skip, None),
        man=(_skip, None),
        texinfo=(_skip, None),
    )
    app.add_directive("format-explorer", FormatExplorer)
    app.connect("html-page-context", _add_assets)
    app.connect("build-finished", _copy_runtime)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
