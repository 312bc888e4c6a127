"""Check the LitGPT replay against LitGPT's own code, on CPU.

LitGPT is not a dependency of the course. Extract the commit a published row ran
from a clone of Lightning-AI/litgpt, e.g.::

    git -C litgpt archive 8641822 lit_gpt | tar -x -C /tmp/lit8641822
    git -C litgpt archive 5895df10 litgpt | tar -x -C /tmp/lit5895df10

then run its LoRA ``GPT`` (a 2-layer Llama config, bf16, ``lm_head_chunk_size=128``,
the fp32 cast Fabric applies to the outputs, ``chunked_cross_entropy``, backward)
under :class:`trainmem.measuring.tracker.MemoryTracker`, and the replay of the same step
with ``kernels="cpu"`` (the first micro-batch: ``previous_seq=0``)::

    python benchmarks/litgpt_cpu_check.py /tmp/lit8641822 8641822

It prints, per case, the peak of live bytes in the forward and in the backward
(parameters and buffers included) for both, and their difference. Lightning is not
imported: the few names LitGPT's ``utils`` imports from it are stubbed."""

from __future__ import annotations

import argparse
import sys
import types

import torch

from trainmem.errors import OptionError
from trainmem.estimate import estimate
from trainmem.measuring.tracker import MemoryTracker

CASES = [  # batch, seq, (q, k, v adapted), lora_dropout, n_query_groups
    (1, 256, "101", 0.05, 4),
    (2, 256, "101", 0.05, 4),
    (1, 256, "111", 0.05, 4),
    (2, 256, "110", 0.0, 4),
    (2, 256, "101", 0.05, 2),
    (2, 256, "111", 0.05, 1),
]


class _RequirementCache:
    def __init__(self, *args, **kwargs):
        pass

    def __bool__(self):
        return True


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _RequirementCache if name == "RequirementCache" else object


def _stub_imports(package: str) -> None:
    names = ["lightning", "lightning_utilities"]
    names += [f"lightning.{m}" for m in ("fabric", "pytorch", "pytorch.loggers")]
    names += [
        f"lightning.fabric.{m}"
        for m in ("strategies", "utilities", "utilities.load", "loggers")
    ]
    names += ["lightning_utilities.core", "lightning_utilities.core.imports"]
    names += [f"{package}.prompts", f"{package}.tokenizer"]
    for name in names:
        sys.modules[name] = _Stub(name)


def run_case(lora, utils, commit, batch, seq, qkv, p, groups, layers=2):
    common = dict(
        n_layer=layers, n_embd=64, n_head=4, n_query_groups=groups,
        intermediate_size=172, vocab_size=256, padded_vocab_size=256,
        block_size=seq, bias=False, rotary_percentage=1.0,
        parallel_residual=False, norm_eps=1e-5,
    )  # fmt: skip
    on = [c == "1" for c in qkv]
    if hasattr(lora.Config, "norm_class_name"):
        cfg = lora.Config(
            **common, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
            lora_r=8, lora_alpha=16, lora_dropout=p,
            lora_query=on[0], lora_key=on[1], lora_value=on[2],
        )  # fmt: skip
    else:
        cfg = lora.Config(
            **common, _norm_class="RMSNorm", _mlp_class="LLaMAMLP", r=8, alpha=16,
            dropout=p, to_query=on[0], to_key=on[1], to_value=on[2],
        )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)  # Fabric's bf16-true init_module
    model = lora.GPT(cfg)
    torch.set_default_dtype(torch.float32)
    lora.mark_only_lora_as_trainable(model)
    ids = torch.randint(0, 256, (batch, seq))
    targets = torch.randint(0, 256, (batch, seq))
    tracker = MemoryTracker()
    for t in [*model.parameters(), *model.buffers(), ids, targets]:
        tracker.register(t)
    with tracker:
        tracker.set_phase("forward")
        logits = model(ids, lm_head_chunk_size=128)
        logits = [chunk.to(torch.float32) for chunk in logits]
        logits[-1] = logits[-1][..., :-1, :]
        loss = utils.chunked_cross_entropy(logits, targets[..., 1:])
        tracker.set_phase("backward")
        loss.backward()
    real_fwd = tracker.phase_peaks["forward"]
    real_bwd = tracker.phase_peaks["backward"]

    names = ("q_proj", "k_proj", "v_proj")
    shape = dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=172,
        num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=groups, max_position_embeddings=seq,
        tie_word_embeddings=False,
    )  # fmt: skip
    est = estimate(
        shape, framework="litgpt", precision="bf16", optimizer="adamw",
        method="lora", lora_rank=8, lora_alpha=16, lora_dropout=p,
        lora_targets=tuple(n for n, o in zip(names, on) if o), batch=batch,
        seq=seq, use_cache="off", versions=f"litgpt={commit}", kernels="cpu",
        previous_seq=0,
    ).to_dict()  # fmt: skip
    states = est["breakdown"]["optimizer_states"]  # not built by the real run
    peaks = est["phase_peaks"]
    return real_fwd, real_bwd, peaks["forward"] - states, peaks["backward"] - states


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", help="folder holding the extracted lit_gpt/ or litgpt/")
    ap.add_argument("commit", help="the commit it was extracted at (--versions)")
    args = ap.parse_args(argv)
    package = "lit_gpt" if args.commit.startswith("8641822") else "litgpt"
    sys.path.insert(0, args.tree)
    _stub_imports(package)
    lora = __import__(f"{package}.lora", fromlist=["GPT"])
    utils = __import__(f"{package}.utils", fromlist=["chunked_cross_entropy"])
    print(
        "| batch | seq | q k v | dropout | groups | real fwd peak | replay fwd peak "
        "| diff | real bwd peak | replay bwd peak | diff |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, seq, qkv, p, groups in CASES:
        try:
            rf, rb, sf, sb = run_case(lora, utils, args.commit, batch, seq, qkv, p,
                                      groups)  # fmt: skip
        except OptionError as e:
            print(f"| {batch} | {seq} | {qkv} | {p} | {groups} | refused: {e} |")
            continue
        print(f"| {batch} | {seq} | {qkv} | {p} | {groups} | {rf} | {sf} | {sf - rf}"
              f" | {rb} | {sb} | {sb - rb} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
