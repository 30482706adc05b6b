"""Fast-dLLM v2's training form: complementary masks, block starts never masked and
scored from the clean half, the shift inside blocks, blocks from position 0."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from unmask.diffusion import DiffusionConfig, build_objective
from unmask.sampling.generation_file import fixed_by_training

pytestmark = pytest.mark.usefixtures("one_thread")


class Recording:
    """The model, remembering the call the objective made."""

    accepts_target_weights = True

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, ids, **kwargs):
        self.calls.append((ids, kwargs))
        return self.model(ids, **kwargs)


def test_v2_views_targets_and_loss_by_hand():
    model = tiny_model(0).float()
    cfg = DiffusionConfig(objective="fastdllm_v2", block_size=4)
    objective = build_objective(cfg, mask_id=127)
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, :5] = False  # a prompt of 5: the first answer block (4..7) holds its tail
    recording = Recording(model)
    loss_sum, count = objective(recording, {"input_ids": ids, "maskable": maskable},
                                torch.Generator().manual_seed(0))  # fmt: skip
    inputs, kw = recording.calls[0]
    noisy, clean = inputs[:, :12], inputs[:, 12:]
    assert torch.equal(clean, torch.cat([ids, ids]))
    masked = noisy == 127
    first, second = masked[:2], masked[2:]
    # complementary: every maskable token that is not a block start is masked exactly once
    expected = maskable.clone()
    expected[:, 8] = False  # block start (position 8); 4 is a prompt token
    assert torch.equal(first | second, expected) and not bool((first & second).any())
    # targets: x_t column i - 1 for masked i; x0 column 7 for the block start 8
    targets, coef = kw["targets"], kw["target_weights"]
    for row in range(4):
        for i in range(1, 12):
            if masked[row, i]:
                assert targets[row, i - 1] == ids[row % 2, i]
        assert targets[row, 12 + 7] == ids[row % 2, 8] and coef[row, 12 + 7] == 1.0
        assert (targets[row, 12:] != -100).sum() == 1  # only the block start's
    with torch.no_grad():
        logits = model(inputs, position_ids=kw["position_ids"],
                       attention_mask=kw["attention_mask"])  # fmt: skip
    by_hand = sum(
        coef[r, c].item() * F.cross_entropy(logits[r, c], targets[r, c]).item()
        for r, c in (targets != -100).nonzero().tolist()
    )
    assert loss_sum.item() == pytest.approx(by_hand, rel=1e-5)
    assert count.item() == 2 * 7 * 2
    # the x_t half of block 2 (8..11) sees the clean blocks 0, 1 and itself, not block 2's x0
    attn = kw["attention_mask"][0, 0]
    assert bool(attn[9, 12 + 7]) and not bool(attn[9, 12 + 8]) and bool(attn[9, 11])
    assert not bool(attn[5, 8])  # block 1 does not see block 2


def test_v2_model_samples_as_v2():
    fixed = fixed_by_training(DiffusionConfig(objective="fastdllm_v2", block_size=8))
    assert fixed == {"block_causal": True, "shift_logits": True, "blocks_from_start": True,
                     "block_length": 8, "threshold": 0.9}  # fmt: skip
