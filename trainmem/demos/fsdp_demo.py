"""A runnable FSDP2 (``fully_shard``) demo on the CPU: 2 processes, gloo, a tiny Llama
(chapter 09).

:func:`run` spawns ``world_size`` processes with ``torch.multiprocessing`` (``spawn``),
which rendezvous on 127.0.0.1 at a free port with the **gloo** backend (NCCL is
GPU-only). Every rank:

(Ranks are forked from a ``forkserver`` that imported torch and transformers once;
``spawn`` where forkserver does not exist.)

1. builds the same tiny Llama (:func:`trainmem.measuring.models.build_model`, fp32, seed
   0);
2. applies ``fully_shard`` to each decoder layer, then to the root (bottom-up, as the
   FSDP2 docs ask), and only **then** builds AdamW — the optimizer must see the sharded
   DTensor parameters;
3. runs one training step on its own micro-batch (seed = ``seed + rank``);
4. measures, from the local shards (``DTensor.to_local()``), the bytes of parameters,
   gradients and optimizer states it holds, and — to show a pitfall — the *global*
   ``numel()`` the DTensors report.

It also runs two pitfall checks inside the same processes: an optimizer built *before*
``fully_shard`` (its parameters are no longer the module's, so the step changes
nothing), and the bytes autograd saves for backward (activations) per rank, with and
without FSDP, for the same micro-batch (ZeRO/FSDP does not shard activations).

Results come back as plain Python data (ints, floats, lists) so a notebook can print
them and nbval can compare them. Sizes are in **bytes**; shapes are the parameters'
global shapes.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import traceback

import torch

from .. import zero

DEFAULT_BATCH = (2, 16)  # (micro-batch, sequence length) per rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (or ``t`` itself for a plain tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _batch(vocab: int, seed: int, batch=DEFAULT_BATCH):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, batch, generator=g)


def _saved_bytes(model, ids) -> int:
    """Bytes of tensors autograd saves for backward during ``model(ids)``, weights
    excluded.

    While a module runs, the storages of its own weights (under FSDP: the all-gathered,
    unsharded ones) are on a stack kept by forward pre-/post-hooks; a saved tensor
    sharing one of those live storages is a weight, not an activation, and is not
    counted.
    """
    stack: list[set[int]] = []

    def pre_hook(module, args):
        stack.append(
            {
                _local(p).untyped_storage().data_ptr()
                for p in module._parameters.values()
                if p is not None
            }
        )

    def post_hook(module, args, out):
        stack.pop()

    handles = []
    for m in model.modules():
        if m._parameters:
            handles += [
                m.register_forward_pre_hook(pre_hook),
                m.register_forward_hook(post_hook),
            ]
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if not any(ptr in s for s in stack):
            total += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        for h in handles:
            h.remove()
    return total


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(
    rank: int, world_size: int, port: int, model_name: str, seed: int, lr: float, q
) -> None:
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(1)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from ..measuring.models import build_model, get_config

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            mesh = init_device_mesh("cpu", (world_size,))
            cfg = get_config(model_name)
            ids = _batch(cfg.vocab_size, seed + rank)

            # --- the right order: shard, then build the optimizer ---------------------
            model = _shard(build_model(cfg, seed=seed), mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            start = [_local(p).detach().clone() for p in model.parameters()]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            changed_right = sum(
                not torch.equal(b, _local(p)) for b, p in zip(start, model.parameters())
            )
            params = []
            for name, p in model.named_parameters():
                st = opt.state[p]
                params.append(
                    dict(
                        name=name,
                        shape=list(p.shape),
                        global_numel=p.numel(),
                        local_numel=_local(p).numel(),
                        param_bytes=_nbytes(p),
                        grad_bytes=_nbytes(p.grad),
                        optim_bytes=sum(
                            _nbytes(v) for v in st.values() if torch.is_tensor(v)
                        ),
                        optim_states=sorted(st),
                    )
                )
            loss_value = loss.detach().clone()
            dist.all_reduce(loss_value)  # mean loss over ranks, for a printout

            # --- pitfall: optimizer built before fully_shard --------------------------
            wrong = build_model(cfg, seed=seed)
            wrong_opt = torch.optim.AdamW(wrong.parameters(), lr=lr)
            _shard(wrong, mesh)
            before = [_local(p).detach().clone() for p in wrong.parameters()]
            wrong(input_ids=ids, labels=ids).loss.backward()
            wrong_opt.step()
            changed_wrong = sum(
                not torch.equal(b, _local(p))
                for b, p in zip(before, wrong.parameters())
            )
            opt_sees_module_params = any(
                p is q_
                for g in wrong_opt.param_groups
                for p in g["params"]
                for q_ in wrong.parameters()
            )

            # --- pitfall: activations are not sharded ---------------------------------
            saved_fsdp = _saved_bytes(_shard(build_model(cfg, seed=seed), mesh), ids)
            saved_plain = _saved_bytes(build_model(cfg, seed=seed), ids)

            q.put(
                dict(
                    rank=rank,
                    params=params,
                    loss=float(loss_value) / world_size,
                    wrong_order_changed=int(changed_wrong),
                    right_order_changed=int(changed_right),
                    n_param_tensors=len(params),
                    wrong_order_optimizer_sees_module_params=bool(
                        opt_sees_module_params
                    ),
                    saved_bytes_fsdp=int(saved_fsdp),
                    saved_bytes_plain=int(saved_plain),
                    backend=dist.get_backend(),
                )
            )
        finally:
            dist.destroy_process_group()
    except Exception:  # report, do not hang the parent
        q.put(dict(rank=rank, error=traceback.format_exc()))


PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.device_mesh",
    "trainmem.measuring.models",
    "transformers.models.llama.modeling_llama",
]


def _context(mp, start_method: str | None = None):
    """A ``forkserver`` context that has imported :data:`PRELOAD` once (where the
    platform has forkserver), else ``spawn``.

    Each rank is then forked from a clean, single-threaded server process that already
    holds torch and transformers, instead of importing them again in every rank (a few
    CPU-seconds each). Never plain ``fork``: forking a process that has used OpenMP
    threads (a Jupyter kernel that ran torch) can deadlock.
    """
    if start_method not in (None, "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be None, 'spawn' or 'forkserver', got {start_method!r}"
        )
    if start_method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(
    label: str,
    target,
    args: tuple,
    world_size: int,
    timeout: float,
    start_method: str | None = None,
) -> list[dict]:
    """Run ``target(rank, world_size, port, *args, queue)`` in ``world_size`` CPU
    processes (see :func:`_context`) and return the dict each rank puts on the queue,
    sorted by rank.

    Raises ``RuntimeError`` with the worker's traceback if a rank reports an ``error``,
    ``TimeoutError`` if a rank does not report within ``timeout`` seconds; the
    processes are joined (or terminated) either way. ``label`` names the demo in those
    messages.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer ≥ 1, got {world_size!r}")
    import torch.multiprocessing as mp

    ctx = _context(mp, start_method)
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, world_size, port, *args, q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            try:
                results.append(q.get(timeout=timeout))
            except queue_mod.Empty:
                raise TimeoutError(
                    f"{label}: no result from a rank within {timeout} s"
                ) from None
            if "error" in results[-1]:
                raise RuntimeError(
                    f"{label} rank {results[-1]['rank']} "
                    f"failed:\n{results[-1]['error']}"
                )
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
    return sorted(results, key=lambda r: r["rank"])


