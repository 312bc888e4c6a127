"""Which kernel ``F.scaled_dot_product_attention`` runs, decided as torch decides it,
and what transformers hands it.

torch tries its backends in a priority order and takes the first whose checks all pass
(``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``;
on CPU ``select_sdp_backend_cpp`` in ``sdp_utils_cpp.cpp``, called by
``_fused_sdp_choice_cpp`` in ``attention.cpp``). Each check is a function of
``sdp_params`` (query/key/value dtype, head counts and head dim, ``attn_mask``,
``dropout``, ``is_causal``, ``enable_gqa``) and the card's compute capability. The
rules below are those checks, each named by its torch function and the torch releases
it holds for (:data:`RULES`); :func:`select_backend` walks the priority order
(:func:`priority_order`) and returns the backend with the first rule that turned each
faster backend down.

What the choice changes for memory (:mod:`trainmem.memory.ops`): the fused kernels
(flash, cuDNN, memory-efficient) save their output and a float32 logsumexp for
backward (memory-efficient pads its logsumexp to a multiple of 32 queries:
``kAlignLSE`` in ``mem_eff_attention``); the math path
(``_scaled_dot_product_attention_math``) is composite: it saves the
``batch x heads x s x s`` probabilities and its float32 copies of q, k, v.

transformers' side (``integrations/sdpa_attention.py``, :func:`hf_call`): up to 4.53
``sdpa_attention_forward`` always ``repeat_kv``-s the key and value to the query's
head count; from 4.54 (``use_gqa_in_sdpa``, huggingface/transformers#39412) it passes
``enable_gqa=True`` instead when torch is 2.5 or newer and there is no attention
mask; 5.24 also requires the key's head dim to equal the value's and be at most 256
(huggingface/transformers#46960). With no padding the decoder's mask is skipped
(``sdpa_mask``'s ``allow_is_causal_skip``) and ``is_causal=True`` is passed.

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

#: the backends, by torch's names (``torch.nn.attention.SDPBackend``)
BACKENDS = ("flash", "efficient", "cudnn", "math")
#: what each backend saves for backward, as far as memory goes
SAVES = {
    "flash": "output + float32 logsumexp",
    "cudnn": "output + float32 softmax statistics",
    "efficient": "output + float32 logsumexp (padded to 32 queries)",
    "math": "float32 probabilities (batch x heads x s x s) and q, k, v copies",
}
#: memory-efficient attention's logsumexp is padded to a multiple of this many
#: queries (``kAlignLSE`` in mem_eff_attention/kernel_forward.h)
EFFICIENT_LSE_ALIGN = 32
#: a mask handed to the memory-efficient kernel must have its rows aligned to this
#: many elements, or ``preprocess_mask`` copies it into a padded one
#: (``mem_eff_alignment`` in aten/src/ATen/native/transformers/attention.cpp)
MASK_ALIGN = 8


@dataclass(frozen=True)
class Call:
    """One ``scaled_dot_product_attention`` call as torch's checks see it.

    ``heads``/``kv_heads``: query and key/value heads as passed (after any
    ``repeat_kv``); ``dtype``: q, k and v's (``fp32``, ``fp16``, ``bf16``);
    ``mask``: an explicit ``attn_mask`` is passed; ``requires_grad``: training."""

    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    seq_q: int = 512
    seq_k: int = 512
    enable_gqa: bool = False
    mask: bool = False
    is_causal: bool = True
    dropout: float = 0.0
    requires_grad: bool = True

    def __post_init__(self):
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"dtype must be fp32, fp16 or bf16, got {self.dtype!r}")
        for name in ("heads", "kv_heads", "head_dim", "seq_q", "seq_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                got = getattr(self, name)
                raise ValueError(f"{name} must be a positive int, got {got!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


@dataclass(frozen=True)
class Rule:
    """One check of one backend: ``check(call, capability, torch)`` returns why it
    turns the call down (``None``: it passes). ``device``: ``cuda`` or ``cpu``;
    ``torch``: the releases it applies to, ``(first, last)`` (``None``: open)."""

    backend: str
    device: str
    name: str
    source: str
    check: Callable
    torch: tuple = (None, None)

    def applies(self, torch: tuple) -> bool:
        first, last = self.torch
        return (first is None or torch[:2] >= first) and (
            last is None or torch[:2] <= last
        )


@dataclass(frozen=True)
class Choice:
    """The backend SDPA runs and, for each backend tried before it, the rule that
    turned it down (``(backend, rule name, why)``)."""

    backend: str
    device: str
    rejected: tuple = ()

    @property
    def reason(self) -> str:
        """Why this backend: the rule that refused each backend torch tried first."""
        if not self.rejected:
            return f"{self.backend} is the first backend torch tries"
        return "; ".join(
            f"{b} refused by {name} ({text})" for b, name, text in self.rejected
        )


# --------------------------------------------------------------------------------------
# the checks (sdp_utils.cpp and sdp_utils_cpp.h, named as there)
# --------------------------------------------------------------------------------------

SM_RANGE_FLASH = {  # check_flash_attention_hardware_support: [sm_80, upper]
    (2, 4): (9, 0),  # "[sm80, sm90]"
    (2, 7): (12, 0),  # sm_100 and sm_120 builds (CUDA 12.8 wheels)
    (2, 9): (12, 1),
}
SM_RANGE_EFFICIENT = {  # check_mem_efficient_hardware_support: [sm_50, upper]
    (2, 4): (9, 0),
    (2, 7): (12, 0),
    (2, 9): (12, 1),
}


def _upper(table: dict, torch: tuple) -> tuple:
    return table[max(v for v in table if v <= max(torch[:2], (2, 4)))]


def _sm(cap: tuple) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def _flash_hw(call: Call, cap: tuple, torch: tuple):
    top = _upper(SM_RANGE_FLASH, torch)
    if not (8, 0) <= cap <= top:
        return f"flash needs sm_80 .. {_sm(top)}, the card is {_sm(cap)}"


def _efficient_hw(call: Call, cap: tuple, torch: tuple):
    top = _upper(SM_RANGE_EFFICIENT, torch)
    if not (5, 0) <= cap <= top:
        return f"needs sm_50 .. {_sm(top)}, the card is {_sm(cap)}"


def _cudnn_hw(call: Call, cap: tuple, torch: tuple):
    if cap < (8, 0):
        return f"cuDNN attention needs sm_80 or newer, the card is {_sm(cap)}"


def _low_precision(call: Call, cap: tuple, torch: tuple):
    # check_dtypes_low_precision: {half, bfloat16} from sm_80, {half} below
    allowed = ("fp16", "bf16") if cap >= (8, 0) else ("fp16",)
    if call.dtype not in allowed:
        return f"takes {'/'.join(allowed)} on {_sm(cap)}, got {call.dtype}"


def _efficient_dtypes(call: Call, cap: tuple, torch: tuple):
    # greater_than_or_equal_sm80_mem_efficient_dtypes / less_than_sm80_...
    allowed = ("fp16", "fp32", "bf16") if cap >= (8, 0) else ("fp16", "fp32")
    if call.dtype not in allowed:
        return f"takes {'/'.join(allowed)} on {_sm(cap)}, got {call.dtype}"


def _no_mask(call: Call, cap: tuple, torch: tuple):
    if call.mask:
        return "an explicit attn_mask is passed"


def _no_dropout(call: Call, cap: tuple, torch: tuple):
    if call.dropout > 0:
        return f"dropout {call.dropout} > 0"


def _flash_head_dim(call: Call, cap: tuple, torch: tuple):
    if call.head_dim > 256:
        return f"head dim {call.head_dim} > 256"


def _gt192_sm86_89(call: Call, cap: tuple, torch: tuple):
    # training with head dim in (192, 224], or (224, 256] with dropout, on sm_86..89
    # (and sm_120/121 from 2.7)
    consumer = (8, 6) <= cap <= (8, 9) or (torch[:2] >= (2, 7) and cap[0] == 12)
    if not (consumer and call.requires_grad):
        return None
    d = call.head_dim
    if d <= 192 or (call.dropout == 0 and d > 224):
        return None
    return f"training with head dim {d} on {_sm(cap)}"


def _causal_square(call: Call, cap: tuple, torch: tuple):
    if call.is_causal and not call.mask and call.seq_q != call.seq_k:
        return f"is_causal with seq_q {call.seq_q} != seq_k {call.seq_k}"


def _efficient_alignment(call: Call, cap: tuple, torch: tuple):
    # check_head_dim_size_mem_efficient with minimum_gemm_alignment: tensor cores
    # from sm_80 (any dtype) or sm_70 (16-bit): 128 bits / element; at least 4 on sm_80+
    half = call.dtype in ("fp16", "bf16")
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    align = 4 if cap[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    if call.head_dim % align:
        return f"head dim {call.head_dim} not a multiple of {align}"


def _cudnn_head_dim(call: Call, cap: tuple, torch: tuple):
    # check_cudnn_tensor_shapes: head dim a multiple of 8 and at most 128 (256 on
    # sm_90/sm_100 with cuDNN newer than 9.22, which torch 2.11's wheels do not ship)
    if call.head_dim % 8 or call.head_dim > 128:
        return f"head dim {call.head_dim}: a multiple of 8 up to 128"


def _cudnn_dropout(call: Call, cap: tuple, torch: tuple):
    if call.dropout * 16 != int(call.dropout * 16):
        return f"dropout {call.dropout} not a multiple of 1/16"


def _heads(supports_gqa: bool):
    """check_batch_size_and_num_heads_dense<supports_gqa>: with enable_gqa and a
    backend that supports it, check_grouped_query_attention (kv heads divide the
    query heads); otherwise the head counts must be equal."""

    def check(call: Call, cap: tuple, torch: tuple):
        if call.enable_gqa and supports_gqa:
            if call.heads % call.kv_heads:
                return f"{call.kv_heads} kv heads do not divide {call.heads}"
            return None
        if call.heads != call.kv_heads:
            flag = "enable_gqa" if call.enable_gqa else "no enable_gqa"
            return f"{call.heads} query heads vs {call.kv_heads} kv heads ({flag})"
        return None

    return check


CUDA = "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"
CPP_H = "aten/src/ATen/native/transformers/sdp_utils_cpp.h"
CPP = "aten/src/ATen/native/transformers/sdp_utils_cpp.cpp"

#: every check modelled, in the order torch runs them within a backend
RULES: tuple[Rule, ...] = (
    # can_use_flash_attention
    Rule("flash", "cuda", "check_for_attn_mask", CPP_H, _no_mask),
    Rule("flash", "cuda", "check_head_dim_size_flash", CUDA, _flash_head_dim),
    Rule("flash", "cuda", "check_flash_attention_hardware_support", CUDA, _flash_hw),
    Rule(
        "flash",
        "cuda",
        "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89",
        CUDA,
        _gt192_sm86_89,
    ),
    Rule(
        "flash",
        "cuda",
        "check_flash_causal_non_square_seqlens",
        CUDA,
        _causal_square,
    ),
    Rule("flash", "cuda", "check_dtypes_low_precision", CUDA, _low_precision),
    Rule(
        "flash",
        "cuda",
        "check_batch_size_and_num_heads_dense<true>",
        CPP_H,
        _heads(True),
        torch=((2, 5), None),
    ),
    Rule(
        "flash",
        "cuda",
        "check_batch_size_and_num_heads_dense",
        CPP_H,
        _heads(False),
        torch=(None, (2, 4)),
    ),
    # can_use_mem_efficient_attention
    Rule(
        "efficient",
        "cuda",
        "check_mem_efficient_hardware_support",
        CUDA,
        _efficient_hw,
    ),
    Rule(
        "efficient",
        "cuda",
        "check_head_dim_size_mem_efficient",
        CUDA,
        _efficient_alignment,
    ),
    Rule(
        "efficient",
        "cuda",
        "check_batch_size_and_num_heads_dense<false>",
        CPP_H,
        _heads(False),
    ),
    Rule(
        "efficient",
        "cuda",
        "less_than_sm80_mem_efficient_dtypes",
        CUDA,
        _efficient_dtypes,
    ),
    # can_use_cudnn_attention
    Rule("cudnn", "cuda", "check_dtypes_low_precision", CUDA, _low_precision),
    Rule("cudnn", "cuda", "check_cudnn_hardware_support", CUDA, _cudnn_hw),
    Rule("cudnn", "cuda", "check_cudnn_dropout", CUDA, _cudnn_dropout),
    Rule(
        "cudnn",
        "cuda",
        "check_batch_size_and_num_heads_dense<true>",
        CPP_H,
        _heads(True),
    ),
    Rule("cudnn", "cuda", "check_cudnn_tensor_shapes", CUDA, _cudnn_head_dim),
    # use_flash_attention_cpp
    Rule("flash", "cpu", "check_for_dropout", CPP_H, _no_dropout),
    Rule(
        "flash",
        "cpu",
        "check_batch_size_and_num_heads_dense<true>",
        CPP,
        _heads(True),
        torch=((2, 5), None),
    ),
    Rule(
        "flash",
        "cpu",
        "check_batch_size_and_num_heads_dense",
        CPP,
        _heads(False),
        torch=(None, (2, 4)),
    ),
)


def prefers_cudnn(cap: tuple, torch: tuple) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN goes first on sm_90 in 2.5.0
    (pytorch/pytorch#125343; 2.5.1 made it opt-in again, #138522), on sm_100 from
    2.8 and on sm_90/sm_100 in 2.9 (#162073); from 2.10 only with a cuDNN newer than
    9.15.0, which the wheels bundle from 2.11."""
    t = torch[:3] if len(torch) >= 3 else torch[:2] + (0,)
    if t[:2] == (2, 5):
        return t == (2, 5, 0) and cap[0] == 9
    if t[:2] == (2, 8):
        return cap[0] == 10
    if t[:2] == (2, 9) or t[:2] >= (2, 11):
        return cap[0] in (9, 10)
    return False


