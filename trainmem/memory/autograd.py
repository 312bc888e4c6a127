"""A small autograd for the replay: nodes with saved tensors, the backward pass in the
engine's order, leaf gradient accumulation, and non-reentrant activation
checkpointing."""

from __future__ import annotations

import heapq
import math

from .accounting import SimTensor, Simulator, new, shrink, view


class Node:
    """A backward node: ``order`` is its creation order (backward runs the latest
    first), ``edges`` where the gradients of its inputs go, ``saved`` the buffers
    autograd keeps for it, ``backward_fn(node, grad)`` the gradients of its inputs,
    ``region`` the checkpointed region it belongs to, ``saves_tensors`` whether autograd
    saved anything for it (under checkpointing: placeholders)."""

    __slots__ = (
        "order",
        "edges",
        "saved",
        "backward_fn",
        "region",
        "saves_tensors",
        "restore",
        "__weakref__",
    )

    def __init__(
        self, order, edges, saved, backward_fn, region=None, saves_tensors=False
    ):
        # bytes of the saved tensors that activation offloading moved to the host:
        # copied back to the device when the node's backward runs
        self.restore = ()
        self.order = order
        self.edges = edges
        self.saved = saved
        self.backward_fn = backward_fn
        self.region = region
        self.saves_tensors = saves_tensors

    def __lt__(self, other):
        return self.order > other.order


class AccumulateGrad:
    """AccumulateGrad of a leaf parameter: the first gradient is stolen, later ones
    added in place. ``discard``: a leaf that is not a parameter (its gradient is
    dropped)."""

    __slots__ = ("param", "grad", "order", "discard", "__weakref__")

    def __init__(self, param: SimTensor):
        self.param = param
        self.grad = None
        self.order = math.inf
        self.discard = False

    def __lt__(self, other):
        return self.order > other.order


def record(
    sim: Simulator,
    out: SimTensor,
    inputs: list,
    saved: list,
    backward_fn,
    save_out: bool = False,
) -> None:
    """Attach a backward node to ``out`` if any input requires grad (and grad mode is
    on).

    ``saved`` are the tensors autograd keeps for this node; ``save_out`` adds the output
    itself.
    """
    if not sim.grad_enabled or not any(
        i is not None and i.requires_grad for i in inputs
    ):
        return
    region = sim.checkpoint_region
    saving = bool(saved) or save_out
    if region is not None and region.recording:
        region.n_nodes += 1
        if saving:
            region.last_saving = region.n_nodes
        saved, save_out = [], False  # checkpoint: nothing kept, recomputed in backward
    buffers = [t.buffer for t in saved] + ([out.buffer] if save_out else [])
    restore = ()
    if sim.offload is not None:
        buffers, restore = sim.offload.pack(sim, buffers)
    node = Node(
        next(sim.node_ids),
        [i.edge() if i is not None else None for i in inputs],
        buffers,
        backward_fn,
        region,
        saves_tensors=saving,
    )
    out.requires_grad = True
    out.grad_fn = node
    node.restore = restore
    if region is not None and region.recording:
        region.nodes.append(node)
    if region is not None and region.replaying is not None:
        region.replay_node(sim, node, out, save_out)


class _StopRecompute(Exception):
    pass


class CheckpointRegion:
    """One call of non-reentrant ``torch.utils.checkpoint``: the function, its kept
    inputs, the nodes it recorded, and the state of its recompute in backward."""

    def __init__(self, forward_fn, inputs, autocast, reentrant: bool = False):
        self.forward_fn, self.inputs = forward_fn, inputs
        # reentrant torch.utils.checkpoint (CheckpointFunction.backward): the whole
        # region is recomputed (no early stop) and its outputs live until the
        # region's own backward is over
        self.reentrant = reentrant
        self.recomputed = None
        self.autocast = autocast  # the autocast dtype of the forward, for the recompute
        self.nodes: list[Node] = []
        self.n_nodes = 0
        self.last_saving = 0  # number of the last node that saves tensors
        self.recording = True
        self.replaying = None  # during the recompute: the number of nodes replayed
        self.done = False  # recomputed already
        self.executed = 0  # nodes whose backward ran

    def replay_node(self, sim, node, out, save_out):
        """Hand the recomputed saved tensors to the original node; stop after the last
        one.

        Autograd packs saved *inputs* before the kernel runs and saved outputs after it,
        so when the last node saves only inputs the recompute stops before its output is
        allocated."""
        i = self.replaying
        self.replaying += 1
        if i < len(self.nodes):
            self.nodes[i].saved = node.saved
        if self.replaying >= self.last_saving and not self.reentrant:
            if not save_out:
                sim.unalloc_last(out.buffer)
            raise _StopRecompute

    def recompute(self, sim):
        if self.done:
            return
        self.done = True
        outer_region = sim.checkpoint_region
        sim.checkpoint_region = self
        self.recording = False
        self.replaying = 0
        outer_autocast, outer_cache = sim.autocast, sim.autocast_cache
        sim.autocast, sim.autocast_cache = self.autocast, []
        try:
            inputs = [
                view(t, t.shape, t.layout) if t is not None else None
                for t in self.inputs
            ]
            # same requires_grad as in the forward, so the node order matches
            for t in inputs:
                if t is not None:
                    t.grad_fn = _PLACEHOLDER if t.requires_grad else None
                    t.grad_accumulator = None
            try:
                out = self.forward_fn(*inputs)
                if self.reentrant:
                    # CheckpointFunction.backward holds the recomputed outputs (their
                    # storage; the recompute's own graph frees as its backward runs)
                    self.recomputed = out.buffer
            except _StopRecompute:
                pass
        finally:
            sim.checkpoint_region = outer_region
            # the recompute's autocast exits
            sim.autocast, sim.autocast_cache = outer_autocast, outer_cache
            self.replaying = None
            # the checkpoint keeps its inputs until the layer's backward is over (see
            # backward())


