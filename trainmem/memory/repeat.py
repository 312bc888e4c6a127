"""Micro-batches the replay need not simulate again: once a micro-batch's allocation
events are the one before's with each tensor renamed, the next ones are written as
renamed copies (:class:`_Repeater`); :func:`_periods` asks the caching-allocator
replays whether their states cycle (see :mod:`.step`, ``STOP_AT_REPEAT``)."""

from __future__ import annotations

from .allocator import RepeatDetector


def _allocated(events, a: int, b: int) -> list:
    return [ev[1] for ev in events[a:b] if ev[0] == "alloc"]


def _renamed(events, a: int, b: int, names: dict) -> list:
    get = names.get
    return [(ev[0], get(ev[1], ev[1])) + ev[2:] for ev in events[a:b]]


class _Repeater:
    """Writes a micro-batch's events as the last simulated one's (``starts``: where
    each micro-batch's events begin; the last simulated one ends at the end of
    ``events``) with fresh names (negative, never a Simulator uid) for what it
    allocates and the previous micro-batch's names for what it frees of that one."""

    def __init__(self, events: list, starts: list[int]):
        *_, before, last = starts
        self.template = (last, len(events))
        self.previous = _allocated(events, before, last)
        self.made = self.recorded = _allocated(events, last, len(events))
        self.fresh = -1

    @staticmethod
    def repeats(events: list, starts: list[int]) -> bool:
        """Whether the last micro-batch's events are the one before's renamed."""
        if len(starts) < 3:
            return False
        a, b, c = starts[-3:]
        names = dict(zip(_allocated(events, b, c), _allocated(events, c, len(events))))
        if len(names) != len(_allocated(events, b, c)):
            return False
        names.update(zip(_allocated(events, a, b), _allocated(events, b, c)))
        return _renamed(events, b, c, names) == events[c:]

    def write(self, events: list) -> None:
        made = list(range(self.fresh, self.fresh - len(self.recorded), -1))
        self.fresh -= len(made)
        names = dict(zip(self.recorded, made))
        names.update(zip(self.previous, self.made))
        events.extend(_renamed(events, *self.template, names))
        self.made = made

    def rename_after(self, events: list, start: int) -> None:
        """The events from ``start`` on (the rest of the step, simulated with the last
        simulated micro-batch's tensors) name the last written micro-batch's."""
        if self.made is not self.recorded:
            names = dict(zip(self.recorded, self.made))
            events[start:] = _renamed(events, start, len(events), names)


def _periods(detectors: dict, events, starts, prelude, capacity):
    """The periods of the allocator replays the events are for, after the
    micro-batch that just ended. Under the card's limit the replay is the unlimited
    one until the allocator first gives back cached segments (the limit changes
    nothing before that), so the unlimited replay runs only from then on, caught up
    from the start."""
    yield detectors[capacity].period(events, starts)
    if capacity is None:
        return
    if None not in detectors:
        if not detectors[capacity].replay.alloc.released:
            return  # the same states: the same periods
        detectors[None] = RepeatDetector(prelude, None)
        detectors[None].catch_up(events, starts)
        yield detectors[None].periods()
        return
    yield detectors[None].period(events, starts)