def priority_order(device: str, cap: tuple | None, torch: tuple) -> tuple:
    """The order torch tries the backends in (``priority_order``;
    ``priority_order_cpp``: flash, then math). The default order is flash,
    memory-efficient, math, cuDNN — cuDNN after math, so never reached — unless
    :func:`prefers_cudnn`."""
    if device == "cpu":
        return ("flash", "math")
    if prefers_cudnn(cap, torch):
        return ("cudnn", "flash", "efficient", "math")
    return ("flash", "efficient", "math")


def check(backend: str, call: Call, device: str, cap, torch: tuple):
    """The first rule of ``backend`` that turns ``call`` down, as ``(name, why)``,
    or ``None``."""
    for rule in RULES:
        if rule.backend == backend and rule.device == device and rule.applies(torch):
            why = rule.check(call, cap, torch)
            if why:
                return rule.name, why
    return None


def select_backend(call: Call, cap: tuple | None, torch: tuple) -> Choice:
    """The backend torch ``torch`` runs ``call`` with on a card of compute capability
    ``cap`` (``None``: on the CPU)."""
    device = "cpu" if cap is None else "cuda"
    rejected = []
    for backend in priority_order(device, cap, torch):
        if backend == "math":
            return Choice("math", device, tuple(rejected))
        refused = check(backend, call, device, cap, torch)
        if refused is None:
            return Choice(backend, device, tuple(rejected))
        rejected.append((backend,) + refused)
    raise AssertionError("math is always in the order")  # pragma: no cover