_PLACEHOLDER = Node(-1, [], [], None)  # the grad_fn of a recompute's inputs


def checkpoint(sim: Simulator, forward_fn, *inputs, reentrant: bool = False):
    """``torch.utils.checkpoint``: keep ``inputs``, drop the saved tensors
    (``reentrant``: the ``use_reentrant=True`` form's full recompute)."""
    region = CheckpointRegion(forward_fn, list(inputs), sim.autocast, reentrant)
    outer_region = sim.checkpoint_region
    sim.checkpoint_region = region
    try:
        out = forward_fn(*inputs)
    finally:
        sim.checkpoint_region = outer_region
        region.recording = False
    # the nodes of the region need the recompute before their backward runs
    for node in region.nodes:
        node.region = region
    return out


def param(sim: Simulator, shape, dtype, trainable: bool, category: str) -> SimTensor:
    p = new(sim, shape, dtype, category=category)
    sim.param_buffers.add(p.buffer.uid)  # activation offloading keeps parameters
    p.requires_grad = trainable
    if trainable:
        p.grad_accumulator = AccumulateGrad(p)
    return p


def _dependencies(root) -> dict:
    """How many gradients each node of the graph below ``root`` waits for."""
    deps: dict = {}
    stack = [root]
    seen = {id(root)}
    while stack:
        node = stack.pop()
        if isinstance(node, AccumulateGrad):
            continue
        for e in node.edges:
            if e is None or e is _PLACEHOLDER:
                continue
            deps[id(e)] = deps.get(id(e), 0) + 1
            if id(e) not in seen:
                seen.add(id(e))
                stack.append(e)
    return deps


def _accumulate(sim: Simulator, node: AccumulateGrad, grad: SimTensor) -> None:
    """AccumulateGrad: the first gradient becomes ``.grad`` (the rest is added in place
    and freed by the caller)."""
    p = node.param
    if node.discard:  # a leaf that is not a parameter: grad discarded
        return
    if p.buffer is not None and p.grad_accumulator is node and node.grad is None:
        if grad.buffer.category != "gradients":
            sim.recategorize(grad.buffer, "gradients")
            if sim.sharded and sim.sharded.grad_scale != 1.0:
                shrink(sim, grad.buffer, sim.sharded.grad_scale)
        node.grad = grad


def backward(sim: Simulator, loss: SimTensor):
    """Run the recorded graph backward from the scalar ``loss`` (reverse creation
    order)."""
    root = loss.grad_fn
    if root is None:
        return
    deps = _dependencies(root)
    ones = new(sim, (), "fp32")  # ones_like(loss)
    pending = {id(root): ones}  # the gradient waiting at each node
    del ones
    heap = [root]
    while heap:
        node = heapq.heappop(heap)
        grad = pending.pop(id(node))
        if isinstance(node, AccumulateGrad):
            _accumulate(sim, node, grad)
            del grad
            continue
        # non-reentrant checkpointing recomputes when a saved tensor is first unpacked:
        # at the first node of the region that saved something (nodes that save nothing
        # run before)
        region = node.region
        if region is not None and not region.done and node.saves_tensors:
            region.recompute(sim)
        # offloaded saved tensors come back to the device for this node's backward
        restored = [sim.alloc(n) for n in node.restore]
        input_grads = node.backward_fn(node, grad)
        del grad, restored
        node.saved = None
        if region is not None:
            region.executed += 1
            if region.executed == len(region.nodes):
                # release the kept inputs (and break the region <-> node reference
                # cycle)
                region.inputs = region.forward_fn = region.recomputed = None
                region.nodes = []
                region.executed = -1
        for e, input_grad in zip(node.edges, input_grads):
            if e is None or input_grad is None or e is _PLACEHOLDER:
                continue
            key = id(e)
            if key in pending:
                # a second gradient for the same node: old + new, a new tensor
                old = pending[key]
                pending[key] = SimTensor(sim.alloc(old.nbytes), old.shape, old.dtype)
                del old
            else:
                pending[key] = input_grad
            deps[key] -= 1
            if deps[key] == 0:
                heapq.heappush(heap, e)
        del input_grads, input_grad
