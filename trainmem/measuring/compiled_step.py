"""What ``torch.compile`` changes in the memory of one training step, measured on CPU
without code generation.

AOTAutograd traces forward and backward into one joint graph and a *partitioner*
splits it; what the forward graph returns for the backward is what the step keeps
alive. The backends compared (torch 2.13, ``torch/_dynamo/backends/debugging.py``)
run the partitioned graphs eagerly (``boxed_nop`` compilers), so no Inductor codegen:

- ``aot_eager_default_partitioner``: ``default_partition`` keeps the ops of the
  original forward in the forward graph and saves what they produced, like eager;
- ``aot_eager``: ``min_cut_rematerialization_partition`` (in torch 2.13 this is the
  backend's partitioner), which recomputes cheap pointwise ops in the backward when
  that saves fewer bytes than storing their outputs;
- ``aot_eager_decomp_partition``: the same partitioner with ``compiler="inductor"``
  and Inductor's decomposition table, as ``torch.compile``'s default Inductor backend
  partitions (``torch/_inductor/compile_fx.py`` ``partition_fn``; Inductor also runs
  its joint-graph passes first, which this backend does not).

:class:`CompiledTracker` is :class:`~trainmem.measuring.tracker.MemoryTracker` with
``ignore_compile_internals`` set: otherwise Dynamo sees a user dispatch mode and falls
back to eager (``convert_frame.py``: "non-infra torch dispatch mode present"); with
it, the mode is off while compiling and on while the compiled graphs run, so it counts
their aten allocations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .tracker import MemoryTracker

BACKENDS = (
    None,
    "aot_eager_default_partitioner",
    "aot_eager",
    "aot_eager_decomp_partition",
)


class CompiledTracker(MemoryTracker):
    """The storage tracker, kept on while compiled graphs run."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class SwiGLUBlock(nn.Module):
    """A Llama-like residual block without attention: RMSNorm then a SwiGLU MLP."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(d))
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class BlockStack(nn.Module):
    """``n`` SwiGLU blocks and a mean-square loss."""

    def __init__(self, n: int = 2, d: int = 256, f: int = 688):
        super().__init__()
        self.blocks = nn.ModuleList(SwiGLUBlock(d, f) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def step_memory(
    backend: str | None,
    shape=(4, 128),
    n: int = 2,
    d: int = 256,
    f: int = 688,
    seed: int = 0,
) -> dict:
    """One forward+backward of :class:`BlockStack` in eager (``backend=None``) or
    under ``torch.compile(backend=...)``.

    Returns ``saved_bytes`` (bytes of the distinct non-parameter storages autograd
    keeps for backward, counted with ``saved_tensors_hooks``), ``forward_peak`` and
    ``peak`` (the tracker's live bytes over the step, parameters not registered, so
    activations, gradients and temporaries)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    torch.manual_seed(seed)
    model = BlockStack(n, d, f)
    x = torch.randn(*shape, d)
    torch._dynamo.reset()
    fn = model if backend is None else torch.compile(model, backend=backend)
    fn(x).backward()  # compile (and warm up) outside the measurement
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(x)
    loss.backward()
    model.zero_grad(set_to_none=True)

    tracker = CompiledTracker()
    with tracker:
        loss = fn(x)
        forward_peak = tracker.peak
        loss.backward()
    del loss
    torch._dynamo.reset()
    return dict(
        saved_bytes=sum(saved.values()), forward_peak=forward_peak, peak=tracker.peak
    )