def hf_passes_gqa(mask: bool, head_dim: int, transformers: tuple, torch: tuple) -> bool:
    """Whether transformers' ``sdpa_attention_forward`` passes ``enable_gqa=True``
    (``use_gqa_in_sdpa``) instead of ``repeat_kv``-ing key and value: from 4.54 with
    torch 2.5+ and no attention mask; 5.24 also needs the head dim at most 256."""
    if transformers < (4, 54) or torch[:2] < (2, 5) or mask:
        return False
    if transformers >= (5, 24) and head_dim > 256:
        return False
    return True


def hf_call(
    dtype: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq: int,
    versions: dict,
    mask: bool = False,
    dropout: float = 0.0,
) -> tuple[Call, bool]:
    """The SDPA call a transformers decoder layer makes in training, and whether it
    ``repeat_kv``-ed key and value first (then SDPA sees ``heads`` key/value heads
    and saves the repeated copies). ``mask``: an attention mask is passed (padding);
    without one ``is_causal=True``."""
    gqa = hf_passes_gqa(mask, head_dim, versions["transformers"], versions["torch"])
    repeats = kv_heads != heads and not gqa
    call = Call(
        dtype=dtype,
        heads=heads,
        kv_heads=heads if repeats else kv_heads,
        head_dim=head_dim,
        seq_q=seq,
        seq_k=seq,
        enable_gqa=gqa,
        mask=mask,
        is_causal=not mask,
        dropout=dropout,
    )
    return call, repeats
