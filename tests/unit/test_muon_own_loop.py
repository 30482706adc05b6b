"""MuonAdamW in a user's own training loop (docs/muon.md): what torch optimizers take works
or is refused in one line saying what to pass; a toy classifier's output layer goes to
AdamW (Muon's authors keep the first and last layers off Muon); the routing table says
each parameter's optimizer and why; a step on parameters the model no longer trains with
(an optimizer made before fully_shard) is refused at the first step."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.errors import InputError
from unmask.optim import MuonAdamW


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def groups(opt: MuonAdamW) -> dict[str, str]:
    return {name: "muon" if g["use_muon"] else "adamw"
            for g in opt.param_groups for name in g["param_names"]}  # fmt: skip


def test_torch_style_parameters_are_refused_in_one_line_or_named_by_the_model():
    model = tiny_model()
    with pytest.raises(InputError, match=r"got bare tensors: pass the model, "
                       r"model.named_parameters\(\), or model=model"):  # fmt: skip
        MuonAdamW(model.parameters(), verbose=False)
    named = MuonAdamW(model.parameters(), model=model, verbose=False)
    assert groups(named) == groups(MuonAdamW(model, verbose=False))
    with pytest.raises(InputError, match="param groups: one MuonAdamW per group"):
        MuonAdamW([{"params": list(model.parameters())}], verbose=False)
    with pytest.raises(InputError, match="not one of model's"):
        MuonAdamW([nn.Parameter(torch.ones(2, 2))], model=model, verbose=False)


@pytest.mark.parametrize("make", [Classifier, lambda: nn.Sequential(
    nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))],
    ids=["classifier", "sequential"])  # fmt: skip
def test_a_classifiers_output_layer_goes_to_adamw(make):
    model = make()
    opt = MuonAdamW(model, verbose=False)
    route = groups(opt)
    last = [n for n, _ in model.named_parameters()][-2]  # the output layer's weight
    assert route[last] == "adamw" and opt.routing.reasons[last] == "output layer"
    hidden = [n for n, p in model.named_parameters() if p.ndim == 2 and n != last]
    assert hidden and all(route[n] == "muon" for n in hidden)
    table = opt.routing.table()
    assert f"{last}" in table and "output layer" in table and "hidden matrix" in table


def test_named_heads_go_to_adamw_without_a_model():
    params = [("encoder.weight", nn.Parameter(torch.ones(8, 8))),
              ("classifier.weight", nn.Parameter(torch.ones(3, 8))),
              ("score.weight", nn.Parameter(torch.ones(2, 8)))]  # fmt: skip
    route = groups(MuonAdamW(params, verbose=False))
    assert route == {"encoder.weight": "muon", "classifier.weight": "adamw",
                     "score.weight": "adamw"}  # fmt: skip
    # a transformer stack's last linear is a hidden layer: the native model keeps its MLPs
    native = groups(MuonAdamW(tiny_model(), verbose=False))
    assert native["model.layers.1.mlp.down_proj.weight"] == "muon"
    # so is the last linear inside an element of any list of blocks
    blocks = nn.Module()
    blocks.blocks = nn.ModuleList(nn.Module() for _ in range(3))
    for block in blocks.blocks:
        block.proj = nn.Linear(8, 8)
    assert groups(MuonAdamW(blocks, verbose=False))["blocks.2.proj.weight"] == "muon"


def test_a_step_without_any_gradient_is_refused():
    model = Classifier()
    opt = MuonAdamW(model, verbose=False)
    stale = Classifier()  # the parameters the "model" trains with are others
    stale(torch.ones(4, 16)).sum().backward()
    with pytest.raises(InputError, match="none of its parameters has a gradient"):
        opt.step()
    model(torch.ones(4, 16)).sum().backward()
    opt.step()  # with gradients: a step
