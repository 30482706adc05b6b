"""`unmask plan` for DiffusionGemma (the `uniform` objective's step: the encoder over the
row, a decoder pass without gradients over the canvas, the decoder with them, the LM head on
the canvas) and for LLaDA2.1, whose architecture is LLaDA2.0's.

- a tiny DiffusionGemma's plan against a real CPU step, measured as
  tests/integration/test_plan_measured.py measures one (its worker's `measure`: the real
  Trainer, the second step): parameter, gradient and optimizer-state bytes and every local
  shape exactly, the bytes autograd holds saved exactly, the peak (MemTracker) within 15%;
- the 26B-A4B on 8 H100s with ep 8 (configs/models/diffusion_gemma_26b_a4b.yaml): its
  parameter, gradient and optimizer bytes per rank from the config's parameter counts, its
  FLOPs the family's `call_flops` and its step time those at the MFU; it fits;
- the LLaDA2.1-mini and -flash configs plan at the world sizes of their headers."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import write_run_config

from unmask.cli import main
from unmask.config import load_config
from unmask.diffusion.uniform import UniformObjective
from unmask.errors import InputError
from unmask.models.build import build_model, shape_of
from unmask.plan.devices import resolve_device
from unmask.plan.planner import DEFAULT_MFU, make_run_plan
from unmask.plan.report import render
from unmask.train.mfu import flop_model

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "configs" / "models"
SLIDING, FULL = "sliding_attention", "full_attention"
#: a sliding and a full layer of their own head sizes, 4 experts beside the dense MLP
GEMMA = {
    "model": {"model_type": "diffusion_gemma", "head_dim": 16, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "diffusion_gemma": {"sliding_window": 8, "canvas_length": 4,
                                  "global_head_dim": 32, "num_global_key_value_heads": 1,
                                  "layer_types": [SLIDING, FULL]}},
    "diffusion": {"objective": "uniform"},
    "train": {"eval_steps": 0, "save_steps": 0, "logging_steps": 1, "max_steps": 4,
              "per_device_train_batch_size": 4, "log_mfu": False},
}  # fmt: skip
LAYOUTS = {
    "adamw_float32": {"optim": {"name": "adamw"}},
    "muon_bf16": {"optim": {"name": "muon"}, "train": {"bf16": True}},
    "no_self_conditioning": {"diffusion": {"self_conditioning_prob": 0.0}},
    "two_rows_adamw_bf16": {
        "optim": {"name": "adamw"},
        "train": {"bf16": True, "per_device_train_batch_size": 2},
    },
}


def plan_worker():
    sys.path.insert(0, str(REPO / "tests" / "integration" / "dist_workers"))
    import plan_worker as worker

    return worker


@pytest.fixture
def counted_objective(monkeypatch):
    """The worker reads the step's `num_masked` (the masked objectives' head rows): the
    uniform objective's head runs on every canvas position; its scored count stands in."""
    real = UniformObjective.__call__

    def call(self, model, batch, generator=None):
        out = real(self, model, batch, generator)
        self.last_stats["num_masked"] = self.last_stats["num_scored"]
        return out

    monkeypatch.setattr(UniformObjective, "__call__", call)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tiny_plan_equals_a_measured_cpu_step(name, tmp_path, counted_objective):
    path = write_run_config(tmp_path, name, GEMMA, LAYOUTS[name])
    plan_worker().measure(str(path), tmp_path)
    got = json.loads((tmp_path / f"{name}.rank0.json").read_text())
    cfg = load_config(path)
    plan = make_run_plan(cfg, 1, resolve_device("cpu"))
    memory = plan.ranks[0].memory
    assert memory.parameters == got["parameters"]
    assert memory.gradients == got["gradients"]
    assert memory.optimizer == got["optimizer_state"]
    for row in plan.ranks[0].shards:
        assert row["local"] == got["local_shapes"][row["name"]], row["name"]
    assert memory.activations == got["saved_activations"]
    gap = memory.peak / got["peak"] - 1
    print(f"{name}: activations {memory.activations:,} B, peak {memory.peak:,} B "
          f"(measured {got['peak']:,} B, {gap:+.1%})")  # fmt: skip
    assert abs(gap) <= 0.15, gap


