"""MoE training on one process: the objective's loss with the aux loss, per-step load metrics,
the expert-bias rule, Muon on expert stacks, and the refusals of bad MoE layouts."""

import json
import re

import pytest
import torch
from conftest import read_metrics

from unmask.cli import main
from unmask.config import load_config
from unmask.models import from_pretrained
from unmask.models.moe import moe_blocks
from unmask.optim import MuonAdamW
from unmask.train.trainer import Trainer

MOE = {"model_type": "qwen3_moe_dllm", "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16, "router_aux_loss_coef": 0.01,
       "router_z_loss_coef": 0.001}  # fmt: skip
SIGMOID = {"model_type": "llada2_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "n_group": 2, "topk_group": 1,
           "num_shared_experts": 1, "first_k_dense_replace": 1,
           "expert_bias_update_rate": 0.01}  # fmt: skip


def test_moe_trains_with_muon_logs_load_and_exports(tiny_config, tmp_path, capsys):
    path = tiny_config({"model": MOE, "optim": {"name": "muon"}})
    assert main(["train", str(path)]) == 0
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"]
    for record in steps:
        assert record["moe_aux_loss"] > 0.0
        assert record["moe_load_max_over_mean"] >= 1.0
        assert record["moe_load_max_over_mean/layer_1"] >= 1.0
        assert record["moe_tokens_per_expert_cv"] >= 0.0
    assert "mfu" in capsys.readouterr().out  # MFU counts active parameters (test_moe.py)
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "plots" / "moe_load.png").is_file()
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert len(moe_blocks(from_pretrained(final))) == 2


def test_the_moe_recipe_matches_the_dense_quickstart_and_trains(tmp_path):
    """recipes/moe_quickstart.yaml: the quickstart's data, objective, optimizer and schedule
    with MoE MLPs of the same active width (384 features per token); a few steps train."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "moe_quickstart.yaml"
    moe, dense = load_config(recipe), load_config()  # load_config(): the packaged quickstart
    for section in ("data", "diffusion", "optim"):
        assert getattr(moe, section) == getattr(dense, section), section
    assert moe.train.max_steps == dense.train.max_steps
    m = moe.model
    active = (m.num_experts_per_tok + m.num_shared_experts) * m.moe_intermediate_size
    assert active == dense.model.intermediate_size and m.num_experts == 8
    out = tmp_path / "run"
    assert main(["train", str(recipe), f"train.output_dir={out}", "train.max_steps=3",
                 "train.logging_steps=1", "train.eval_steps=0", "train.save_steps=0",
                 "data.synthetic_train_size=512", "eval.generate_accuracy=false"]) == 0  # fmt: skip
    steps = [r for r in read_metrics(out) if "loss" in r]
    assert len(steps) == 3 and all(r["moe_aux_loss"] == 0.0 for r in steps)


def test_router_on_adamw_expert_stacks_on_muon(tiny_config):
    trainer = Trainer(load_config(tiny_config({"model": MOE, "optim": {"name": "muon"}})))
    routing = trainer.optimizer.routing
    muon = {name for name, _ in routing.muon}
    adamw = {name for name, _ in routing.adamw_decay}
    assert "model.layers.0.mlp.experts.gate_proj" in muon
    assert "model.layers.0.mlp.gate.weight" in adamw


def test_muon_orthogonalizes_each_expert_on_its_own():
    torch.manual_seed(0)
    stacked = torch.nn.Module()
    stacked.w = torch.nn.Parameter(torch.randn(3, 8, 12))
    apart = torch.nn.Module()
    apart.ws = torch.nn.ParameterList([torch.nn.Parameter(stacked.w[e].detach().clone())
                                       for e in range(3)])  # fmt: skip
    grad = torch.randn(3, 8, 12)
    stacked.w.grad = grad.clone()
    for e, p in enumerate(apart.ws):
        p.grad = grad[e].clone()
    for module in (stacked, apart):
        MuonAdamW(module, lr=0.1, weight_decay=0.0, ns_dtype=torch.float32).step()
    for e in range(3):
        torch.testing.assert_close(stacked.w[e], apart.ws[e], rtol=1e-5, atol=1e-6)


def _noised(trainer, batch):
    """t and masks drawn once, so every micro-batch split sees the same noise."""
    from unmask.diffusion.noise import mask_tokens, sample_t

    gen = torch.Generator().manual_seed(0)
    t = sample_t(batch["input_ids"].shape[0], "uniform", 1e-3, gen, torch.device("cpu"))
    noisy, masked = mask_tokens(
        batch["input_ids"], t, batch["maskable"], trainer.tokenizer.mask_token_id, gen
    )
    return {**batch, "t": t, "noisy_input_ids": noisy, "masked": masked}


def test_expert_bias_moves_once_per_step_from_the_summed_load(tiny_config):
    cfg = load_config(tiny_config({"model": SIGMOID, "optim": {"max_grad_norm": 0.0}}))
    runs = []
    for micro in (1, 4):
        trainer = Trainer(
            cfg.model_copy(update={"train": cfg.train.model_copy(
                update={"overwrite_output_dir": True, "gradient_accumulation_steps": micro})})
        )  # fmt: skip
        batch = _noised(trainer, {k: torch.stack([trainer.train_rows[i][k] for i in range(8)])
                                  for k in trainer.train_rows[0]})  # fmt: skip
        micro_batches = [{k: v[i : i + 8 // micro] for k, v in batch.items()}
                         for i in range(0, 8, 8 // micro)]  # fmt: skip
        block = moe_blocks(trainer.model)[0]
        loads = []
        original = block.update_expert_bias
        block.update_expert_bias = lambda load, seen=loads, update=original: (
            seen.append(load.clone()),
            update(load),
        )
        trainer.train_step(micro_batches)
        runs.append((loads[0], block.gate.expert_bias.clone()))
    (load_a, bias_a), (load_b, bias_b) = runs
    assert torch.equal(load_a, load_b)  # summed over micro-batches: the same load
    want = 0.01 * torch.sign(load_a.mean() - load_a)
    assert torch.equal(bias_a, want) and torch.equal(bias_b, want)
    assert bias_a.abs().sum() > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"train": {"expert_parallel": 2}},
         r"parallel.expert_parallel=2 does not divide the data-parallel x context ranks \(1\)"),
        ({"train": {"expert_parallel": 3}},
         r"model.num_experts=4 is not divisible by parallel.expert_parallel=3"),
        ({"model": {"num_experts_per_tok": 5}},
         r"num_experts_per_tok \(5\) is above num_experts \(4\)"),
        ({"model": {"n_group": 3}}, r"n_group \(3\) must divide num_experts \(4\)"),
        ({"model": {"n_group": 2, "topk_group": 3}}, r"topk_group \(3\) is above n_group \(2\)"),
    ],
)  # fmt: skip
def test_bad_moe_layouts_are_one_line_exit_2(tiny_config, tmp_path, capsys, extra, message):
    tree = {"model": {**MOE, **extra.get("model", {})}, "train": extra.get("train", {})}
    assert main(["train", str(tiny_config(tree))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask: error:") and "Traceback" not in err
    assert err.count("\n") == 1
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_expert_parallel_on_a_wrapped_model_is_refused(tiny_config, capsys):
    path = tiny_config({"model": {"model_type": "bert"}, "train": {"expert_parallel": 2}})
    assert main(["train", str(path)]) == 2
    assert "needs a native MoE model" in capsys.readouterr().err
