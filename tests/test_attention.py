"""trainmem.demos.attention: eager and tiled attention match SDPA; memory O(s²) vs
O(s)."""

import pytest
import torch
import torch.nn.functional as F

from trainmem.demos.attention import (
    eager_attention,
    eager_score_bytes,
    peak_extra_bytes,
    tiled_attention,
)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 37, 64])
def test_matches_sdpa(causal, s):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, s, 16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(
        eager_attention(q, k, v, causal), ref, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        tiled_attention(q, k, v, causal, block_q=16, block_k=8),
        ref,
        atol=1e-5,
        rtol=1e-5,
    )


def test_tiled_causal_with_shorter_query():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 8)
    k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    torch.testing.assert_close(
        tiled_attention(q, k, v, True, 2, 3), eager_attention(q, k, v, True)
    )


def test_bad_input():
    with pytest.raises(ValueError, match="4-D"):
        eager_attention(
            torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
        )
    x = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="block_q"):
        tiled_attention(x, x, x, block_q=0)


def test_memory_quadratic_vs_linear():
    torch.manual_seed(0)
    eager, tiled = [], []
    for s in (128, 256):
        q, k, v = (torch.randn(1, 2, s, 16) for _ in range(3))
        eager.append(peak_extra_bytes(eager_attention, q, k, v))
        tiled.append(peak_extra_bytes(tiled_attention, q, k, v, block_q=32, block_k=32))
    # eager holds (at least) scores and probabilities: ≥ 2 score matrices
    assert eager[0] >= 2 * eager_score_bytes(1, 2, 128, 4)
    assert eager[1] / eager[0] > 3.5  # ~4× when s doubles
    assert tiled[1] / tiled[0] < 2.5  # ~linear
    assert tiled[1] < eager[1] / 4
