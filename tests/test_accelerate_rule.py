"""``trainmem.estimate.accelerate_rule_bytes`` is accelerate's own training estimate.

The accuracy benchmark and chapter 3 compare the estimator with the rule of ``accelerate
estimate-memory``; this test ties that rule to accelerate's code, so an upstream change
shows up here rather than as a silently stale comparison."""

import pytest
from accelerate.commands.estimate import estimate_training_usage

from trainmem.estimate import accelerate_rule_bytes, count_params


@pytest.mark.parametrize(
    "precision,dtype",
    [
        ("fp32", "float32"),
        ("bf16-amp", "bfloat16"),
        ("fp16-amp", "float16"),
        ("bf16", "bfloat16"),
    ],
)
@pytest.mark.parametrize("model", ["tiny", "llama-7b"])
def test_rule_is_accelerates_max_over_its_terms(model, precision, dtype):
    n = count_params(model)
    fp32_bytes = (
        4 * n
    )  # accelerate sizes the empty model in fp32 before applying the dtype
    theirs = max(estimate_training_usage(fp32_bytes, dtype).values())
    assert accelerate_rule_bytes(n, precision) == theirs
