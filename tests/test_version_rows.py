"""Steps whose memory depends on the transformers version, replayed against CPU
measurements made on another version (tests/data/version_rows.json, recorded by
``benchmarks/version_rows.py --record`` on transformers 4.57.1, the floor the course
supports): the estimate given those versions lands within 0.05 % of each, the pinned
versions' estimate does not (the mechanisms are real), and the version rules switch at
the releases their docstrings name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.config import StepConfig, model_shape
from trainmem.decisions import decide
from trainmem.estimate import estimate
from trainmem.versions import (
    cache_values_in_key_dtype,
    hf_materializes_causal_mask,
    installed,
    parse_versions,
    rope_buffers,
)

DATA = json.loads(
    (Path(__file__).resolve().parent / "data" / "version_rows.json").read_text()
)


def _id(row):
    return ",".join(f"{k}={v}" for k, v in row["options"].items())


@pytest.mark.parametrize("row", DATA["rows"], ids=_id)
def test_recorded_row_within_half_a_tenth_of_a_percent(row):
    est = estimate(DATA["model"], versions=DATA["versions"], **row["options"])
    assert abs(est.total_bytes / row["measured"] - 1) < 0.0005, (
        est.total_bytes,
        row["measured"],
    )


def test_the_recorded_versions_are_the_floor():
    assert DATA["versions"]["transformers"] == "4.57.1"


def test_the_version_mechanisms_move_the_recorded_rows():
    """Without the versions (the pinned 5.24 rules) the cache-less rows are off by
    more than 1 %: the two 4.57 mechanisms are what the replay gets right."""
    off = []
    for row in DATA["rows"]:
        pinned = estimate(DATA["model"], **row["options"]).total_bytes
        off.append(abs(pinned / row["measured"] - 1) > 0.01)
    assert sum(off) >= 6


@pytest.mark.parametrize(
    "transformers, torch, want",
    [
        ("4.53.0", "2.13.0", False),
        ("4.53.1", "2.13.0", True),
        ("4.57.1", "2.13.0", True),
        ("4.57.1", "2.5.1", False),  # the packed-sequence mask needs torch 2.6
        ("5.0.0", "2.13.0", False),
        ("5.24.0", "2.13.0", False),
    ],
)
def test_mask_rule_switches_at_its_releases(transformers, torch, want):
    v = parse_versions(f"transformers={transformers},torch={torch}")
    assert hf_materializes_causal_mask(v) is want


@pytest.mark.parametrize(
    "transformers, want",
    [("4.55.4", False), ("4.56.0", True), ("5.23.0", True), ("5.24.0", False)],
)
def test_cache_value_dtype_rule_switches_at_its_releases(transformers, want):
    v = parse_versions(f"transformers={transformers}")
    assert cache_values_in_key_dtype(v) is want


def test_the_mask_is_decided_only_without_a_cache():
    shape = model_shape(DATA["model"])
    old = "transformers=4.57.1"
    with_cache = decide(shape, StepConfig(versions=old))
    no_cache = decide(shape, StepConfig(versions=old, use_cache="off"))
    ckpt = decide(shape, StepConfig(versions=old, checkpointing=True))
    dpo = decide(shape, StepConfig(versions=old, objective="dpo"))
    new = decide(shape, StepConfig(use_cache="off"))
    assert not with_cache.causal_mask and not new.causal_mask
    assert no_cache.causal_mask and ckpt.causal_mask and dpo.causal_mask
    # a mask turns enable_gqa off: transformers repeat_kv-s key and value
    assert shape.kv_heads < shape.heads
    assert no_cache.sdpa_repeats_kv and not new.sdpa_repeats_kv


@pytest.mark.parametrize("transformers, want", [("4.57.1", 1), ("5.0.0", 2)])
def test_rope_buffer_storages_switch_at_5(transformers, want):
    assert rope_buffers(parse_versions(f"transformers={transformers}")) == want


def test_installed_names_only_installed_libraries():
    got = installed(("torch", "no-such-library-here"))
    assert set(got) == {"torch"} and "+" not in got["torch"]