def run(
    world_size: int = 2,
    model: str = "tiny",
    seed: int = 0,
    lr: float = 1e-2,
    timeout: float = 120.0,
    start_method: str | None = None,
) -> list[dict]:
    """Run the FSDP2 demo on ``world_size`` CPU processes; return one result dict per
    rank.

    Each dict: ``rank``, ``params`` (per parameter: ``name``, global ``shape``,
    ``global_numel``, ``local_numel``, ``param_bytes``, ``grad_bytes``,
    ``optim_bytes``), the mean ``loss``, and the pitfall measurements
    (``right_order_changed``/``wrong_order_changed``: parameter tensors the step changed
    on this rank, ``saved_bytes_fsdp``, ``saved_bytes_plain``). ``start_method``:
    ``None`` (forkserver where available, else spawn), ``"spawn"`` or ``"forkserver"``.
    Raises ``RuntimeError`` with the worker's traceback if a rank fails,
    ``TimeoutError`` if the ranks do not report within ``timeout`` seconds.
    """
    return run_ranks(
        "FSDP demo", _worker, (model, seed, lr), world_size, timeout, start_method
    )


def expected(params: list[dict], world_size: int, rank: int) -> dict:
    """Per-rank bytes the formula predicts for fp32 weights + fp32 grads + AdamW (2 fp32
    states).

    Local elements follow :func:`trainmem.zero.fsdp_local_numel`; AdamW's ``step`` is
    one fp32 scalar per parameter tensor (4 bytes), present on every rank.
    """
    local = sum(zero.fsdp_local_numel(p["shape"], world_size, rank) for p in params)
    return dict(
        local_numel=local,
        param_bytes=4 * local,
        grad_bytes=4 * local,
        optim_bytes=8 * local + 4 * len(params),
    )


def summarize(results: list[dict]) -> list[dict]:
    """One row per rank: measured vs expected bytes, and the global-numel pitfall."""
    world = len(results)
    rows = []
    for r in results:
        ps = r["params"]
        exp = expected(ps, world, r["rank"])
        rows.append(
            dict(
                rank=r["rank"],
                local_numel=sum(p["local_numel"] for p in ps),
                global_numel=sum(p["global_numel"] for p in ps),
                param_bytes=sum(p["param_bytes"] for p in ps),
                grad_bytes=sum(p["grad_bytes"] for p in ps),
                optim_bytes=sum(p["optim_bytes"] for p in ps),
                expected_param_bytes=exp["param_bytes"],
                expected_grad_bytes=exp["grad_bytes"],
                expected_optim_bytes=exp["optim_bytes"],
            )
        )
    return rows
