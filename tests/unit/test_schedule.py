import math

import pytest
import torch

from unmask.optim.schedule import build_scheduler, lr_factor, resolve_warmup


def test_resolve_warmup_count_ratio_and_precedence():
    assert resolve_warmup(10, 0.0, 100) == 10
    assert resolve_warmup(0.1, 0.0, 200) == 20  # float < 1 is a ratio
    assert resolve_warmup(0, 0.25, 200) == 50
    assert resolve_warmup(5, 0.25, 200) == 5  # warmup_steps wins, as in HF


def test_linear_and_cosine_shapes():
    total, warm = 100, 10
    assert lr_factor(0, "linear", total, warm) == pytest.approx(1 / 11)
    assert lr_factor(9, "linear", total, warm) == pytest.approx(10 / 11)
    assert lr_factor(10, "linear", total, warm) == pytest.approx(1.0)
    assert lr_factor(55, "linear", total, warm) == pytest.approx(0.5)
    assert lr_factor(100, "linear", total, warm) == pytest.approx(0.0)
    assert lr_factor(55, "cosine", total, warm) == pytest.approx(0.5)
    assert lr_factor(100, "cosine", total, warm, min_ratio=0.1) == pytest.approx(0.1)
    mid = 0.5 * (1 + math.cos(math.pi * 0.25))
    assert lr_factor(10 + 22.5, "cosine", total, warm) == pytest.approx(mid)
    assert lr_factor(50, "constant_with_warmup", total, warm) == 1.0
    assert lr_factor(50, "constant", total, 0) == 1.0


def test_unknown_schedule_rejected():
    with pytest.raises(ValueError, match="unknown lr_scheduler_type"):
        lr_factor(0, "exponential", 10, 0)


def test_scheduler_scales_every_group_and_round_trips():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.1}])
    sched = build_scheduler(opt, "linear", total_steps=10, warmup=0)
    for _ in range(5):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.05])
    opt2 = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.1}])
    sched2 = build_scheduler(opt2, "linear", total_steps=10, warmup=0)
    sched2.load_state_dict(sched.state_dict())
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx(
        [g["lr"] for g in opt.param_groups]
    )
