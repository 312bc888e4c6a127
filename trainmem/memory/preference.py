"""The losses of the objectives beyond supervised fine-tuning, replayed op by op on the
transformers decoder (:mod:`.llama`): DPO over the concatenated chosen and rejected
sequences with its reference forward, GRPO over completions with logits kept for the
completion only, and the rollouts' generation with its KV cache.

The log-probability of each label is ``gather(log_softmax(logits[:, :-1].float()),
labels)``, as :mod:`trainmem.measuring.preference_losses` computes it and TRL's
``selective_log_softmax`` does row by row: either way autograd keeps the fp32
log-softmax of every row (``log_softmax`` saves its output) until backward, ``rows x
(tokens - 1) x vocab x 4`` bytes, next to the 16-bit logits the forward made."""

from __future__ import annotations

from .accounting import SimTensor, Simulator, new, view
from .autograd import record
from .llama import llama_loss
from .ops import cast, clone_contig, log_softmax, mul_scalar, narrow


def gather(sim: Simulator, logp: SimTensor, shape) -> SimTensor:
    """``logp.gather(-1, index)``: the output; autograd saves ``logp`` (already kept
    by ``log_softmax``) and the index; backward scatters into zeros of ``logp``'s
    shape."""
    out = new(sim, shape, logp.dtype)
    full, dtype = logp.shape, logp.dtype
    record(sim, out, [logp], [logp], lambda node, g: [new(sim, full, dtype)])
    return out


def sum_last(sim: Simulator, x: SimTensor) -> SimTensor:
    """``x.sum(-1)``: backward expands the gradient (a view)."""
    out = new(sim, x.shape[:-1], x.dtype)
    shape = x.shape
    record(sim, out, [x], [], lambda node, g: [view(g, shape)])
    return out


def elementwise(sim: Simulator, x: SimTensor, saves: bool = True) -> SimTensor:
    """A pointwise op of the small per-token or per-sequence tensors of a loss (exp,
    clamp, a product with the advantages, ...): a new tensor, its input saved."""
    out = new(sim, x.shape, x.dtype)
    shape, dtype = x.shape, x.dtype
    record(
        sim, out, [x], [x] if saves else [], lambda node, g: [new(sim, shape, dtype)]
    )
    return out


def token_logps(sim: Simulator, logits: SimTensor, n_tokens: int) -> SimTensor:
    """Per-token log-probabilities ``(rows, n_tokens)`` of the labels, from logits
    ``(rows, n_tokens + 1, vocab)``: the slice ``[:, :-1]``, an fp32 copy (``.float()``,
    or ``.contiguous()`` of fp32 logits), ``log_softmax`` (saves its output) and
    ``gather``."""
    rows, _, vocab = logits.shape
    shifted = narrow(sim, logits, (rows, n_tokens, vocab))
    if shifted.dtype == "fp32":
        x = clone_contig(sim, shifted)
    else:
        x = cast(sim, shifted, "fp32")
    del shifted
    logp = log_softmax(sim, x)
    del x
    return gather(sim, logp, (rows, n_tokens))


def _forward_logits(sim, model, ids, cfg, keep=None, reference=False):
    """The model's logits for ``ids`` (``keep``: ``logits_to_keep``). ``reference``:
    TRL's reference forward — no graph, gradient checkpointing off, LoRA's adapter
    disabled when the reference is the policy's base."""
    fwd = dict(cfg, return_logits=True, logits_to_keep=keep)
    if reference:
        fwd["checkpointing"] = False
    return llama_loss(sim, model, ids, None, fwd)


def _reference_logps(sim, d, model, ids, cfg, n_tokens, keep=None) -> SimTensor:
    """The reference's per-sequence (DPO) or per-token (GRPO) log-probabilities,
    computed without a graph (``torch.no_grad()``): only the result stays."""
    ref_model = cfg["reference_model"] or model
    grad, sim.grad_enabled = sim.grad_enabled, False
    off, sim.adapters_off = sim.adapters_off, cfg["reference_model"] is None
    try:
        logits = _forward_logits(sim, ref_model, ids, cfg, keep, reference=True)
        logps = token_logps(sim, logits, n_tokens)
        del logits
        return logps if keep else sum_last(sim, logps)
    finally:
        sim.grad_enabled, sim.adapters_off = grad, off