def test_the_26b_a4b_on_8_h100s_with_ep_8_fits(capsys):
    path = MODELS / "diffusion_gemma_26b_a4b.yaml"
    cfg = load_config(path, ["parallel.expert_parallel=8"])
    plan = make_run_plan(cfg, 8, resolve_device("h100"))
    h, inner, experts, vocab, moe, layers = 2816, 2112, 128, 262_144, 704, 30
    sliding = 2 * h * 16 * 256 + 2 * h * 8 * 256  # q, o; k, v
    full = 2 * h * 16 * 512 + h * 2 * 512  # q, o; k (V is the normed K)
    router = experts * h + h + experts  # proj, scale, per-expert scale
    stacks = experts * 3 * moe * h
    layer = 3 * h * inner + router + stacks + 7 * h  # MLP, router, experts, layer norms
    total = (vocab * h + 25 * (sliding + layer + 2 * 256) + 5 * (full + layer + 2 * 512)
             + h + 3 * h * inner + h)  # final norm; self-conditioning's MLP and pre-norm  # fmt: skip
    assert plan.parameters == total and round(total / 1e9, 2) == 25.25
    assert plan.layout == {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}
    frozen = layers * router  # diffusion.freeze_router
    for rank in plan.ranks:  # every dim 0 divides by 8: FSDP2's and ep's shards are exact
        m = rank.memory
        assert m.parameters == 4 * total // 8  # float32 masters
        assert m.gradients == 4 * (total - frozen) // 8
        # AdamW: exp_avg and exp_avg_sq like the parameter, a 0-d float32 step each
        assert m.optimizer == 2 * m.gradients + 4 * trainable_tensors(cfg)
        local = layers * experts // 8 * 3 * moe * h  # 16 whole experts of every layer
        assert m.experts == local * (4 + 4 + 8) + 2 * layers * 4  # 2 stacks a layer
        assert m.peak <= plan.memory_limit
    assert plan.fits and plan.memory_limit == 0.9 * 80e9
    arch = cfg.model
    with torch.device("meta"):  # the objective's call on the step's 8 rows of 512 tokens
        args, kwargs = shape_of(arch).training_call(arch, 8, 512, True)
        flops = shape_of(arch).call_flops(flop_model(build_model(arch)), arch, args, kwargs)
    assert plan.flops_per_step == pytest.approx(float(flops), rel=1e-12)
    assert plan.compute_s == pytest.approx(plan.flops_per_step / 8 / (989e12 * DEFAULT_MFU))
    assert plan.tokens_per_step == 8 * 512
    kinds = {(c.dim, c.kind): c for c in plan.collectives}
    a2a = kinds[("ep", "all-to-all")]
    # per MoE layer pass: the rows out and back (tokens x k x h, bf16), the counts first;
    # passes: the encoder over 512 tokens (29 MoE layers: the last runs no MLP) forward and
    # backward, the first decoder pass over 256 forward, the second forward and backward
    row = 8 * h * 2
    expected = (29 * 512 * row * 2 * 2 + 30 * 256 * row * 2 + 30 * 256 * row * 2 * 2
                + (29 + 30 + 30) * experts * 8)  # fmt: skip
    assert a2a.tensor_bytes == expected and a2a.calls == 3 * (29 + 60) + 2 * (29 + 30)
    print(render(plan, str(path)))
    assert main(["plan", str(path), "--world", "8", "--device", "h100",
                 "parallel.expert_parallel=8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "(fits)" in out and "peak estimate" in out and "step " in out


def trainable_tensors(cfg) -> int:
    """Parameter tensors AdamW steps in the 26B-A4B (the routers frozen)."""
    arch = cfg.model
    per_layer = {SLIDING: 4 + 2, FULL: 3 + 2}  # q, k, v, o (full: no v); q/k norms
    types = arch.diffusion_gemma.layer_types
    layer = 3 + 2 + 7  # dense MLP, expert stacks, layer norms
    return sum(per_layer[t] + layer for t in types) + 1 + 1 + 4  # embedding, norm, self-cond.


def test_what_cannot_run_is_refused_in_one_line():
    path = MODELS / "diffusion_gemma_26b_a4b.yaml"
    for override, message in (
        ("parallel.tensor_parallel=2", "unmask plan does not model its split yet"),
        ("parallel.pipeline_parallel=2", "has no pipeline stages"),
        ("train.activation_checkpointing=full", "do not recompute yet"),
    ):
        with pytest.raises(InputError, match=message) as err:
            make_run_plan(load_config(path, [override]), 8, resolve_device("h100"))
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "worlds"), [
    ("llada2_1_mini.yaml", [["--world", "8"], ["--world", "64", "--nodes", "8"]]),
    ("llada2_1_flash.yaml", [["--world", "64", "--nodes", "8"]]),
])  # fmt: skip
def test_llada2_1_configs_plan_as_llada2_0(name, worlds, capsys):
    """LLaDA2.1 keeps LLaDA2.0's architecture (the model cards): the configs' model sections
    are LLaDA2.0's, and they plan at the world sizes their headers name."""
    ours = yaml.safe_load((MODELS / name).read_text())
    base = yaml.safe_load((MODELS / name.replace("2_1", "2")).read_text())
    assert ours["model"] == base["model"]
    header = (MODELS / name).read_text()
    for world in worlds:
        assert f"unmask plan configs/models/{name} {' '.join(world)}" in header
        assert main(["plan", str(MODELS / name), *world]) == 0
        out = capsys.readouterr().out
        assert "(fits)" in out and "ep " in out


def test_flash_at_8_gpus_does_not_fit_in_one_line(capsys):
    code = main(["plan", str(MODELS / "llada2_1_flash.yaml"), "parallel.expert_parallel=8",
                 "--world", "8"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and err.count("\n") == 1


def test_fsdp2_gathers_each_layer_for_each_use_and_again_after_each_backward_use():
    """26B-A4B at 8 ranks: a layer is used three times (the encoder, the first decoder pass,
    the second) and twice in the backward. Resharded after forward: gathered before each
    of the 5 uses; kept after forward (parallel.reshard_after_forward false): gathered once
    in the forward, and FSDP2's post-backward reshards after every backward use, so again
    before the second (the encoder's). The root (embedding, norm, self-conditioning MLP):
    twice, or once. Reduce-scatters: one per backward use either way."""
    path = MODELS / "diffusion_gemma_26b_a4b.yaml"
    calls = {}
    for reshard in ("true", "false"):
        cfg = load_config(path, ["parallel.expert_parallel=8",
                                 f"parallel.reshard_after_forward={reshard}"])  # fmt: skip
        kinds = {(c.dim, c.kind): c for c in make_run_plan(cfg, 8, resolve_device("h100"))
                 .collectives}  # fmt: skip
        calls[reshard] = (kinds[("dp_shard_cp", "all-gather")].calls,
                          kinds[("dp_shard_cp", "reduce-scatter")].calls)  # fmt: skip
    assert calls == {"true": (5 * 30 + 2, 2 * 30 + 1), "false": (2 * 30 + 1, 2 * 30 + 1)}
