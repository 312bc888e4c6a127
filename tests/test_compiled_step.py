"""``trainmem.measuring.compiled_step``: the tracker sees the compiled graphs run, and
the partitioners save what the chapter says (small shapes, two backends: seconds)."""

from __future__ import annotations

import pytest

from trainmem.measuring.compiled_step import CompiledTracker, step_memory
from trainmem.measuring.tracker import MemoryTracker

SMALL = dict(shape=(2, 8), d=16, f=32)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="inductor"):
        step_memory("inductor", **SMALL)


def test_tracker_is_kept_on_while_compiled_graphs_run():
    # a plain MemoryTracker makes Dynamo fall back to eager; this one must not
    assert CompiledTracker.ignore_compile_internals()
    assert not MemoryTracker.ignore_compile_internals()


def test_default_partition_saves_like_eager_and_min_cut_saves_less():
    eager = step_memory(None, **SMALL)
    default = step_memory("aot_eager_default_partitioner", **SMALL)
    mincut = step_memory("aot_eager_decomp_partition", **SMALL)
    assert default["saved_bytes"] == eager["saved_bytes"]
    assert mincut["saved_bytes"] < eager["saved_bytes"]
    # the tracker counted the compiled forward: its peak moved with what it saved
    assert mincut["forward_peak"] < default["forward_peak"]