def dpo_loss(sim: Simulator, model, ids, labels, cfg, d) -> SimTensor:
    """TRL's ``DPOTrainer._compute_loss`` over the ``2 x batch`` sequences ``ids``
    (chosen rows then rejected): the policy's forward and log-probabilities, then the
    reference's (without a graph, while the policy's graph and logits are alive; read
    from the batch when precomputed), then the sigmoid loss of the per-pair
    margins."""
    rows, seq = ids.shape
    logits = _forward_logits(sim, model, ids, cfg)
    logps = sum_last(sim, token_logps(sim, logits, seq - 1))
    if d.reference == "precomputed":
        ref = cfg["precomputed_logps"]
    else:
        ref = _reference_logps(sim, d, model, ids, cfg, seq - 1)
    del logits  # the model output goes out of scope when the loss returns
    pairs = rows // 2
    chosen = view(logps, (pairs,))
    rejected = view(logps, (pairs,))
    chosen_ratio = elementwise(sim, chosen, saves=False)  # chosen - ref_chosen
    rejected_ratio = elementwise(sim, rejected, saves=False)
    margin = elementwise(sim, chosen_ratio, saves=False)  # their difference
    del chosen_ratio, rejected_ratio, chosen, rejected, ref, logps
    scaled = mul_scalar(sim, margin)  # beta * margin
    del margin
    # -F.logsigmoid(...).mean(): log_sigmoid saves its input and a buffer
    buffer = new(sim, scaled.shape, scaled.dtype)
    out = elementwise(sim, scaled)
    del scaled, buffer
    out = elementwise(sim, out, saves=False)  # neg
    return mean(sim, out)


def mean(sim: Simulator, x: SimTensor) -> SimTensor:
    """``x.mean()``: a scalar; backward expands the gradient divided by the count (a
    new tensor of ``x``'s shape)."""
    loss = new(sim, (), x.dtype)
    shape, dtype = x.shape, x.dtype
    record(sim, loss, [x], [], lambda node, g: [new(sim, shape, dtype)])
    return loss


def grpo_loss(sim: Simulator, model, ids, labels, cfg, d) -> SimTensor:
    """TRL's ``GRPOTrainer._compute_loss`` on ``batch`` completions of
    ``max_completion_length`` tokens after their prompts: logits for the completion
    only (``logits_to_keep = completion + 1``), per-token log-probabilities, the
    clipped ratio to the (detached) old ones times the advantages, plus ``beta`` times
    the per-token KL to the reference's log-probabilities, which were computed when
    the rollouts were scored (:func:`generate`), and the token mean."""
    completion = d.options.max_completion_length
    logits = _forward_logits(sim, model, ids, cfg, keep=completion + 1)
    logps = token_logps(sim, logits, completion)
    del logits
    ratio = elementwise(sim, logps, saves=False)  # logps - old (detached)
    coef_1 = elementwise(sim, ratio, saves=False)  # exp: saves its output
    del ratio
    coef_2 = elementwise(sim, coef_1)  # clamp
    loss_1 = elementwise(sim, coef_1)  # coef_1 * advantages
    loss_2 = elementwise(sim, coef_2)  # coef_2 * advantages
    del coef_1, coef_2
    per_token = new(sim, loss_1.shape, loss_1.dtype)  # -min(loss_1, loss_2)
    shape, dtype = loss_1.shape, loss_1.dtype
    record(
        sim,
        per_token,
        [loss_1, loss_2],
        [loss_1, loss_2],  # minimum saves both
        lambda node, g: [new(sim, shape, dtype), new(sim, shape, dtype)],
    )
    del loss_1, loss_2
    if d.reference != "none":
        diff = elementwise(sim, logps, saves=False)  # ref - logps
        kl = elementwise(sim, diff)  # exp(diff) - diff - 1
        del diff
        per_token = elementwise(sim, per_token, saves=False)  # + beta * kl
        del kl
    del logps
    return mean(sim, per_token)


def generate(sim: Simulator, model, d, cfg) -> None:
    """The rollouts of a GRPO step, before its micro-batches (gradients ``None``, the
    optimizer states alive): ``transformers`` ``generate`` over the generation batch
    (``batch x grad_accum`` prompts, TRL's ``steps_per_generation`` at its default),
    a prefill of the prompts that keeps every layer's K and V, the cache grown to
    prompt + completion tokens (``DynamicCache`` concatenates a layer's new K or V onto
    the old one), the last position's logits in fp32; then, with a reference, its
    per-token log-probabilities in micro-batches of ``batch``. Not measured on CPU (a
    model of the phase, not of a kernel)."""
    step = d.options
    rows = step.batch * step.grad_accum
    prompt, completion = step.seq, step.max_completion_length
    grad, sim.grad_enabled = sim.grad_enabled, False
    sim.last_alloc = None  # (the optimizer's last scratch tensor is gone)
    try:
        sim.set_phase("generate")
        sim.autocast = d.dtypes.autocast
        ids = new(sim, (rows, prompt), "i64")
        fwd = dict(cfg, checkpointing=False, kv_cache=[], keep_cache=True)
        logits = _forward_logits(sim, model, ids, fwd, keep=1)
        prefill = fwd["kv_cache"]
        del logits
        grown = []
        while prefill:
            k = prefill.pop(0)
            b, heads, _, dim = k.shape
            grown.append(new(sim, (b, heads, prompt + completion, dim), k.dtype))
            del k
        last = new(sim, (rows, 1, model.lm_head.shape[0]), "fp32")
        del last, grown, prefill, ids
        if d.reference != "none":
            sim.set_phase("score")
            ids = new(sim, (step.batch, prompt + completion), "i64")
            ref = _reference_logps(sim, d, model, ids, cfg, completion, completion + 1)
            del ref, ids
    finally:
        sim.grad_enabled = grad
        sim.autocast = None
