"""`unmask plan` on the real models' configs in configs/models/: LLaDA-8B at 64 GPUs
(dp_shard 8 x tp 8 over 8 nodes), its shard shapes and FLOPs against the formulas, and the
text and JSON forms."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llada_8b_on_64_gpus_shards_follow_the_formulas(capsys):
    plan = plan_json(capsys, str(MODELS / "llada_8b.yaml"), "parallel.tensor_parallel=8",
                     "--world", "64", "--nodes", "8")  # fmt: skip
    assert plan["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 8}
    assert [r["rank"] for r in plan["ranks"]] == [0, 63]
    h, inter, vocab, layers, tp, dp = 4096, 12288, 126464, 32, 8, 8
    shards = {row["name"]: row for row in plan["ranks"][0]["shards"]}
    expect = {  # column-parallel: rows / tp / dp; row-parallel: rows / dp, columns / tp
        "model.layers.0.self_attn.q_proj.weight": [h // tp // dp, h],
        "model.layers.0.self_attn.k_proj.weight": [h // tp // dp, h],
        "model.layers.0.self_attn.o_proj.weight": [h // dp, h // tp],
        "model.layers.0.mlp.gate_proj.weight": [inter // tp // dp, h],
        "model.layers.0.mlp.up_proj.weight": [inter // tp // dp, h],
        "model.layers.0.mlp.down_proj.weight": [h // dp, inter // tp],
        "model.layers.0.input_layernorm.weight": [h // dp],
        # vocab-parallel: rows / tp, then / dp
        "model.embed_tokens.weight": [vocab // tp // dp, h],
        "lm_head.weight": [vocab // tp // dp, h],
    }
    for name, local in expect.items():
        assert shards[name]["local"] == local, name
    params = 2 * vocab * h + layers * (4 * h * h + 3 * h * inter + 2 * h) + h
    assert plan["parameters"] == params
    # rank 0's float32 parameters: the formulas above over every layer
    per_layer = 4 * (h // tp // dp) * h + 3 * (inter // tp // dp) * h + 2 * (h // dp)
    local = layers * per_layer + 2 * (vocab // tp // dp) * h + h // dp
    assert plan["ranks"][0]["memory"]["parameters"] == 4 * local
    # FLOPs: 6 N T + 12 layers d_attn L T + 6 d V R (train/mfu.py), R = half the tokens
    tokens, length = 4 * dp * 4096, 4096
    matmuls = layers * (4 * h * h + 3 * h * inter)
    flops = 6 * matmuls * tokens + 12 * layers * h * length * tokens + 6 * h * vocab * tokens / 2
    assert plan["flops_per_step"] == pytest.approx(flops, rel=1e-12)
    assert plan["tokens_per_step"] == tokens and plan["fits"]
    kinds = {(c["dim"], c["kind"]): c for c in plan["collectives"]}
    assert not kinds[("dp_shard_cp", "all-gather")]["intra_node"]  # 64 ranks over 8 nodes
    assert kinds[("tp", "all-reduce")]["intra_node"]


def test_dream_7b_text_plan(capsys):
    assert main(["plan", str(MODELS / "dream_7b.yaml"), "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "mesh dp_replicate 1 x dp_shard 8 x cp 1 x tp 1" in out
    assert "(fits)" in out and "collectives per step" in out
    assert "model.layers.0.self_attn.k_proj.weight" in out  # 4 K/V heads x 128: (512, 3584)
    assert "(512, 3584) -> (64, 3584)" in out


def test_gpu_suite_dry_run_is_consistent_with_the_planner():
    # benchmarks/gpu.py --dry: the suite imports, and each case's plan has train/mfu.py's
    # FLOPs, the trainer's tokens per step, and fits (no GPU needed)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    proc = subprocess.run([sys.executable, str(script), "--dry", "--world", "2"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "checks" in line]
    assert len(lines) == 3  # LLaDA-8B, Dream-7B, LLaDA-MoE-7B-A1B shapes
    assert all(line.endswith("checks flops ok, tokens ok, fits ok") for line in lines), lines


def test_llada2_flash_on_512_gpus_expert_shards_follow_the_formulas(capsys):
    # LLaDA2.0-flash (100B, 256 experts) at 512 GPUs, ep 64 x 8 replicas over 64 nodes:
    # each rank holds 256 / 64 whole experts of every MoE layer (outside FSDP2), the rest
    # is FSDP2-sharded over the 512 ranks (dim 0 / 512, torch.chunk: ceil)
    plan = plan_json(capsys, str(MODELS / "llada2_flash.yaml"), "--world", "512",
                     "--nodes", "64")  # fmt: skip
    assert plan["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 512, "cp": 1, "tp": 1}
    h, inter, moe, experts, ep, dp, vocab = 4096, 9216, 1024, 256, 64, 512, 157184
    q, kv = 32 * 128, 4 * 128
    for rank in plan["ranks"]:
        shards = {row["name"]: row for row in rank["shards"]}
        expect = {
            "model.layers.1.mlp.experts.gate_proj": [experts // ep, moe, h],
            "model.layers.1.mlp.experts.up_proj": [experts // ep, moe, h],
            "model.layers.1.mlp.experts.down_proj": [experts // ep, h, moe],
            # the router's 256 rows over 512 ranks (torch.chunk): one on the first 256
            "model.layers.1.mlp.gate.weight": [1 if rank["rank"] < experts else 0, h],
            "model.layers.1.mlp.shared_experts.gate_proj.weight": [moe // dp, h],
            "model.layers.1.self_attn.q_proj.weight": [q // dp, h],
            "model.layers.1.self_attn.k_proj.weight": [kv // dp, h],
            "model.layers.0.mlp.gate_proj.weight": [inter // dp, h],  # the dense layer
            "model.layers.0.mlp.down_proj.weight": [h // dp, inter],
        }
        for name, local in expect.items():
            assert shards[name]["local"] == local, (rank["rank"], name)
        stack = shards["model.layers.1.mlp.experts.gate_proj"]
        assert stack["mesh"] == ["ep_replica", "ep"] and stack["placements"] == ["R", "S(0)"]
        assert shards["lm_head.weight"]["local"] == [vocab // dp, h]  # 307 rows each
    # 102.9 B parameters (the published 100B), 6.1 B active (train/mfu.py's count)
    attn = h * q + 2 * h * kv + q * h + 2 * 128
    per_moe = attn + 3 * experts * moe * h + 3 * moe * h + experts * h + 2 * h
    dense = attn + 3 * h * inter + 2 * h
    assert plan["parameters"] == 2 * vocab * h + h + dense + 31 * per_moe
    assert round(plan["parameters"] / 1e9, 1) == 102.9
    # FLOPs of the active parameters (train/mfu.py): attention and the dense MLP, and per
    # MoE layer the shared expert, the router and the top-8 experts
    linear = h * q + 2 * h * kv + q * h
    matmul = 32 * linear + 3 * h * inter + 31 * (3 * moe * h + experts * h + 8 * 3 * moe * h)
    assert round((matmul + 2 * vocab * h) / 1e9, 2) == 6.15  # the published 6.1B active
    step_tokens, length = 512 * 2 * 4096, 4096
    flops = 6 * matmul * step_tokens + 12 * 32 * q * length * step_tokens
    flops += 6 * h * vocab * step_tokens / 2
    assert plan["flops_per_step"] == pytest.approx(flops, rel=1e-12)
    kinds = {(c["dim"], c["kind"]): c for c in plan["collectives"]}
    tokens = 2 * 4096  # rows x length on a rank
    row = tokens * 8 * h
    # 31 MoE layers, each recomputed (full checkpointing): bf16 there and back
    a2a = kinds[("ep", "all-to-all")]
    assert a2a["tensor_bytes"] == 2 * 31 * (row * 4 + experts * 8) + 31 * row * 4
    assert a2a["group"] == ep and not a2a["intra_node"]
    assert kinds[("ep_replica", "all-reduce")]["group"] == dp // ep
    assert plan["fits"]


def test_llada2_flash_on_512_gpus_in_4_pipeline_stages_with_ep(capsys):
    # pp 4 outermost: each stage's 128 ranks (16 nodes) hold its layers (cut by estimated
    # cost: 9, 8, 8, 7, the dense layer 0 on stage 0 and the head, about 1.7 MoE layers, on
    # stage 3), FSDP2 over the 128, each stage's experts split ep 64 x 2 replicas; 8 rows per
    # rank, one per micro-batch (1F1B), so a step trains the same 4.2M tokens as the pp=1 plan
    plan = plan_json(capsys, str(MODELS / "llada2_flash.yaml"), "parallel.pipeline_parallel=4",
                     "train.per_device_train_batch_size=8", "parallel.pipeline_microbatches=8",
                     "--world", "512", "--nodes", "64")  # fmt: skip
    assert plan["layout"] == {"pp": 4, "dp_replicate": 1, "dp_shard": 128, "cp": 1, "tp": 1}
    h, inter, moe, experts, ep, dp, vocab = 4096, 9216, 1024, 256, 64, 128, 157184
    q, kv, m, length = 32 * 128, 4 * 128, 8, 4096
    first, last = plan["ranks"]
    assert (first["rank"], last["rank"]) == (0, 511)  # stage 0 (layers 0-8), stage 3 (25-31)
    for rank, layer in ((first, 1), (last, 25)):  # each one's first MoE layer
        shards = {row["name"]: row for row in rank["shards"]}
        stack = shards[f"model.layers.{layer}.mlp.experts.gate_proj"]
        assert stack["local"] == [experts // ep, moe, h]
        assert stack["mesh"] == ["ep_replica", "ep"] and stack["placements"] == ["R", "S(0)"]
        shared = shards[f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight"]
        assert shared["local"] == [moe // dp, h]
        assert shards[f"model.layers.{layer}.self_attn.q_proj.weight"]["local"] == [q // dp, h]
    first_names = {row["name"] for row in first["shards"]}
    last_names = {row["name"]: row for row in last["shards"]}
    assert "model.embed_tokens.weight" in first_names and "lm_head.weight" not in first_names
    assert "model.embed_tokens.weight" not in last_names
    assert last_names["lm_head.weight"]["local"] == [vocab // dp, h]
    assert "model.layers.0.mlp.gate_proj.weight" in first_names  # the dense layer, stage 0
    # the whole model's parameters and FLOPs, as at pp=1 (a stage holds a quarter)
    attn = h * q + 2 * h * kv + q * h + 2 * 128
    per_moe = attn + 3 * experts * moe * h + 3 * moe * h + experts * h + 2 * h
    dense = attn + 3 * h * inter + 2 * h
    assert plan["parameters"] == 2 * vocab * h + h + dense + 31 * per_moe
    linear = h * q + 2 * h * kv + q * h
    matmul = 32 * linear + 3 * h * inter + 31 * (3 * moe * h + experts * h + 8 * 3 * moe * h)
    step_tokens = 128 * 8 * length
    assert plan["tokens_per_step"] == step_tokens == 512 * 2 * length
    flops = 6 * matmul * step_tokens + 12 * 32 * q * length * step_tokens
    flops += 6 * h * vocab * step_tokens / 2
    assert plan["flops_per_step"] == pytest.approx(flops, rel=1e-12)
    assert plan["micro_batches"] == m and plan["rows_per_rank"] == 1
    assert plan["bubble"] == pytest.approx(3 / (m + 3))  # (p - 1) / (m + p - 1)
    kinds = {(c["dim"], c["kind"]): c for c in plan["collectives"]}
    # rank 0's 8 MoE layers (layer 0 is dense), each micro-batch's 4096 tokens, recomputed
    row = length * 8 * h
    a2a = kinds[("ep", "all-to-all")]
    assert a2a["tensor_bytes"] == m * (2 * 8 * (row * 4 + experts * 8) + 8 * row * 4)
    assert a2a["group"] == ep
    reduce = kinds[("ep_replica", "all-reduce")]  # its 8 layers' float32 expert gradients
    assert reduce["group"] == dp // ep
    assert reduce["tensor_bytes"] == 8 * 3 * (experts // ep) * moe * h * 4
    send = kinds[("pp", "send/recv")]  # stage 0 sends each micro-batch's hidden states
    assert send["calls"] == m and send["tensor_bytes"] == m * length * h * 2
    assert plan["fits"]


def test_plan_text_names_the_expert_split_and_placements_in_words(capsys):
    # the header says how the experts split; each shard row says where it lives in words
    assert main(["plan", str(MODELS / "llada2_flash.yaml"), "--world", "512", "--nodes",
                 "64"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header.endswith("x pp 1 (ep 64: the experts split over 64 ranks)")
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  model.")}
    q_proj = rows["model.layers.0.self_attn.q_proj.weight"].split()
    assert " ".join(q_proj[1:]) == "(4096, 4096) -> (8, 4096) muon dp_shard_cp split on dim 0"
    assert rows["model.layers.1.mlp.experts.gate_proj"].endswith(
        "ep_replica whole; ep split on dim 0"
    )
    # the columns line up: every shape starts at one column
    starts = {line.index("(") for line in rows.values()}
    assert len(starts) == 1


def test_placement_words():
    from unmask.plan.report import placement_words

    assert placement_words("S(0)") == "split on dim 0"
    assert placement_words("_S(1, 8)") == "split on dim 1 (strided, 8 blocks)"
    assert placement_words("R") == "whole"
    assert placement_words("P(sum)") == "partial sums"


def test_a_refused_expert_split_names_the_override_that_plans(capsys):
    """LLaDA2.1-flash's YAML sets expert_parallel 64: at 8 ranks the refusal names the
    override that gives the 8-GPU plan (docs/scaling.md shows the same line)."""
    flash = str(MODELS / "llada2_1_flash.yaml")
    assert main(["plan", flash, "--world", "8"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("launch a multiple of 64 of them, or override "
                                "parallel.expert_parallel=8 (it divides the 256 experts and "
                                "the 8 ranks)")  # fmt: skip
    doc = (MODELS.parents[1] / "docs" / "scaling.md").read_text()
    assert err.strip() in doc
