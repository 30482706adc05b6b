"""Tensor parallelism (`parallel.tensor_parallel: 2`) of DiffusionGemma on 2 gloo processes,
trained with the `uniform` objective and self-conditioning, against the one-process run of
the same global batch (split_batches): attention (q/k/v column-parallel, o row-parallel,
per-head q/k norms; both layer kinds, the full layers without v_proj and with their own
key/value heads) and the dense MLP split over the ranks, the routers, experts, tied
embedding / LM head and self-conditioning MLP whole on each (models/shape.py
`DIFFUSION_GEMMA_TENSOR_PLAN`). The losses of 20 steps within 1e-5 and the final weights
within 1e-4 (`assert_weights_close`; AdamW; MuonAdamW within test_expert_parallel.py's tolerances), and the tp=2 run's step-10
checkpoint resumes on one process. One torchrun launch (dist_workers/gemma_tp_worker.py,
which also records the parameters' layout). What it cannot run is refused in one line."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_GEMMA, deep_update, losses, train_in_process, write_run_config
from launch import WORKERS, torchrun
from safetensors.torch import load_file

from unmask.checkpoint import is_distributed_checkpoint
from unmask.config import load_config
from unmask.errors import InputError
from unmask.models.build import resolve_model
from unmask.parallel.tensor import check_tensor_parallel
from unmask.train.setup import plan_parallel

TP2 = deep_update(TINY_GEMMA, {
    "model": {"num_attention_heads": 4, "num_key_value_heads": 2,
              "diffusion_gemma": {"global_head_dim": 32, "num_global_key_value_heads": 2}},
    "diffusion": {"self_conditioning_prob": 0.5},
    "parallel": {"tensor_parallel": 2},
    "train": {"save_steps": 10, "split_batches": True, "max_steps": 20},
})  # fmt: skip
"""A tiny DiffusionGemma: a sliding layer (4 query, 2 key/value heads of 16) and a full one
(4 query heads of 32, 2 key/value heads, no v_proj), 4 experts (top 2) beside each dense MLP."""
MUON = {"optim": {"name": "muon", "ns_dtype": "float32"}, "train": {"save_steps": 0}}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


def assert_weights_close(reference: dict, final: dict, atol: float = 1e-4) -> None:
    """Every tensor within `atol` of the reference. The losses agree within 1e-5, the weights
    within 1e-5 but for a few embedding rows (about 3e-5 after 20 steps): the row-parallel
    sums round in another order in every layer, forward and backward, and AdamW's
    normalized step turns the rounding of near-zero gradients (rare tokens' rows of the tied
    head) into whole steps; a dp_shard=2 run of the same config is about 2x closer."""
    assert sorted(reference) == sorted(final)
    for key, value in reference.items():
        assert torch.allclose(final[key], value, rtol=0, atol=atol), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma_tp")
    paths = [write_run_config(root, name, TP2, extra)
             for name, extra in (("tp2", {}), ("tp2_muon", MUON))]  # fmt: skip
    out = root / "results"
    out.mkdir()
    torchrun(2, WORKERS / "gemma_tp_worker.py", out, *paths)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    return {"root": root, "ranks": ranks}


@pytest.mark.slow
def test_attention_and_the_dense_mlp_are_split_the_rest_is_whole_on_each_rank(runs):
    for rank in runs["ranks"]:
        for name, result in rank.items():
            assert result["rc"] == 0, (name, result["stderr"][-3000:])
            layout = result["layout"]
            for index, (width, kv) in enumerate(((4 * 16, 2 * 16), (4 * 32, 2 * 32))):
                layer = f"model.layers.{index}."
                split = {"self_attn.q_proj": [width // 2, 32],
                         "self_attn.k_proj": [kv // 2, 32],
                         "self_attn.o_proj": [32, width // 2],
                         "mlp.gate_proj": [32, 32], "mlp.up_proj": [32, 32],
                         "mlp.down_proj": [32, 32]}  # fmt: skip
                if index == 0:
                    split["self_attn.v_proj"] = [kv // 2, 32]
                else:  # the full layer: V is the k projection
                    assert layer + "self_attn.v_proj.weight" not in layout
                for module, shape in split.items():
                    placements, local = layout[layer + module + ".weight"]
                    assert placements["tp"] in ("S(0)", "S(1)") and local == shape, module
                for norm in ("q_norm", "k_norm"):  # per head: replicated over the tp ranks
                    assert layout[f"{layer}self_attn.{norm}.weight"][0]["tp"] == "R"
                for whole in ("router.proj.weight", "experts.gate_up_proj",
                              "experts.down_proj"):  # fmt: skip
                    assert "tp" not in layout[layer + whole][0], whole
            for whole in ("model.embed_tokens.weight", "model.self_conditioning.gate_proj.weight"):
                assert "tp" not in layout[whole][0], whole


@pytest.mark.slow
def test_losses_and_final_weights_equal_one_process_for_20_steps(runs):
    root = runs["root"]
    single_run = train_in_process(root / "tp2.yaml", root / "tp2-1", tensor_parallel=1)
    single, split = losses(single_run), losses(root / "tp2")
    assert sorted(single) == sorted(split) == list(range(1, 21))
    for step in single:
        assert split[step] == pytest.approx(single[step], abs=1e-5), step
    assert_weights_close(weights(single_run), weights(root / "tp2"))


@pytest.mark.slow
def test_muon_equals_one_process(runs):
    """Muon's Newton-Schulz iterations amplify the float32 rounding of other summation
    orders: test_expert_parallel.py's tolerances (1e-5 relative on the losses, 1e-4 on each
    tensor's relative norm)."""
    root = runs["root"]
    single_run = train_in_process(root / "tp2_muon.yaml", root / "tp2_muon-1", tensor_parallel=1)
    single, split = losses(single_run), losses(root / "tp2_muon")
    assert sorted(single) == sorted(split) == list(range(1, 21))
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step
    reference, final = weights(single_run), weights(root / "tp2_muon")
    assert sorted(reference) == sorted(final)
    for key, value in reference.items():
        assert ((final[key] - value).norm() / value.norm().clamp(min=1e-12)).item() <= 1e-4, key


