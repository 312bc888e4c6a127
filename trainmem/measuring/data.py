"""Tiny deterministic data for CPU demos: no downloads, same tensors on every
machine."""

from __future__ import annotations

import torch


def counting_batches(
    n_batches: int,
    batch: int,
    seq_len: int,
    vocab: int = 256,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """Token sequences that count upward: ``x[t+1] = (x[t] + step) % vocab``, step ∈ {1,
    2, 3}.

    A language model learns this quickly (loss drops within a few dozen steps), which
    makes it a good smoke test for a training loop. Returns ``n_batches`` LongTensors of
    shape (batch, seq_len); use each as both ``input_ids`` and ``labels`` for a Hugging
    Face causal LM.
    """
    for name, v in (
        ("n_batches", n_batches),
        ("batch", batch),
        ("seq_len", seq_len),
        ("vocab", vocab),
    ):
        if v < 1:
            raise ValueError(f"{name} must be ≥ 1, got {v}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        step = torch.randint(1, 4, (batch, 1), generator=g)
        out.append(((start + step * torch.arange(seq_len)) % vocab).to(device))
    return out
