"""trainmem.measuring.saved_tensors: one layer's saved tensors, named, match the
estimator."""

import pytest

from trainmem.estimate import activation_bytes_per_layer
from trainmem.measuring.models import tiny_llama_config
from trainmem.measuring.saved_tensors import saved_table, size_class, size_units

CFG = tiny_llama_config()
B, S = 2, 24


@pytest.fixture(scope="module")
def sdpa_rows():
    return saved_table(CFG, "sdpa", batch=B, seq=S)


def test_every_saved_tensor_is_named_and_classified(sdpa_rows):
    assert all(r["saved tensor (module: op that made it)"] != "?" for r in sdpa_rows)
    assert all(r["size class"] != "other" for r in sdpa_rows)
    names = [r["saved tensor (module: op that made it)"] for r in sdpa_rows]
    assert names[0] == "layer input"
    # autocast's bf16 copy of each of the seven weights, once each
    assert sum("weight -> bf16" in n for n in names) == 7
    assert names.count("self_attn.v_proj: mm") == 1  # v
    assert any("scaled_dot_product" in n for n in names)  # the SDPA output


def test_activation_bytes_equal_the_estimators_layer(sdpa_rows):
    for attn in ("sdpa", "eager"):
        rows = sdpa_rows if attn == "sdpa" else saved_table(CFG, attn, batch=B, seq=S)
        act = sum(
            r["bytes"] for r in rows if r["size class"] not in ("weight copy", "s*d")
        )
        assert act == activation_bytes_per_layer(
            CFG, batch=B, seq=S, precision="bf16-amp", attn=attn
        )


def test_coefficient_of_h_is_34_under_sdpa(sdpa_rows):
    unit = size_units(CFG, B, S)["b*s*h"]
    c_h = sum(r["bytes"] for r in sdpa_rows if r["size class"] == "b*s*h") / unit
    assert c_h == 34


def test_size_class():
    import torch

    assert size_class("x", torch.empty(B, S, CFG.hidden_size), CFG, B, S) == "b*s*h"
    assert (
        size_class("q_proj: weight -> bf16", torch.empty(3), CFG, B, S) == "weight copy"
    )
    assert size_class("x", torch.empty(7), CFG, B, S) == "other"


def test_ambiguous_sizes_are_refused():
    with pytest.raises(ValueError, match="equals hidden_size"):
        saved_table(CFG, batch=1, seq=CFG.hidden_size)
    with pytest.raises(ValueError, match="must be positive"):
        saved_table(CFG, batch=0)
