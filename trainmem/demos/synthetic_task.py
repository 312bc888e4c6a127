"""A tiny, deterministic fine-tuning task that shows its effect on a CPU in seconds.

The "language": a rule token followed by an arithmetic progression modulo
``N_NUMBERS``::

    [R_k, x0, x0 + s_k, x0 + 2 s_k, ...]   (mod N_NUMBERS)

Pre-training teaches rules ``PRETRAIN_STEPS`` (rule token ``k`` → step ``s_k``).
Fine-tuning changes what one rule token means (``FINETUNE_RULE`` → ``FINETUNE_STEP``), a
small, targeted change — the setting LoRA was designed for. Token ids: numbers ``0 …
N_NUMBERS-1``, rule tokens after them. Everything is seeded: the same call gives the
same batches and the same losses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

N_NUMBERS = 24
PRETRAIN_STEPS = (1, 2, 3, 5)  # rule k means "add PRETRAIN_STEPS[k]"
FINETUNE_RULE = 0  # fine-tuning re-defines rule 0 ...
FINETUNE_STEP = -1  # ... to count down instead of up
VOCAB_SIZE = 32  # numbers + rule tokens, rounded up
SEQ_LEN = 12


def rule_token(k: int) -> int:
    """Token id of rule ``k`` (0-based)."""
    return N_NUMBERS + k


def task_config(**overrides):
    """The course's tiny Llama (2 layers, 64 wide) with this task's vocabulary."""
    from ..measuring.models import tiny_llama_config

    kw = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    kw.update(overrides)
    return tiny_llama_config(**kw)


def make_batch(batch: int, rules: dict[int, int], seed: int, seq_len: int = SEQ_LEN):
    """``(input_ids, labels)``, both ``(batch, seq_len)`` int64.

    ``rules`` maps rule index → step. Rule and start are drawn uniformly (seeded). The
    label of the first number (``x0``, unpredictable) is ``-100`` so the loss only
    counts learnable tokens.
    """
    if batch < 1 or seq_len < 3:
        raise ValueError(
            f"batch must be ≥ 1 and seq_len ≥ 3, got batch={batch}, seq_len={seq_len}"
        )
    g = torch.Generator().manual_seed(seed)
    keys = torch.tensor(sorted(rules))
    steps = torch.tensor([rules[int(k)] for k in keys])
    pick = torch.randint(len(keys), (batch,), generator=g)
    x0 = torch.randint(N_NUMBERS, (batch,), generator=g)
    pos = torch.arange(seq_len - 1)
    nums = (x0[:, None] + steps[pick][:, None] * pos[None, :]) % N_NUMBERS
    ids = torch.cat([(N_NUMBERS + keys[pick])[:, None], nums], dim=1)
    labels = ids.clone()
    labels[
        :, :2
    ] = -100  # the rule token and x0 are not predictable from what precedes them
    return ids, labels


def pretrain_rules() -> dict[int, int]:
    return {k: s for k, s in enumerate(PRETRAIN_STEPS)}


def finetune_rules() -> dict[int, int]:
    """Only the re-defined rule: the fine-tuning data set."""
    return {FINETUNE_RULE: FINETUNE_STEP}


@dataclass
class TrainResult:
    """Losses per step (float), seconds per step (median, wall clock), trainable
    parameter count."""

    losses: list[float] = field(default_factory=list)
    step_seconds: float = 0.0
    trainable: int = 0

    @property
    def final_loss(self) -> float:
        """Mean of the last 10 losses (less noisy than the very last one)."""
        tail = self.losses[-10:]
        return sum(tail) / len(tail)


def train(
    model: nn.Module,
    rules: dict[int, int],
    steps: int,
    lr: float,
    batch: int = 32,
    seed: int = 0,
    weight_decay: float = 0.0,
) -> TrainResult:
    """AdamW on the parameters with ``requires_grad``; the batch for step ``i`` uses
    seed ``seed+i``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (all requires_grad=False)")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    model.train()
    res = TrainResult(trainable=sum(p.numel() for p in params))
    times = []
    for i in range(steps):
        ids, labels = make_batch(batch, rules, seed + i)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        res.losses.append(loss.detach().item())
    times.sort()
    res.step_seconds = times[len(times) // 2]
    model.eval()
    return res


@torch.no_grad()
def evaluate(
    model: nn.Module, rules: dict[int, int], batch: int = 256, seed: int = 10_000
) -> float:
    """Mean loss on a fixed held-out batch."""
    model.eval()
    ids, labels = make_batch(batch, rules, seed)
    with torch.no_grad():  # no graph to build: the value is the same
        return float(model(input_ids=ids, labels=labels).loss)


@torch.no_grad()
def continue_sequence(model: nn.Module, rule: int, start: int, n: int = 8) -> list[int]:
    """Greedy continuation of ``[R_rule, start]`` for ``n`` tokens (numbers as ints)."""
    model.eval()
    ids = torch.tensor([[rule_token(rule), start]])
    for _ in range(n):
        nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, 1:].tolist()


def pretrained_model(steps: int = 300, lr: float = 3e-3, seed: int = 0):
    """A tiny Llama pre-trained on :func:`pretrain_rules` (a few seconds on a CPU)."""
    from ..measuring.models import build_model

    model = build_model(task_config(), seed=seed)
    train(model, pretrain_rules(), steps=steps, lr=lr, seed=seed)
    return model


