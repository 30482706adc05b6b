"""Step distillation: the certainty-forcing and trajectory losses against hand values on a
teacher whose answers and decoding order the test fixes."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from unmask.posttrain.distill import (
    DistillConfig,
    DistillObjective,
    commit_steps,
    entropy,
)

pytestmark = pytest.mark.usefixtures("one_thread")
MASK = 127


def test_commit_steps_from_the_canvases():
    history = [torch.tensor([[5, MASK, 7, MASK]]), torch.tensor([[5, 9, 7, MASK]]),
               torch.tensor([[5, 9, 7, 4]])]  # fmt: skip
    assert commit_steps(history, MASK, start=1).tolist() == [[1, 0, 2]]


def _teacher(answers, order):
    calls = []

    def sample_answers(teacher, prompts, gen):
        calls.append((prompts.clone(), gen))
        return answers[: prompts.shape[0], :gen], order[: prompts.shape[0], :gen]

    return sample_answers, calls


def _batch():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    maskable = torch.tensor([[False, False, True, True, True, True]] * 2)
    return {"input_ids": ids, "maskable": maskable}


def test_certainty_forcing_loss_by_hand():
    model = tiny_model(0).float()
    answers = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43]])
    order = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    sampler, calls = _teacher(answers, order)
    objective = DistillObjective(DistillConfig(teacher="t", entropy_weight=0.5), None,
                                 sampler, MASK)  # fmt: skip
    batch = _batch()
    loss, count = objective(model, batch, torch.Generator().manual_seed(0))
    assert len(calls) == 1 and calls[0][1] == 4  # one prompt length: one teacher call
    assert torch.equal(calls[0][0], batch["input_ids"][:, :2])
    g = torch.Generator().manual_seed(0)
    t = torch.rand(2, generator=g) * 0.999 + 1e-3
    u = torch.rand(2, 6, generator=g)
    target = batch["input_ids"].clone()
    target[:, 2:] = answers
    masked = batch["maskable"] & (u < t[:, None])
    assert masked.any()
    with torch.no_grad():
        logits = model(target.masked_fill(masked, MASK))
    expected = 0.0
    for r, c in masked.nonzero().tolist():
        expected += F.cross_entropy(logits[r, c], target[r, c]).item() / t[r].item()
        if logits[r, c].argmax() == target[r, c]:
            expected += 0.5 * entropy(logits[r, c]).item()
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert count.item() == 8


def test_trajectory_masks_what_the_teacher_had_not_committed():
    model = tiny_model(1).float()
    answers = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43]])
    order = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    sampler, _ = _teacher(answers, order)
    objective = DistillObjective(DistillConfig(teacher="t", method="trajectory"), None,
                                 sampler, MASK)  # fmt: skip
    batch = _batch()
    loss, _ = objective(model, batch, torch.Generator().manual_seed(3))
    k = (torch.rand(2, generator=torch.Generator().manual_seed(3)) * 4).long()
    steps = torch.cat([torch.full((2, 2), -1), order], 1)
    masked = batch["maskable"] & (steps >= k[:, None])
    target = batch["input_ids"].clone()
    target[:, 2:] = answers
    with torch.no_grad():
        logits = model(target.masked_fill(masked, MASK))
    expected = sum(F.cross_entropy(logits[r, c], target[r, c]).item()
                   for r, c in masked.nonzero().tolist())  # fmt: skip
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # row 1's teacher decoded right to left: a step k masks its left part
    assert masked[1, 2] or k[1] == 0


def test_a_shifted_student_reads_token_i_at_output_i_minus_1():
    model = tiny_model(2).float()
    answers = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43]])
    order = torch.zeros(2, 4, dtype=torch.long)
    sampler, _ = _teacher(answers, order)
    objective = DistillObjective(DistillConfig(teacher="t", entropy_weight=0.0), None,
                                 sampler, MASK, shift=True)  # fmt: skip
    batch = _batch()
    loss, _ = objective(model, batch, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    t = torch.rand(2, generator=g) * 0.999 + 1e-3
    u = torch.rand(2, 6, generator=g)
    target = batch["input_ids"].clone()
    target[:, 2:] = answers
    masked = batch["maskable"] & (u < t[:, None])
    with torch.no_grad():
        logits = model(target.masked_fill(masked, MASK))
    expected = sum(F.cross_entropy(logits[r, c - 1], target[r, c]).item() / t[r].item()
                   for r, c in masked.nonzero().tolist())  # fmt: skip
    assert loss.item() == pytest.approx(expected, rel=1e-5)
