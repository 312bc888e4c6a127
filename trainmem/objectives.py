"""What a training step optimises beyond next-token prediction: one entry per
objective, declared once (supervised fine-tuning, DPO, GRPO).

An :class:`Objective` says what the step runs on top of the causal-LM forward: how many
sequences one micro-batch holds for ``batch`` (DPO: the chosen and the rejected
completion of every preference pair, concatenated as TRL's ``DPOTrainer`` batches
them), how long they are (GRPO: the prompt plus ``max_completion_length`` generated
tokens), whether a reference model's log-probabilities enter the loss and where they
come from, and whether the step generates its rollouts (GRPO).

The reference (``StepConfig.reference``), as TRL obtains it:

* ``copy``: a second, frozen model loaded like the policy (``DPOTrainer`` /
  ``GRPOTrainer`` without peft and without a ``ref_model``:
  ``create_model_from_path`` with the policy's init kwargs): its weights are held for
  the whole run and its forward runs without a graph;
* ``adapter``: LoRA's base with the adapter disabled (TRL's ``use_adapter(model,
  adapter_name=None)`` when the policy is a peft model): no second copy of the weights,
  the same frozen forward;
* ``precomputed``: DPO's ``precompute_ref_log_probs=True``: the log-probabilities are
  computed once before training and read from the batch (two floats per pair);
* ``none``: no reference (GRPO with ``beta=0.0``, ``GRPOConfig``'s default).

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import OptionError, lookup

#: where the reference log-probabilities come from (``StepConfig.reference``)
REFERENCES = ("auto", "copy", "adapter", "precomputed", "none")


@dataclass(frozen=True)
class Objective:
    name: str
    summary: str
    #: sequences a micro-batch holds per ``batch`` (DPO: chosen + rejected)
    rows_per_batch: int
    #: the loss reads log-probabilities of the labels (``None``: the causal-LM loss)
    logps: bool
    #: the references it accepts; the first is what ``auto`` means without LoRA, the
    #: second with it (an adapter that can be disabled)
    references: tuple[str, ...]
    #: logits only over the completion (``logits_to_keep``) and rollouts generated
    #: before the step
    rollouts: bool = False
    #: ``auto``: (without LoRA, with LoRA)
    auto: tuple[str, str] = ("none", "none")


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective(
            "sft",
            "supervised fine-tuning: the causal-LM cross-entropy over batch x seq",
            1,
            False,
            ("none",),
        ),
        Objective(
            "dpo",
            "DPO (TRL's DPOTrainer): --batch counts preference pairs; the policy's "
            "forward and backward run over the 2 x batch chosen and rejected "
            "sequences concatenated, the reference's forward over the same without a "
            "graph",
            2,
            True,
            ("copy", "adapter", "precomputed"),
            auto=("copy", "adapter"),
        ),
        Objective(
            "grpo",
            "GRPO (TRL's GRPOTrainer): --batch counts completions "
            "(per_device_train_batch_size), each --seq prompt tokens plus "
            "--max-completion-length generated ones; logits only over the "
            "completion; the rollouts are generated with a KV cache before the step",
            1,
            True,
            ("none", "copy", "adapter"),
            rollouts=True,
            auto=("none", "none"),
        ),
    )
}


def objective(name: str) -> Objective:
    """The entry for ``name``; an unknown name raises ``OptionError("objective")``."""
    return lookup(OBJECTIVES, "objective", name)


def resolve_reference(step) -> str:
    """The reference the step runs (``step.reference`` with ``auto`` resolved): TRL
    disables the adapter when the policy is a peft model, otherwise loads a copy;
    GRPO loads none at its default ``beta=0.0``."""
    entry = objective(step.objective)
    ref = step.reference
    if ref == "auto":
        return entry.auto[1 if step.uses_lora else 0]
    return ref


def check(step) -> None:
    """Validate the objective's options of ``step`` (a ``StepConfig``)."""
    entry = objective(step.objective)
    if step.reference not in REFERENCES:
        raise OptionError(
            "reference",
            f"reference must be one of {', '.join(REFERENCES)}, got {step.reference!r}",
        )
    ref = resolve_reference(step)
    if ref not in entry.references:
        raise OptionError(
            "reference",
            f"reference {ref!r} does not apply to objective {entry.name!r}; allowed: "
            f"auto, {', '.join(entry.references)}",
        )
    if ref == "adapter" and not step.uses_lora:
        raise OptionError(
            "reference",
            "reference 'adapter' disables a LoRA adapter: it needs method lora or "
            "qlora (full fine-tuning has no adapter to disable; use copy)",
        )
    if entry.name != "sft" and step.zero != 0:
        raise OptionError(
            "zero",
            f"objective {entry.name!r} is modelled on one device without ZeRO "
            "(zero 0): the reference model's and the rollouts' sharding are not "
            "replayed",
        )
    if entry.rollouts:
        rows = step.batch * step.grad_accum * step.gpus
        if rows % step.group_size:
            raise OptionError(
                "group_size",
                f"group_size {step.group_size} must divide the completions of a "
                f"generation batch (batch x grad_accum x gpus = {rows}), as "
                "GRPOConfig requires",
            )


def sequences(step) -> tuple[int, int]:
    """(rows, tokens) of one micro-batch's forward: DPO 2 x batch sequences of
    ``seq`` tokens; GRPO ``batch`` sequences of ``seq`` prompt +
    ``max_completion_length`` tokens."""
    entry = objective(step.objective)
    rows = step.batch * entry.rows_per_batch
    if entry.rollouts:
        return rows, step.seq + step.max_completion_length
    return rows, step.seq


def record_names(step) -> tuple[str, ...]:
    """The objective's options a result reports (``.options``; none for supervised
    fine-tuning, so the records of every earlier estimate stay as they were)."""
    if step.objective == "sft":
        return ()
    names = ("objective", "reference")
    if objective(step.objective).rollouts:
        names += ("group_size", "max_completion_length")
    return names
