"""trainmem.synthetic_task: deterministic batches that follow the rules; training lowers
the loss."""

import pytest
import torch

from trainmem.models import build_model
from trainmem.synthetic_task import (
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