# A fixed, small fine-tuning set with a held-out split (over-fitting, optimizer choice)
# ------------------------------------------------------------------------------------
# Under one rule a sequence is fixed by its start, so the new rule has exactly
# ``N_NUMBERS`` distinct sequences. Splitting the *starts* gives a training set and a
# held-out set that share no sequence: the held-out loss measures what the model learnt
# about the rule, not what it memorised.


def sequences(
    starts, rule: int = FINETUNE_RULE, step: int = FINETUNE_STEP, seq_len: int = SEQ_LEN
):
    """``(input_ids, labels)``, both ``(len(starts), seq_len)`` int64, a row a start.

    Row ``i`` is ``[R_rule, x0, x0 + step, …]`` (mod ``N_NUMBERS``) with
    ``x0 = starts[i]``; labels as in :func:`make_batch` (rule token and ``x0`` are
    ``-100``).
    """
    starts = [int(s) for s in starts]
    if not starts or any(not 0 <= s < N_NUMBERS for s in starts) or seq_len < 3:
        raise ValueError(
            f"starts must be a non-empty list of numbers in 0..{N_NUMBERS - 1} and "
            f"seq_len ≥ 3, got starts={starts!r}, seq_len={seq_len}"
        )
    x0 = torch.tensor(starts)
    nums = (x0[:, None] + step * torch.arange(seq_len - 1)[None, :]) % N_NUMBERS
    ids = torch.cat([torch.full((len(starts), 1), rule_token(rule)), nums], dim=1)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


def split_starts(
    n_train: int, n_heldout: int = 12, seed: int = 0
) -> tuple[list[int], list[int]]:
    """``(train_starts, heldout_starts)``: disjoint starts from a seeded permutation.

    The first ``n_heldout`` values of the permutation are held out; the training
    starts are the next ``n_train``, so a larger ``n_train`` (same ``seed``) extends
    the smaller set and the held-out set stays the same.
    """
    if n_heldout < 1 or n_train < 1 or n_train + n_heldout > N_NUMBERS:
        raise ValueError(
            f"n_train and n_heldout must be ≥ 1 with n_train + n_heldout ≤ "
            f"{N_NUMBERS}, got n_train={n_train}, n_heldout={n_heldout}"
        )
    perm = torch.randperm(N_NUMBERS, generator=torch.Generator().manual_seed(seed))
    perm = perm.tolist()
    return perm[n_heldout : n_heldout + n_train], perm[:n_heldout]


@dataclass
class Curve:
    """Losses logged every few optimizer steps (eval mode, whole data set each time).

    ``steps[i]`` optimizer steps had been taken when ``train[i]`` (loss on the training
    set) and ``heldout[i]`` (loss on the held-out set) were measured.
    """

    steps: list[int] = field(default_factory=list)
    train: list[float] = field(default_factory=list)
    heldout: list[float] = field(default_factory=list)

    @property
    def best_index(self) -> int:
        """Index of the lowest held-out loss (the first one on ties)."""
        return min(range(len(self.heldout)), key=self.heldout.__getitem__)

    @property
    def best_step(self) -> int:
        """The step an early stop on the held-out loss would keep."""
        return self.steps[self.best_index]

    @property
    def best(self) -> float:
        """The lowest held-out loss."""
        return self.heldout[self.best_index]

    @property
    def final(self) -> float:
        """The held-out loss after the last step."""
        return self.heldout[-1]

    @staticmethod
    def mean(curves: list[Curve]) -> Curve:
        """Point-wise mean of curves logged at the same steps (e.g. over splits)."""
        if not curves or any(c.steps != curves[0].steps for c in curves):
            raise ValueError("curves must be a non-empty list logged at the same steps")
        avg = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return Curve(
            steps=list(curves[0].steps),
            train=[avg(v) for v in zip(*(c.train for c in curves))],
            heldout=[avg(v) for v in zip(*(c.heldout for c in curves))],
        )


@torch.no_grad()
def data_loss(model: nn.Module, data) -> float:
    """Mean loss of ``model`` (eval mode) on ``data = (input_ids, labels)``."""
    model.eval()
    with torch.no_grad():  # no graph to build: the value is the same
        return float(model(input_ids=data[0], labels=data[1]).loss)


def train_curve(
    model: nn.Module,
    train_data,
    heldout_data,
    steps: int,
    optimizer,
    eval_every: int = 10,
    seed: int = 0,
) -> Curve:
    """Full-batch training on ``train_data``, logging train and held-out loss.

    ``optimizer`` builds the optimizer from the list of trainable parameters, e.g.
    ``lambda params: torch.optim.AdamW(params, lr=3e-3)``. ``seed`` seeds torch's global
    generator first, so dropout draws the same masks on every call. Every step uses the
    whole training set (it is small), so the run is deterministic.
    """
    if steps < 1 or eval_every < 1:
        raise ValueError(
            f"steps and eval_every must be ≥ 1, got steps={steps}, "
            f"eval_every={eval_every}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (all requires_grad=False)")
    torch.manual_seed(seed)
    opt = optimizer(params)
    curve = Curve()
    # train mode is set again only after an evaluation switched it off: setting it
    # walks every module, 15 % of a step of the tiny model
    model.train()
    for i in range(1, steps + 1):
        model(input_ids=train_data[0], labels=train_data[1]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % eval_every == 0 or i == steps:
            curve.steps.append(i)
            curve.train.append(data_loss(model, train_data))
            curve.heldout.append(data_loss(model, heldout_data))
            model.train()
    model.eval()
    return curve
