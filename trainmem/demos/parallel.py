"""Beyond ZeRO (chapter 09): tensor parallelism, throughput, checkpoints under DDP.

Three demonstrations that run on the CPU:

* **Tensor parallelism** (Megatron-LM, Shoeybi et al., 2019): a Llama MLP split over the
  ranks of a gloo process group -- ``gate_proj``/``up_proj`` column-parallel (each rank
  keeps a block of output rows), ``down_proj`` row-parallel (each rank keeps the
  matching block of input columns). Two autograd functions carry the communication:
  ``f`` (identity forward, all-reduce of the input gradient backward) and ``g``
  (all-reduce of the partial outputs forward, identity backward). :func:`run_tp` checks
  the result against the unsharded MLP, counts the all-reduces and measures, per rank,
  the bytes autograd saves for backward with no parallelism, with FSDP2
  (``fully_shard``) and with tensor parallelism.
* **Throughput levers**: useful tokens under padding vs packing
  (:func:`pad_vs_pack_tokens`), optimizer implementations (:func:`optimizer_step_ms`),
  and a data loader whose items take time to decode (:class:`SlowDataset`,
  :func:`loader_timing`).
* **Checkpoints under DDP**: :func:`save_tagged` writes a checkpoint whose storages are
  recorded as saved from ``cuda:0`` (what ``torch.save`` records in a GPU process), so
  that what ``torch.load`` does with it can be shown on a CPU-only machine;
  :func:`rank0_extra_bytes`.

Sizes are in **bytes**, times in seconds unless a name says ``_ms``.
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.nn.functional as F

from .fsdp_demo import run_ranks

TP_BATCH = (2, 16)  # (micro-batch, sequence length) of the MLP input on every rank


# ------------------------------------------------------------------ tensor parallelism
class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        ctx.counts["backward"] += 1
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) of the partial outputs forward; identity
    backward.
    """

    @staticmethod
    def forward(ctx, y, group, counts):
        import torch.distributed as dist

        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        counts["forward"] += 1
        counts["elements"] += y.numel()
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def tp_shard_mlp(mlp, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's blocks of a Llama MLP's weights (``nn.Linear`` weights are (out,
    in)).

    ``gate``/``up``: rows ``rank`` of ``torch.chunk(W, world_size, dim=0)``
    (column-parallel, shape ``(intermediate / N, hidden)``); ``down``: columns,
    ``dim=1`` (row-parallel, shape ``(hidden, intermediate / N)``). Returned as new leaf
    tensors that require grad.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    i = mlp.gate_proj.weight.shape[0]
    if i % world_size:
        raise ValueError(
            f"intermediate size {i} must be divisible by world_size={world_size}"
        )

    def block(w, dim):
        return torch.chunk(w.detach(), world_size, dim=dim)[rank].clone()

    return {
        "gate": block(mlp.gate_proj.weight, 0).requires_grad_(),
        "up": block(mlp.up_proj.weight, 0).requires_grad_(),
        "down": block(mlp.down_proj.weight, 1).requires_grad_(),
    }


def tp_mlp_forward(x, shard, group=None, counts=None):
    """The Llama MLP ``down(silu(gate(x)) * up(x))`` on one tensor-parallel rank."""
    counts = (
        counts if counts is not None else {"forward": 0, "backward": 0, "elements": 0}
    )
    x = _CopyToTP.apply(x, group, counts)  # f: all-reduces dL/dx in backward
    h = F.silu(F.linear(x, shard["gate"])) * F.linear(x, shard["up"])  # (b, s, i/N)
    partial = F.linear(h, shard["down"])  # (b, s, hidden): this rank's share of the sum
    return _ReduceFromTP.apply(partial, group, counts)  # g: sum over ranks


def saved_bytes(fn, modules=(), exclude=()) -> dict:
    """Bytes autograd saves for backward while ``fn()`` runs; weights are not counted.

    A saved tensor is left out when its storage is one of ``exclude`` (tensors, e.g.
    parameters) or a parameter of a module of ``modules`` that is running at that moment
    (under FSDP the all-gathered, unsharded weights live only while their module runs).
    Each storage is counted once. Returns ``{"bytes", "tensors", "shapes"}`` (shapes as
    lists, in save order) and ``fn()``'s result under ``"out"``.
    """
    fixed = {t.untyped_storage().data_ptr() for t in exclude}
    stack: list[set[int]] = []

    def pre_hook(module, args):
        stack.append(
            {
                p.untyped_storage().data_ptr()
                for p in module._parameters.values()
                if p is not None and not hasattr(p, "to_local")
            }
        )

    def post_hook(module, args, out):
        stack.pop()

    handles = []
    for mod in modules:
        for m in mod.modules():
            if m._parameters:
                handles += [
                    m.register_forward_pre_hook(pre_hook),
                    m.register_forward_hook(post_hook),
                ]
    seen: dict[int, list[int]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in fixed and not any(ptr in s for s in stack) and ptr not in seen:
            seen[ptr] = [list(t.shape), t.untyped_storage().nbytes()]
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        for h in handles:
            h.remove()
    return dict(
        bytes=sum(n for _, n in seen.values()),
        tensors=len(seen),
        shapes=[s for s, _ in seen.values()],
        out=out,
    )


def _tp_worker(rank, world_size, port, seed, q) -> None:
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(1)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ..measuring.models import build_model, get_config

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            cfg = get_config("tiny")

            def new_mlp():  # the same weights on every rank (same seed)
                return build_model(cfg, seed=seed).model.layers[0].mlp

            g = torch.Generator().manual_seed(seed + 1)
            x0 = torch.randn(*TP_BATCH, cfg.hidden_size, generator=g)  # same x on ranks
            dy = torch.randn(*TP_BATCH, cfg.hidden_size, generator=g)

            # --- no parallelism: the reference ---------------------------------------
            ref = new_mlp()
            x_ref = x0.clone().requires_grad_()
            plain = saved_bytes(lambda: ref(x_ref), exclude=list(ref.parameters()))
            plain["out"].backward(dy)

            # --- tensor parallelism --------------------------------------------------
            shard = tp_shard_mlp(ref, rank, world_size)
            counts = {"forward": 0, "backward": 0, "elements": 0}
            x_tp = x0.clone().requires_grad_()
            tp = saved_bytes(
                lambda: tp_mlp_forward(x_tp, shard, None, counts),
                exclude=list(shard.values()),
            )
            tp["out"].backward(dy)
            torch.testing.assert_close(tp["out"], plain["out"])
            torch.testing.assert_close(x_tp.grad, x_ref.grad)
            for name, dim in (("gate", 0), ("up", 0), ("down", 1)):
                full = getattr(ref, f"{name}_proj").weight.grad
                torch.testing.assert_close(
                    shard[name].grad, torch.chunk(full, world_size, dim=dim)[rank]
                )
            max_diff = float((tp["out"] - plain["out"]).detach().abs().max())

            # --- FSDP2 (ZeRO-3): weights sharded, activations not --------------------
            mesh = init_device_mesh("cpu", (world_size,))
            fs_mlp = fully_shard(new_mlp(), mesh=mesh)
            x_fs = x0.clone().requires_grad_()
            fs = saved_bytes(lambda: fs_mlp(x_fs), modules=[fs_mlp])
            fs["out"].backward(dy)
            torch.testing.assert_close(fs["out"], plain["out"])

            # --- torch's own tensor-parallel API; CommDebugMode counts collectives ---
            torch_counts = _torch_tp_allreduces(new_mlp(), mesh, x0, dy)

            def row(r):
                return dict(bytes=r["bytes"], tensors=r["tensors"], shapes=r["shapes"])

            q.put(
                dict(
                    rank=rank,
                    world_size=world_size,
                    saved_plain=row(plain),
                    saved_fsdp=row(fs),
                    saved_tp=row(tp),
                    allreduce_forward=counts["forward"],
                    allreduce_backward=counts["backward"],
                    allreduce_elements=counts["elements"],
                    torch_tp_allreduces=torch_counts,
                    max_abs_diff=max_diff,
                    shard_shapes={k: list(v.shape) for k, v in shard.items()},
                    full_shapes={
                        k: list(getattr(ref, f"{k}_proj").weight.shape)
                        for k in ("gate", "up", "down")
                    },
                )
            )
        finally:
            dist.destroy_process_group()
    except Exception:  # report, do not hang the parent
        q.put(dict(rank=rank, error=traceback.format_exc()))


def _torch_tp_allreduces(mlp, mesh, x0, dy) -> dict:
    """All-reduces of ``parallelize_module`` (ColwiseParallel/RowwiseParallel) on the
    MLP.
    """
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "gate_proj": ColwiseParallel(),
        "up_proj": ColwiseParallel(),
        "down_proj": RowwiseParallel(),
    }
    tp_mlp = parallelize_module(mlp, mesh, plan)
    x = x0.clone().requires_grad_()
    fwd, bwd = CommDebugMode(), CommDebugMode()
    with fwd:
        y = tp_mlp(x)
    with bwd:
        y.backward(dy)

    def n_allreduce(mode):
        return sum(
            n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op)
        )

    return {"forward": n_allreduce(fwd), "backward": n_allreduce(bwd)}