@pytest.mark.slow
def test_the_tp2_checkpoint_resumes_on_one_process(runs):
    root = runs["root"]
    saved = root / "tp2" / "checkpoint-10"
    assert is_distributed_checkpoint(saved)
    one = train_in_process(root / "tp2.yaml", root / "resumed-1", tensor_parallel=1,
                           resume_from_checkpoint=str(saved))  # fmt: skip
    full, resumed = losses(root / "tp2"), losses(one)
    assert sorted(resumed) == list(range(11, 21))
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], abs=1e-5), step
    assert_weights_close(weights(root / "tp2"), weights(one))


def config(tmp_path: Path, extra: dict):
    return load_config(write_run_config(tmp_path, "run", TP2, extra))


def test_what_tensor_parallelism_cannot_run_is_refused_in_one_line(tmp_path):
    assert plan_parallel(config(tmp_path, {}), 2).dims.tp == 2  # the experts stay whole
    refusals = [
        ({"model": {"diffusion_gemma": {"num_global_key_value_heads": 1}}}, 2,
         r"^parallel.tensor_parallel=2 does not divide "
         r"model.diffusion_gemma.num_global_key_value_heads=1; "),
        ({"model": {"num_key_value_heads": 1, "diffusion_gemma": {
            "num_global_key_value_heads": None}}}, 2,
         r"^parallel.tensor_parallel=2 does not divide model.num_key_value_heads=1; "),
        ({"parallel": {"expert_parallel": 2}}, 4,
         r"^parallel.tensor_parallel=2 keeps the experts of model_type 'diffusion_gemma' "
         r"whole on every tp rank and does not combine with parallel.expert_parallel=2"),
        ({"model": {"model_type": "qwen3_moe_dllm", "diffusion_gemma": None}}, 2,
         r"^parallel.tensor_parallel does not split mixture-of-experts layers"),
    ]  # fmt: skip
    for extra, world, message in refusals:
        with pytest.raises(InputError, match=message) as err:
            cfg = config(tmp_path, extra)
            if cfg.model.model_type != "diffusion_gemma":
                cfg.diffusion = cfg.diffusion.model_copy(update={"objective": "mdlm"})
            plan_parallel(cfg, world)
        assert "\n" not in str(err.value)
    with pytest.raises(InputError, match=r"^parallel.sequence_parallel: true: model_type "
                       r"'diffusion_gemma' declares no sequence-parallel split") as err:  # fmt: skip
        check_tensor_parallel(resolve_model(config(tmp_path, {}).model), 2, sequence_parallel=True)
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match=r"^parallel.sequence_parallel: true: model_type "
                       r"'diffusion_gemma' declares no sequence-parallel split"):  # fmt: skip
        plan_parallel(config(tmp_path, {"parallel": {"sequence_parallel": True}}), 2)
