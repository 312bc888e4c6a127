"""coursekit.nbclient: a missed ZeroMQ wake-up costs one slice, not the cell timeout."""

from __future__ import annotations

import asyncio
import time
from queue import Empty

import nbformat
import pytest

from coursekit import nbclient


class MissedWakeUp:
    """A channel whose reply is already queued but whose first poll is never woken:
    like pyzmq's asyncio poll after a missed edge, it sleeps its whole timeout and
    only then finds the message."""

    def __init__(self):
        self.calls: list[float | None] = []

    async def get_msg(self, timeout=None):
        self.calls.append(timeout)
        if len(self.calls) == 1:
            await asyncio.sleep(timeout)
            raise Empty
        return {"msg_type": "execute_reply"}


def test_a_missed_wake_up_costs_one_slice():
    ch = MissedWakeUp()
    get = nbclient.sliced(ch.get_msg, slice_s=0.05)
    t0 = time.monotonic()
    msg = asyncio.run(get(timeout=600))
    assert msg == {"msg_type": "execute_reply"}
    assert time.monotonic() - t0 < 5  # the plain poll would sleep the 600 s
    assert ch.calls == [0.05, 0.05]


def test_the_whole_timeout_still_ends_in_empty():
    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise Empty

    get = nbclient.sliced(never, slice_s=0.02)
    t0 = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(get(timeout=0.1))
    assert 0.09 <= time.monotonic() - t0 < 2


def test_no_timeout_waits_in_slices_until_a_message():
    n = {"polls": 0}

    async def later(timeout=None):
        assert timeout == 0.01
        n["polls"] += 1
        if n["polls"] < 4:
            raise Empty
        return "idle"

    assert asyncio.run(nbclient.sliced(later, slice_s=0.01)()) == "idle"
    assert n["polls"] == 4


def test_the_client_slices_shell_and_iopub(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    client = nbclient.NotebookClient(nb, timeout=60, kernel_name="python3")
    client.execute()
    assert nb.cells[0].outputs[0]["text"] == "42\n"
    seen = {}

    async def probe():
        async with client.async_setup_kernel():
            seen["shell"] = getattr(client.kc.shell_channel.get_msg, "sliced", False)
            seen["iopub"] = getattr(client.kc.iopub_channel.get_msg, "sliced", False)

    asyncio.run(probe())
    assert seen == {"shell": True, "iopub": True}