def run_tp(world_size: int = 2, seed: int = 0, timeout: float = 120.0) -> list[dict]:
    """Run the tensor-parallel MLP demo on ``world_size`` CPU processes (gloo).

    One dict per rank: ``saved_plain``/``saved_fsdp``/``saved_tp`` (``bytes``,
    ``tensors``, ``shapes`` saved for backward, weights excluded),
    ``allreduce_forward``/``_backward`` (the all-reduces ``f`` and ``g`` issued),
    ``allreduce_elements`` (elements all-reduced in forward), ``torch_tp_allreduces``
    (the same count for torch's ``parallelize_module``, by ``CommDebugMode``),
    ``max_abs_diff`` against the unsharded MLP, ``shard_shapes`` and ``full_shapes``.
    The outputs, the input gradient and the weight-gradient blocks are checked against
    the unsharded MLP inside each rank (``torch.testing.assert_close``).
    """
    return run_ranks("TP demo", _tp_worker, (seed,), world_size, timeout)


def mlp_saved_bytes(
    tokens: int, hidden: int, intermediate: int, tp: int = 1, bytes_per: int = 4
) -> int:
    """Bytes a Llama MLP saves for backward per rank: the input plus four (tokens,
    i/tp).

    Saved: ``x`` (by gate and up, one storage; replicated on every TP rank), ``gate(x)``
    (by SiLU), ``silu(gate(x))`` and ``up(x)`` (by the product), and the product (by
    ``down``). Tensor parallelism divides the last four by ``tp``; it does not divide
    ``x`` (sequence parallelism would).
    """
    if intermediate % tp:
        raise ValueError(f"intermediate={intermediate} must be divisible by tp={tp}")
    return bytes_per * tokens * (hidden + 4 * intermediate // tp)


# ------------------------------------------------------------------ throughput levers
def pad_vs_pack_tokens(lengths, batch_size: int, max_len: int) -> dict:
    """Tokens computed when ``lengths`` are batched in order, ``batch_size`` at a time.

    ``real``: the tokens of the sequences; ``padded``: each batch padded to its longest
    sequence (dynamic padding); ``packed``: sequences concatenated into rows of
    ``max_len`` (the last row padded). Every length must be in ``[1, max_len]``.
    """
    lengths = list(lengths)
    if batch_size < 1 or max_len < 1:
        raise ValueError(
            f"batch_size and max_len must be ≥ 1, got {batch_size}, {max_len}"
        )
    bad = [n for n in lengths if not 1 <= n <= max_len]
    if bad:
        raise ValueError(f"lengths must be in [1, max_len={max_len}], got {bad[:3]}")
    real = sum(lengths)
    padded = sum(
        len(c) * max(c)
        for c in (
            lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)
        )
    )
    packed = -(-real // max_len) * max_len
    return dict(real=real, padded=padded, packed=packed)


def optimizer_step_ms(
    impls=("foreach=False", "foreach=True", "fused=True"),
    n_tensors: int = 200,
    shape=(32, 32),
    steps: int = 10,
    repeats: int = 5,
    seed: int = 0,
    threads: int | None = 1,
) -> dict[str, float]:
    """Milliseconds per ``AdamW.step()`` for each implementation, on many small tensors.

    ``impls`` are strings ``"foreach=False"``, ``"foreach=True"`` or ``"fused=True"``.
    The implementations take turns: each round times ``steps`` steps of every one, and
    the fastest of ``repeats`` rounds is reported, so a burst of load from another
    process slows all of them alike instead of one.

    ``threads`` (default 1; ``None``: torch's current setting) is torch's intra-op
    thread count while timing, restored afterwards. With one thread the comparison
    measures the per-tensor overhead it is about; with two threads on a 2-core
    machine that other processes keep busy, the fused CPU kernel waits at OpenMP's
    barrier (measured: ``fused=True`` 43 ms against ``foreach=False`` 16 ms; with one
    thread 2.4 ms against 14 ms on the same busy machine).
    """
    known = {
        "foreach=False": dict(foreach=False),
        "foreach=True": dict(foreach=True),
        "fused=True": dict(fused=True),
    }
    unknown = [i for i in impls if i not in known]
    if unknown:
        raise ValueError(f"impls must be among {sorted(known)}, got {unknown}")
    g = torch.Generator().manual_seed(seed)
    optimizers = {}
    for impl in impls:
        params = [
            torch.nn.Parameter(torch.randn(*shape, generator=g))
            for _ in range(n_tensors)
        ]
        for p in params:
            p.grad = torch.randn(*shape, generator=g)
        optimizers[impl] = torch.optim.AdamW(params, lr=1e-3, **known[impl])
        optimizers[impl].step()  # creates the states

    def steps_of(opt):
        def run():
            for _ in range(steps):
                opt.step()

        return run

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        best = fastest_seconds(
            {impl: steps_of(opt) for impl, opt in optimizers.items()}, repeats
        )
    finally:
        torch.set_num_threads(before)
    return {impl: t / steps * 1e3 for impl, t in best.items()}


def fastest_seconds(runs: dict, rounds: int = 3) -> dict[str, float]:
    """Seconds of the fastest of ``rounds`` calls of each function in ``runs``.

    The functions take turns within each round, so a burst of load from another
    process slows all of them alike instead of one: a speed-up measured this way keeps
    its direction on a busy machine.
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer ≥ 1, got {rounds!r}")
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


class SlowDataset(torch.utils.data.Dataset):
    """``n`` items of ``seq`` token ids; each ``__getitem__`` sleeps ``decode_s``
    seconds.

    The sleep stands for the CPU work of reading, decoding and tokenising one sample.
    Sleeping releases the CPU, so worker processes overlap it even on a machine with few
    cores.
    """

    def __init__(self, n: int, decode_s: float, seq: int = 8):
        if n < 1 or decode_s < 0 or seq < 1:
            raise ValueError(
                f"need n ≥ 1, decode_s ≥ 0, seq ≥ 1; got {n}, {decode_s}, {seq}"
            )
        self.n, self.decode_s, self.seq = n, decode_s, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.decode_s)
        return torch.full((self.seq,), i, dtype=torch.long)


def loader_timing(
    num_workers: int,
    n_items: int = 32,
    batch_size: int = 4,
    decode_s: float = 0.01,
    step_s: float = 0.04,
    context: str | None = "forkserver",
) -> dict:
    """Feed a :class:`SlowDataset` to a fake training step (``time.sleep(step_s)``).

    The epoch is timed in two parts, because they answer different questions:

    - ``first_batch_s``: from creating the iterator to the first batch. With workers
      this is their start-up (new processes: it grows with the machine's load) plus
      decoding one batch; ``persistent_workers=True`` pays it once per run instead of
      once per epoch.
    - ``steady_s``: from the first batch to the end of the last step, the part that
      repeats for every batch. ``steady_wait_s`` is the time the loop spent waiting
      for the next batch in it, ``steady_wait_fraction`` its share.

    Also returns ``wall_s`` (the two together), ``wait_s`` and ``wait_fraction`` (the
    first batch's wait included), ``batches`` and the ids seen (``ids``, to check that
    nothing was lost or repeated). ``context``: the multiprocessing start method of the
    workers (``None``: the platform's default); ``forkserver`` avoids forking a process
    that has used OpenMP threads.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be ≥ 0, got {num_workers}")
    ds = SlowDataset(n_items, decode_s)
    kw = dict(multiprocessing_context=context) if num_workers and context else {}
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, num_workers=num_workers, **kw
    )
    waits: list[float] = []
    ids: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    it = iter(loader)
    while True:
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t)
        if t_first is None:
            t_first = time.perf_counter()
        ids += batch[:, 0].tolist()
        time.sleep(step_s)  # the "GPU step": the loop is busy, the workers keep loading
    t_end = time.perf_counter()
    wall = t_end - t0
    first = (t_first if t_first is not None else t_end) - t0
    steady = t_end - t0 - first
    steady_wait = sum(waits[1:])
    return dict(
        wall_s=wall,
        wait_s=sum(waits),
        wait_fraction=sum(waits) / wall,
        first_batch_s=first,
        steady_s=steady,
        steady_wait_s=steady_wait,
        steady_wait_fraction=steady_wait / steady if steady > 0 else 0.0,
        batches=len(waits),
        ids=ids,
    )


# ------------------------------------------------------------- checkpoints under DDP
# storage data_ptr -> location, filled only while save_tagged runs
_TAGGED: dict[int, str] = {}
_TAGGER_REGISTERED = False


def _tagger(storage):
    return _TAGGED.get(storage.data_ptr())


def _no_restore(obj, location):
    return None  # fall through to torch's own deserializers (cpu, cuda, ...)


def save_tagged(state: dict, f, location: str = "cuda:0") -> None:
    """``torch.save(state, f)``, recording every tensor's storage as saved from
    ``location``.

    ``torch.save`` writes, next to each storage, the device it came from
    (``location_tag``); torch asks the taggers registered with
    :func:`torch.serialization.register_package` first, so a tagger that answers
    ``location`` for these storages makes a CPU process write the checkpoint a process
    on ``location`` would write. Only the tensors of ``state`` (a flat dict of tensors)
    are tagged, and only during this call.
    """
    global _TAGGER_REGISTERED
    if not isinstance(state, dict) or not all(
        torch.is_tensor(v) for v in state.values()
    ):
        raise ValueError("state must be a dict of tensors (a state_dict)")
    if not _TAGGER_REGISTERED:
        torch.serialization.register_package(1, _tagger, _no_restore)
        _TAGGER_REGISTERED = True
    _TAGGED.update({v.untyped_storage().data_ptr(): location for v in state.values()})
    try:
        torch.save(state, f)
    finally:
        _TAGGED.clear()


def saved_locations(f) -> list[str]:
    """The device each storage of a checkpoint was saved from, in load order.

    Loads with a ``map_location`` callable that records its ``location`` argument and
    keeps the storage on the CPU, so nothing is placed on a GPU.
    """
    locs: list[str] = []

    def record(storage, location):
        locs.append(location)
        return storage

    torch.load(f, map_location=record)
    return locs


def rank0_extra_bytes(checkpoint_bytes: float, world_size: int) -> float:
    """Extra bytes on GPU 0 when every rank loads a checkpoint saved from ``cuda:0``.

    Without ``map_location`` each of the ``world_size`` processes restores its copy onto
    ``cuda:0``; rank 0 needed one copy, so the others add ``(world_size - 1) ×`` the
    size.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer ≥ 1, got {world_size!r}")
    return (world_size - 1) * checkpoint_bytes
