"""A small autograd for the replay: nodes with saved tensors, the backward pass in the engine's
order, leaf gradient accumulation, and non-reentrant activation checkpointing."""

from __future__ import annotations

import heapq
import math

from .accounting import T, Sim, new, shrink, view


class Node:
    __slots__ = ("seq", "edges", "saved", "bwd", "group", "saves", "__weakref__")

    def __init__(self, seq, edges, saved, bwd, group=None, saves=False):
        self.seq, self.edges, self.saved, self.bwd, self.group = (
            seq,
            edges,
            saved,
            bwd,
            group,
        )
        self.saves = (
            saves  # autograd saved tensors for it (under checkpointing: placeholders)
        )

    def __lt__(self, other):
        return self.seq > other.seq


class AccGrad:
    """AccumulateGrad of a leaf parameter: the first gradient is stolen, later ones added in place."""

    __slots__ = ("param", "grad", "seq", "sink", "__weakref__")

    def __init__(self, param: T):
        self.param = param
        self.grad = None
        self.seq = math.inf
        self.sink = False

    def __lt__(self, other):
        return self.seq > other.seq


def record(
    sim: Sim, out: T, inputs: list, saved: list, bwd, save_out: bool = False
) -> None:
    """Attach a backward node to ``out`` if any input requires grad (and grad mode is on).

    ``saved`` are the tensors autograd keeps for this node; ``save_out`` adds the output itself.
    """
    if not sim.grad_enabled or not any(i is not None and i.rg for i in inputs):
        return
    group = sim.ckpt
    saving = bool(saved) or save_out
    if group is not None and group.recording:
        group.n_nodes += 1
        if saving:
            group.last_saving = group.n_nodes
        saved, save_out = [], False  # checkpoint: nothing kept, recomputed in backward
    if not sim.save:
        saved, save_out = [], False
    bufs = [t.buf for t in saved] + ([out.buf] if save_out else [])
    node = Node(
        next(sim.seq),
        [i.edge() if i is not None else None for i in inputs],
        bufs,
        bwd,
        group,
        saves=saving,
    )
    out.rg = True
    out.fn = node
    if group is not None and group.recording:
        group.nodes.append(node)
    if group is not None and group.replaying is not None:
        group.replay_node(sim, node, out, save_out)


class _StopRecompute(Exception):
    pass


class _CkptGroup:
    def __init__(self, fn, inputs):
        self.fn, self.inputs = fn, inputs
        self.nodes: list[Node] = []
        self.n_nodes = 0
        self.last_saving = 0
        self.recording = True
        self.replaying = None
        self.done = False
        self.executed = 0

    def replay_node(self, sim, node, out, save_out):
        """Hand the recomputed saved tensors to the original node; stop after the last one.

        Autograd packs saved *inputs* before the kernel runs and saved outputs after it, so when
        the last node saves only inputs the recompute stops before its output is allocated."""
        i = self.replaying
        self.replaying += 1
        if i < len(self.nodes):
            self.nodes[i].saved = node.saved
        if self.replaying >= self.last_saving:
            if not save_out:
                sim.unalloc_last(out.buf)
            raise _StopRecompute

    def recompute(self, sim):
        if self.done:
            return
        self.done = True
        prev = sim.ckpt
        sim.ckpt = self
        self.recording = False
        self.replaying = 0
        prev_ac, prev_cache = sim.autocast, sim.autocast_cache
        sim.autocast, sim.autocast_cache = self.autocast, []
        try:
            ins = [
                view(t, t.shape, t.phys) if t is not None else None for t in self.inputs
            ]
            for (
                t
            ) in ins:  # same requires_grad as in the forward, so the node order matches
                if t is not None:
                    t.fn, t.acc = (_DUMMY if t.rg else None), None
            try:
                self.fn(*ins)
            except _StopRecompute:
                pass
        finally:
            sim.ckpt = prev
            sim.autocast, sim.autocast_cache = (
                prev_ac,
                prev_cache,
            )  # the recompute's autocast exits
            self.replaying = None
            # the checkpoint keeps its inputs until the layer's backward is over (see backward())


_DUMMY = Node(-1, [], [], None)


def checkpoint(sim: Sim, fn, *inputs):
    """Non-reentrant ``torch.utils.checkpoint``: keep ``inputs``, drop the saved tensors."""
    group = _CkptGroup(fn, list(inputs))
    group.autocast = sim.autocast
    prev = sim.ckpt
    sim.ckpt = group
    try:
        out = fn(*inputs)
    finally:
        sim.ckpt = prev
        group.recording = False
    # the nodes of the group need the recompute before their backward runs
    for n in group.nodes:
        n.group = group
    return out


def param(sim: Sim, shape, dt, trainable: bool, cat: str) -> T:
    p = new(sim, shape, dt, cat=cat)
    p.rg = trainable
    if trainable:
        p.acc = AccGrad(p)
    return p


def backward(sim: Sim, loss: T):
    """Run the recorded graph backward from the scalar ``loss`` (reverse creation order)."""
    root = loss.fn
    if root is None:
        return
    deps: dict = {}
    stack = [root]
    seen = {id(root)}
    while stack:
        n = stack.pop()
        if isinstance(n, AccGrad):
            continue
        for e in n.edges:
            if e is None or e is _DUMMY:
                continue
            deps[id(e)] = deps.get(id(e), 0) + 1
            if id(e) not in seen:
                seen.add(id(e))
                stack.append(e)
    g0 = new(sim, (), "fp32")  # ones_like(loss)
    buffers = {id(root): g0}
    del g0
    heap = [root]
    while heap:
        node = heapq.heappop(heap)
        g = buffers.pop(id(node))
        if isinstance(node, AccGrad):
            p = node.param
            if node.sink:  # a leaf that is not a parameter: grad discarded
                del g
                continue
            if p.buf is not None and getattr(p, "acc", None) is node:
                if node.grad is None:
                    if g.buf.cat != "gradients":
                        sim.recat(g.buf, "gradients")
                        if sim.grad_scale != 1.0:
                            shrink(sim, g.buf, sim.grad_scale)
                    node.grad = g
                # else: in-place add into the existing .grad; g is freed below
            del g
            continue
        # non-reentrant checkpointing recomputes when a saved tensor is first unpacked: at the
        # first node of the region that saved something (nodes that save nothing run before)
        if node.group is not None and not node.group.done and node.saves:
            node.group.recompute(sim)
        grads = node.bwd(node, g)
        del g
        node.saved = None
        grp = node.group
        if grp is not None:
            grp.executed += 1
            if grp.executed == len(grp.nodes):
                grp.inputs = grp.fn = None  # release the kept inputs (and break the
                grp.nodes = []  # group <-> node reference cycle)
                grp.executed = -1
        for e, gr in zip(node.edges, grads):
            if e is None or gr is None or e is _DUMMY:
                continue
            k = id(e)
            if k in buffers:
                old = buffers[
                    k
                ]  # a second gradient for the same node: old + new, a new tensor
                buffers[k] = T(sim.alloc(old.nbytes), old.shape, old.dt)
                del old
            else:
                buffers[k] = gr
            deps[k] -= 1
            if deps[k] == 0:
                heapq.heappush(heap, e)
        del grads, gr
