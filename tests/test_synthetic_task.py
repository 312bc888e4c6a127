"""trainmem.demos.synthetic_task: deterministic batches that follow the rules; training
lowers the loss."""

import pytest
import torch

from trainmem.measuring.models import build_model
from trainmem.demos.synthetic_task import (
    N_NUMBERS,
    continue_sequence,
    evaluate,
    finetune_rules,
    make_batch,
    pretrain_rules,
    rule_token,
    task_config,
    train,
)


def test_batches_follow_the_rules_and_are_seeded():
    ids, labels = make_batch(16, {0: 1, 3: 5}, seed=3)
    assert ids.shape == labels.shape == (16, 12)
    again, _ = make_batch(16, {0: 1, 3: 5}, seed=3)
    assert torch.equal(ids, again)
    for row in ids.tolist():
        step = {rule_token(0): 1, rule_token(3): 5}[row[0]]
        assert all(
            (b - a) % N_NUMBERS == step % N_NUMBERS for a, b in zip(row[1:], row[2:])
        )
    assert (labels[:, :2] == -100).all() and torch.equal(labels[:, 2:], ids[:, 2:])
    with pytest.raises(ValueError, match="seq_len"):
        make_batch(4, {0: 1}, seed=0, seq_len=2)


def test_training_lowers_loss_deterministically():
    torch.manual_seed(0)
    runs = []
    for _ in range(2):
        model = build_model(task_config(), seed=0)
        before = evaluate(model, pretrain_rules(), batch=64)
        res = train(model, pretrain_rules(), steps=30, lr=3e-3, batch=16)
        runs.append(res.losses)
    assert runs[0] == runs[1]
    assert evaluate(model, pretrain_rules(), batch=64) < 0.7 * before
    assert res.trainable == sum(p.numel() for p in model.parameters())
    out = continue_sequence(model, 0, 5, n=3)
    assert len(out) == 4 and out[0] == 5
    assert finetune_rules() == {0: -1}
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        train(model, pretrain_rules(), steps=1, lr=1e-3)


def test_sequences_and_start_splits():
    from trainmem.demos.synthetic_task import FINETUNE_STEP, sequences, split_starts

    ids, labels = sequences([0, 5], seq_len=5)
    r0 = rule_token(0)
    assert ids.tolist() == [[r0, 0, 23, 22, 21], [r0, 5, 4, 3, 2]]
    assert (labels[:, :2] == -100).all() and torch.equal(labels[:, 2:], ids[:, 2:])
    # the same rows make_batch would draw for these starts under the new rule
    batch, _ = make_batch(64, finetune_rules(), seed=1)
    for row in batch.tolist():
        assert sequences([row[1]])[0][0].tolist() == row
    assert FINETUNE_STEP == -1
    train_s, held_s = split_starts(4, n_heldout=12, seed=0)
    more_s, held_again = split_starts(12, n_heldout=12, seed=0)
    assert len(train_s) == 4 and len(held_s) == 12 and not set(train_s) & set(held_s)
    assert held_again == held_s and more_s[:4] == train_s  # nested training sets
    assert sorted(more_s + held_s) == list(range(N_NUMBERS))
    assert split_starts(4, seed=1) != (train_s, held_s)
    with pytest.raises(ValueError, match="starts"):
        sequences([N_NUMBERS])
    with pytest.raises(ValueError, match="n_train"):
        split_starts(13, n_heldout=12)


def test_train_curve_logs_losses_deterministically():
    from trainmem.demos.synthetic_task import (
        Curve,
        sequences,
        split_starts,
        train_curve,
    )

    train_s, held_s = split_starts(4, seed=0)
    data = sequences(train_s), sequences(held_s)
    curves = []
    for _ in range(2):
        model = build_model(task_config(), seed=0)
        curves.append(
            train_curve(
                model,
                *data,
                steps=25,
                optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                eval_every=10,
            )
        )
    c = curves[0]
    assert c == curves[1]
    assert c.steps == [10, 20, 25]  # every 10 steps and after the last one
    assert c.train[-1] < c.train[0]
    assert c.best == min(c.heldout) and c.heldout[c.best_index] == c.best
    assert c.best_step == c.steps[c.best_index] and c.final == c.heldout[-1]
    m = Curve.mean([c, Curve(c.steps, [0.0] * 3, [0.0] * 3)])
    assert m.train == [x / 2 for x in c.train] and m.steps == c.steps
    with pytest.raises(ValueError, match="same steps"):
        Curve.mean([c, Curve([1], [0.0], [0.0])])
    with pytest.raises(ValueError, match="steps"):
        train_curve(model, *data, steps=0, optimizer=torch.optim.AdamW)
