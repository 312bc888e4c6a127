"""nbclient's ``NotebookClient`` with the kernel's replies waited for in short slices.

nbclient waits for a cell's ``execute_reply`` with one ``poll`` on the shell socket for
the whole cell timeout (600 s here). pyzmq's asyncio ``Poller.poll`` learns that a
message arrived from the socket's file descriptor, which ZeroMQ signals edge-triggered:
when the wake-up is missed (a race seen on a loaded 2-core machine), the poll sleeps
until its timeout fires, then checks the socket once more (``poll(0)`` in
``zmq/_future.py``), finds the reply that had been waiting all along and returns it.
The cell passes, 600 s late: ``make floor`` once spent 615 s on a chapter that runs in
10 s, with the kernel idle throughout.

Here every ``get_msg`` on the shell and IOPub channels polls in slices of
:data:`SLICE_S` seconds up to the caller's timeout, so a missed wake-up costs at most
one slice and every timeout keeps its meaning.
"""

from __future__ import annotations

import time
from queue import Empty

from nbclient import NotebookClient as _NotebookClient
from nbclient.util import ensure_async

SLICE_S = 2.0


def sliced(get_msg, slice_s: float = SLICE_S):
    """``get_msg(timeout)`` that polls in slices of ``slice_s`` seconds: raises
    :class:`queue.Empty` only once the whole ``timeout`` has passed (never, for
    ``timeout=None``)."""

    async def get(timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            step = slice_s if left is None else max(0.0, min(slice_s, left))
            try:
                return await ensure_async(get_msg(timeout=step))
            except Empty:
                if left is not None and left <= slice_s:
                    raise

    get.sliced = True
    return get


class NotebookClient(_NotebookClient):
    """:class:`nbclient.NotebookClient` whose kernel client polls in slices."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        for channel in (kc.shell_channel, kc.iopub_channel):
            if not getattr(channel.get_msg, "sliced", False):
                channel.get_msg = sliced(channel.get_msg)
        return kc
