"""DPO and GRPO losses written by hand in torch, the step
:mod:`trainmem.measuring.measure` runs for ``objective="dpo"``/``"grpo"`` (the replay
of the same step: :mod:`trainmem.memory.preference`).

They follow TRL's ``DPOTrainer._compute_loss`` and ``GRPOTrainer._compute_loss``
(sigmoid DPO loss; GRPO's clipped ratio with an optional KL term) without the parts that
do not change memory (padding masks, metrics). The log-probability of each label is
``log_softmax(logits.float()).gather(labels)`` over the whole logits tensor; TRL's
``selective_log_softmax`` runs the same ``log_softmax`` row by row, which lowers the
forward's transient, but autograd still keeps every row's fp32 output until backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

#: DPOConfig's default beta
DPO_BETA = 0.1
#: GRPOConfig's default epsilon (clipping of the ratio)
GRPO_EPSILON = 0.2
#: the beta the measured GRPO step uses when it has a reference (GRPOConfig's default
#: is 0.0: no reference)
GRPO_BETA = 0.04


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``(rows, n)`` of ``labels`` ``(rows, n)`` under logits
    ``(rows, n + 1, vocab)`` (the last position predicts nothing)."""
    shifted = logits[:, :-1, :].float().contiguous()
    logp = shifted.log_softmax(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _reference_context(model, reference: str):
    """``torch.no_grad()`` and, for ``adapter``, peft's ``disable_adapter()``."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    if reference == "adapter":
        stack.enter_context(model.disable_adapter())
    return stack


def dpo_loss(model, ref_model, input_ids, reference: str, precomputed=None):
    """The DPO loss of ``input_ids`` ``(2 x pairs, seq)``: chosen rows then rejected.
    ``reference``: ``copy`` (``ref_model``), ``adapter`` (``model`` with its LoRA
    adapter disabled) or ``precomputed`` (``precomputed``: ``(2 x pairs,)``)."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    logps = token_logps(logits, input_ids[:, 1:]).sum(-1)
    if reference == "precomputed":
        ref = precomputed
    else:
        runner = ref_model if reference == "copy" else model
        with _reference_context(model, reference):
            ref_logits = runner(input_ids=input_ids, use_cache=False).logits
            ref = token_logps(ref_logits, input_ids[:, 1:]).sum(-1)
            del ref_logits
    del logits
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -F.logsigmoid(DPO_BETA * margin).mean()


def grpo_loss(model, input_ids, completion: int, advantages, ref_logps=None):
    """The GRPO loss of ``input_ids`` ``(rows, prompt + completion)``, logits for the
    completion only (``logits_to_keep``), the old log-probabilities the detached
    current ones (one iteration per generation), ``advantages`` ``(rows,)`` and, when
    given, the reference's per-token log-probabilities ``(rows, completion)``."""
    logits = model(
        input_ids=input_ids, use_cache=False, logits_to_keep=completion + 1
    ).logits
    logps = token_logps(logits, input_ids[:, -completion:])
    del logits
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - GRPO_EPSILON, 1 + GRPO_EPSILON)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if ref_logps is not None:
        diff = ref_logps - logps
        per_token = per_token + GRPO_BETA * (torch.exp(diff) - diff - 1)
    return per_token.mean()


def reference_token_logps(model, ref_model, input_ids, completion: int, reference):
    """The reference's per-token log-probabilities for GRPO (computed when the
    rollouts are scored, before the step)."""
    runner = ref_model if reference == "copy" else model
    with _reference_context(model, reference):
        logits = runner(
            input_ids=input_ids, use_cache=False, logits_to_keep=completion + 1
        ).logits
        return token_logps(logits, input_ids[:, -completion:])
