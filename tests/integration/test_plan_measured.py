"""`unmask plan`'s predictions against real runs on this machine (torchrun, gloo).

One launch per world size (1, 2, 4) runs every layout of that size, dense, expert-parallel
and pipelined alike (`ALL_LAYOUTS`), through the real Trainer
(tests/integration/dist_workers/plan_worker.py: a second training step measured on every
rank); the plan of the same config, made in this process under the fake process
group, must match:
- parameter, gradient and optimizer-state bytes of every rank: exactly;
- each parameter's local shape on every rank: exactly;
- the bytes autograd holds saved for backward (activations): exactly, given the step's
  masked token count (the planner's formula is per token; the count is the noise's draw);
- the peak (torch's MemTracker over the whole step, a module called once per micro-batch
  allowed): within 15%;
- the collectives' bytes (torch.profiler's c10d events in a third step): see
  `check_collectives`.
"""

import json
from pathlib import Path

import pytest
import yaml
from launch import torchrun

from unmask.config import load_config
from unmask.plan.devices import resolve_device
from unmask.plan.planner import make_run_plan

WORKER = Path(__file__).resolve().parent / "dist_workers" / "plan_worker.py"

BASE = {
    "model": {"model_type": "qwen3_dllm", "hidden_size": 64, "intermediate_size": 192,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128},
    "data": {"dataset": "synthetic", "tokenizer": "char", "packing": False,
             "packing_length": 32, "synthetic_train_size": 2000},
    "diffusion": {"objective": "mdlm"},
    "optim": {"name": "muon"},
    "train": {"max_steps": 4, "per_device_train_batch_size": 8, "save_steps": 0,
              "logging_steps": 1, "log_mfu": False},
    "eval": {"generate_accuracy": False},
}  # fmt: skip

#: wider layers (and experts) whose optimizer state outgrows one row's activations
WIDE = {"hidden_size": 256, "intermediate_size": 768}
#: the full-logits loss over a vocabulary of 1024 (its logits outgrow the layers here)
FULL = {"loss_implementation": "full", "vocab_size": 1024}
#: world size -> {layout name: overrides of BASE}
LAYOUTS = {
    1: {
        "single_muon": {},
        # packed rows: several documents a row, varlen attention (auto on CPU)
        "single_muon_packed": {"data": {"packing": True}},
        "single_adamw_bf16_ckpt": {"optim": {"name": "adamw"},
                                   "train": {"bf16": True, "activation_checkpointing": "full"}},
        # the full-logits loss (model.loss_implementation: full) over 1024 ids, its
        # backward the peak; under autocast, and in float32
        "single_full_adamw_bf16": {"model": FULL, "optim": {"name": "adamw"},
                                   "train": {"bf16": True}},
        "single_full_muon": {"model": FULL},
        # wider matrices, one row: the peak is Muon's step (one process: runs of a shape)
        "single_muon_optimizer_peak": {"model": WIDE,
                                       "train": {"per_device_train_batch_size": 1}},
    },
    2: {
        "fsdp_muon": {},
        "fsdp_adamw_bf16_ckpt": {"optim": {"name": "adamw"},
                                 "train": {"bf16": True, "activation_checkpointing": "full"}},
        "tp_muon": {"train": {"tensor_parallel": 2}},
        "cp_muon": {"train": {"context_parallel": 2}},
        # next-token LM: the head on every token with a target, a causal mask through sdpa
        "fsdp_ar_adamw_bf16": {"diffusion": {"objective": "ar"}, "optim": {"name": "adamw"},
                               "train": {"bf16": True}},
        # torchtitan's loss: the whole logits of every position, float32 cross-entropy
        "fsdp_ar_full_adamw_bf16": {"model": FULL, "diffusion": {"objective": "ar"},
                                    "optim": {"name": "adamw"}, "train": {"bf16": True}},
        "fsdp_full_muon_ckpt": {"model": FULL, "train": {"activation_checkpointing": "full"}},
        # wider matrices, one row: the peak is Muon's step (the owner all-to-all's buffers)
        "fsdp_muon_optimizer_peak": {"model": WIDE, "train": {"per_device_train_batch_size": 1}},
    },
    4: {
        "fsdp_muon_bf16_selective": {"train": {"bf16": True,
                                               "activation_checkpointing": "selective"}},
        "hsdp_adamw": {"optim": {"name": "adamw"}, "train": {"dp_replicate": 2}},
        "fsdp_tp_muon": {"train": {"tensor_parallel": 2}},
        "fsdp_cp_muon_accum": {"train": {"context_parallel": 2,
                                         "gradient_accumulation_steps": 2}},
    },
}  # fmt: skip


def layout_config(overrides: dict) -> dict:
    tree = json.loads(json.dumps(BASE))
    for section, values in overrides.items():
        tree[section].update(json.loads(json.dumps(values)))
    return tree


#: mixture-of-experts layouts (expert parallelism), world size -> {name: overrides of BASE}
MOE = {"model_type": "qwen3_moe_dllm", "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16}  # fmt: skip
SIGMOID = {**MOE, "model_type": "llada2_moe", "n_group": 2, "topk_group": 1,
           "num_shared_experts": 1, "first_k_dense_replace": 1}  # fmt: skip
MOE_LAYOUTS = {
    2: {
        "ep2_muon": {"model": MOE, "train": {"expert_parallel": 2}},
        "ep2_adamw_sigmoid_bf16": {"model": SIGMOID, "optim": {"name": "adamw"},
                                   "train": {"expert_parallel": 2, "bf16": True}},
        # 8 wide experts, one row: the peak is Muon's step on the whole expert stacks
        "ep2_muon_optimizer_peak": {"model": {**MOE, **WIDE, "moe_intermediate_size": 256,
                                              "num_experts": 8},
                                    "train": {"expert_parallel": 2,
                                              "per_device_train_batch_size": 1}},
    },
    4: {
        "dp4_ep2_muon_sigmoid": {"model": SIGMOID, "train": {"expert_parallel": 2}},
        "hsdp_dp2_ep2_adamw": {"model": MOE, "optim": {"name": "adamw"},
                               "train": {"expert_parallel": 2, "dp_replicate": 2}},
    },
}  # fmt: skip


#: pipeline layouts (parallel/pipeline.py: one decoder layer per stage, an untied head)
PIPELINE = {"tie_word_embeddings": False}
PP_LAYOUTS = {
    2: {"pp2_muon": {"model": PIPELINE, "train": {"pipeline_parallel": 2}}},
    4: {
        "dp2_pp2_adamw_bf16": {"model": PIPELINE, "optim": {"name": "adamw"},
                               "train": {"pipeline_parallel": 2, "bf16": True,
                                         "pipeline_microbatches": 4}},
        "dp2_pp2_gpipe_muon": {"model": PIPELINE,
                               "train": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe",
                                         "activation_checkpointing": "full"}},
    },
}  # fmt: skip


#: mixture-of-experts models in pipeline stages: 4 layers, 2 stages (layer 0 dense), each
#: stage's experts split over its 2 data-parallel ranks (ep 2) or on both (ep 1)
PP_MOE = {**SIGMOID, **PIPELINE, "num_hidden_layers": 4}
PP_MOE_LAYOUTS = {
    4: {"pp2_ep2_muon_sigmoid": {"model": PP_MOE,
                                 "train": {"pipeline_parallel": 2, "expert_parallel": 2}},
        # the same in 2 micro-batches of 4 rows (the routing of 128 tokens, not 32)
        "pp2_ep2_mb2_muon_sigmoid": {"model": PP_MOE,
                                     "train": {"pipeline_parallel": 2, "expert_parallel": 2,
                                               "pipeline_microbatches": 2}},
        # every stage's experts on each of its ranks: no routing between ranks
        "pp2_ep1_muon_sigmoid": {"model": PP_MOE, "train": {"pipeline_parallel": 2}}},
}  # fmt: skip


def measure(world: int, out: Path, layouts: dict | None = None) -> dict[str, list[dict]]:
    """Launch the worker over every layout of `world` (of LAYOUTS, or `layouts`);
    {name: [rank 0's, rank 1's, ...]}."""
    layouts = (layouts or LAYOUTS)[world]
    paths = []
    for name, overrides in layouts.items():
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(layout_config(overrides)))
        paths.append(path)
    torchrun(world, WORKER, out, *paths, timeout=900)
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]
            for name in layouts}  # fmt: skip


#: every layout of a world size, run by one launch (`measured`): each launch pays the
#: ranks' imports and the rendezvous once, whichever test reads it first
ALL_LAYOUTS = {world: {name: overrides
                       for layouts in (LAYOUTS, MOE_LAYOUTS, PP_LAYOUTS, PP_MOE_LAYOUTS)
                       for name, overrides in layouts.get(world, {}).items()}
               for world in (1, 2, 4)}  # fmt: skip


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """world -> (the launch's folder, {name: [rank 0's, ...]}) for `layouts` of that world:
    every layout of ALL_LAYOUTS[world] measured by one launch, the first time a test asks."""
    runs: dict[int, tuple[Path, dict]] = {}

    def get(world: int, layouts: dict) -> tuple[Path, dict[str, list[dict]]]:
        if world not in runs:
            out = tmp_path_factory.mktemp(f"world{world}")
            runs[world] = (out, measure(world, out, ALL_LAYOUTS))
        out, got = runs[world]
        return out, {name: got[name] for name in layouts[world]}

    return get


def planned(name: str, world: int, out: Path, masked: int, rank: int):
    cfg = load_config(out / f"{name}.yaml")
    t = cfg.train
    tokens = (
        t.per_device_train_batch_size * cfg.data.packing_length // cfg.parallel.context_parallel
    )
    micro_tokens = tokens * t.gradient_accumulation_steps
    return make_run_plan(
        cfg, world, resolve_device("cpu"), masked_fraction=masked / micro_tokens, ranks=[rank]
    )


def check_collectives(name: str, plan, counted: dict, world: int) -> None:
    """The plan's collective bytes against those torch.profiler counted in a step (gloo's
    view: an all-gather's input shard, a reduce-scatter's whole input, an all-to-all's
    send buffer). FSDP2's all-gathers and reduce-scatters, the all-to-alls (Muon's, CP's)
    and CP's doc-id all-gather: equal, under TP too (Muon sends each rank's block of a split
    matrix to its owner: no DTensor redistribute, whose all-gathers the plan does not list,
    is left); TP's activation all-reduces (and the vocab-parallel embedding's and loss's):
    equal up to the scalars every step all-reduces (loss, count, gradient norm) and the q/k
    norms' partial gradients, a few hundred bytes here. Under FSDP2 x TP the embedding's
    all-reduce can land on an all-gather's event: there the all-gathers' calls are equal and
    their bytes are checked together with the all-reduces'."""
    planned = {(c.dim, c.kind): c for c in plan.collectives}
    tp = plan.layout["tp"] > 1
    assert "allgather_into_tensor_coalesced" not in counted, (name, counted)
    gather = planned.get(("dp_shard_cp", "all-gather"))
    if gather is not None:
        got = counted["allgather_base"]
        assert got[0] == gather.calls, name
        if not tp:  # under TP: with the all-reduces (below)
            assert got[1] * gather.group == gather.tensor_bytes, name
        scatter = planned[("dp_shard_cp", "reduce-scatter")]
        assert counted["reduce_scatter_base"][1] == scatter.tensor_bytes, name
    all_to_all = sum(c.tensor_bytes for c in plan.collectives if c.kind == "all-to-all")
    if all_to_all:  # Muon's two, CP's
        assert counted["alltoall_base"][1] == all_to_all, (name, counted, all_to_all)
    doc_ids = planned.get(("cp", "all-gather"))
    if doc_ids is not None:
        assert counted["allgather"][1] * doc_ids.group == doc_ids.tensor_bytes, name
    if tp:
        planned_tp = planned[("tp", "all-reduce")].tensor_bytes
        got_tp = counted["allreduce"][1]
        if gather is not None:  # FSDP2 x TP: the embedding's async all-reduce can run while
            # the next unit's all-gather is issued, and its bytes land on that event: count
            # the two kinds together
            planned_tp += gather.tensor_bytes // gather.group
            got_tp += counted["allgather_base"][1]
        assert 0 <= got_tp - planned_tp <= 4096, (name, counted, planned_tp)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_plan_equals_measured_bytes(world, measured):
    tmp_path, measured = measured(world, LAYOUTS)
    gaps = {}
    for name, ranks in measured.items():
        for rank, got in enumerate(ranks):
            plan = planned(name, world, tmp_path, sum(got["masked"]), rank)
            memory = next(r for r in plan.ranks if r.rank == rank).memory
            where = f"{name} rank {rank}"
            assert memory.parameters == got["parameters"], where
            assert memory.gradients == got["gradients"], where
            assert memory.optimizer == got["optimizer_state"], where
            assert memory.activations == got["saved_activations"], where
            plan_rank = next(r for r in plan.ranks if r.rank == rank)
            for row in plan_rank.shards:  # the root's and layer 0's parameters
                assert row["local"] == got["local_shapes"][row["name"]], (where, row["name"])
            if rank == 0:  # planned with the masked count of the step counted
                counted = planned(name, world, tmp_path, got["collectives_masked"], rank)
                check_collectives(name, counted, got["collectives"], world)
            if got["peak"] is not None:
                gaps[where] = memory.peak / got["peak"] - 1
    print(json.dumps(gaps, indent=1))  # the peak gaps, for the record (pytest -s)
    assert all(abs(gap) <= 0.15 for gap in gaps.values()), gaps


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_plan_equals_measured_bytes(world, measured):
    """Expert parallelism (parallel/expert.py, run by the planner under the fake process
    group as the trainer runs it): parameter, gradient and optimizer-state bytes and every
    parameter's local shape of every rank equal the real run's exactly, and so do the
    all-to-all bytes summed over the ranks (EP's dispatch and combine, Muon's; a rank's own
    share depends on where the routing sends its rows). Likewise the activations: the
    plan takes the routing as balanced, and the routing moves rows between the ranks of
    an ep group without making or dropping any, so their sum over the group equals the
    plan's exactly, and each rank's is within 15% (measured -8.2% to +9.8%; not for the
    one-row layout, whose 32 tokens a rank over 8 experts route unevenly: -15.2% and
    +21.8%). The peak is within 15% on every rank (measured -6.3% to +13.0%, the plan
    higher on the ranks that get the fewest rows; -0.7% where Muon's step on the whole
    expert stacks is the peak); the gaps are printed (pytest -s)."""
    tmp_path, measured = measured(world, MOE_LAYOUTS)
    gaps = {}
    for name, ranks in measured.items():
        ep = layout_config(MOE_LAYOUTS[world][name])["train"]["expert_parallel"]
        group_plan, group_got = [0] * (world // ep), [0] * (world // ep)
        for rank, got in enumerate(ranks):
            plan = planned(name, world, tmp_path, sum(got["masked"]), rank)
            plan_rank = next(r for r in plan.ranks if r.rank == rank)
            memory, where = plan_rank.memory, f"{name} rank {rank}"
            assert memory.parameters == got["parameters"], where
            assert memory.gradients == got["gradients"], where
            assert memory.optimizer == got["optimizer_state"], where
            for row in plan_rank.shards:
                assert row["local"] == got["local_shapes"][row["name"]], (where, row["name"])
            if rank == 0:  # the all-to-alls (EP's, Muon's): what the ranks sent in all
                sent = sum(r["collectives"]["alltoall_base"][1] for r in ranks)
                a2a = sum(c.tensor_bytes for c in plan.collectives if c.kind == "all-to-all")
                assert sent == world * a2a, (where, sent, world * a2a)
            group_plan[rank // ep] += memory.activations  # the ep group: ranks r // ep
            group_got[rank // ep] += got["saved_activations"]
            gaps[where] = {"activations": memory.activations / got["saved_activations"] - 1,
                           "peak": memory.peak / got["peak"] - 1}  # fmt: skip
        assert group_plan == group_got, (name, group_plan, group_got)
    print(json.dumps(gaps, indent=1))
    assert all(abs(g["peak"]) <= 0.15 for g in gaps.values()), gaps
    assert all(abs(g["activations"]) <= 0.15 for where, g in gaps.items()
               if not where.startswith("ep2_muon_optimizer_peak")), gaps  # fmt: skip


def assert_state_equals_plan(name: str, world: int, tmp_path, rank: int, got: dict):
    """The plan's parameter, gradient and optimizer-state bytes and local shapes of `rank`
    equal those the real run measured (`got`), exactly; returns the plan's memory terms."""
    plan = planned(name, world, tmp_path, sum(m or 0 for m in got["masked"]), rank)
    plan_rank = next(r for r in plan.ranks if r.rank == rank)
    memory, where = plan_rank.memory, f"{name} rank {rank}"
    assert memory.parameters == got["parameters"], where
    assert memory.gradients == got["gradients"], where
    assert memory.optimizer == got["optimizer_state"], where
    assert plan_rank.shards, where
    for row in plan_rank.shards:
        assert row["local"] == got["local_shapes"][row["name"]], (where, row["name"])
    return memory


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_plan_equals_measured_bytes(world, measured):
    """Pipeline parallelism (the trainer's own PipelineModel split and per-stage FSDP2, run
    by the planner under the fake process group): parameter, gradient and optimizer-state
    bytes and the local shapes of every rank (each holding its stage) equal the real run's
    exactly; the first and last pp ranks hold different parts (embedding / head). The
    activations (the most bytes autograd holds saved at once during the schedule's step:
    the micro-batches in flight, the step's ids on the first stage, the loss scale on the
    last) equal the plan's exactly on every rank, and the peak (MemTracker over the step,
    the stages' receive buffers tracked) is within 15% (measured: -4.0% to +4.0%; the
    gaps are printed, pytest -s)."""
    tmp_path, measured = measured(world, PP_LAYOUTS)
    gaps = {}
    for name, ranks in measured.items():
        for rank, got in enumerate(ranks):
            memory = assert_state_equals_plan(name, world, tmp_path, rank, got)
            where = f"{name} rank {rank}"
            assert memory.activations == got["saved_activations"], where
            gaps[where] = memory.peak / got["peak"] - 1
        first, last = measured[name][0], measured[name][-1]
        assert "model.embed_tokens.weight" in first["local_shapes"], name
        assert "lm_head.weight" not in first["local_shapes"], name
        assert "lm_head.weight" in last["local_shapes"], name
    print(json.dumps(gaps, indent=1))
    assert all(abs(gap) <= 0.15 for gap in gaps.values()), gaps


@pytest.mark.slow
def test_pipeline_moe_plan_equals_measured_bytes(measured):
    """MoE layers in pipeline stages (pp=2 on 4 processes, layer 0 dense), with expert
    parallelism inside each stage (ep=2: each stage's expert stacks split over its own 2
    ranks) or without (ep=1: FSDP2 shards them too): parameter, gradient and optimizer-state bytes and the local
    shapes of every rank equal the real run's exactly, and the peak is within 15% (measured:
    -8.3% to +8.9%). The activations: equal to the plan's with the experts on every rank
    (ep=1); under ep=2 they depend on how many rows the routing sends each rank, which the
    plan takes as balanced: within 15% (measured -6.7% to +0.4%; micro-batches of one
    32-token row: the largest of 8 routings per rank, -6.7% to -2.8%)."""
    world = 4
    tmp_path, measured = measured(world, PP_MOE_LAYOUTS)
    gaps = {}
    for name, ranks in measured.items():
        ep = layout_config(PP_MOE_LAYOUTS[world][name])["train"].get("expert_parallel", 1)
        for rank, got in enumerate(ranks):
            memory = assert_state_equals_plan(name, world, tmp_path, rank, got)
            where = f"{name} rank {rank}"
            layer = 1 if rank < 2 else 2  # the stage's first MoE layer
            stack = got["local_shapes"][f"model.layers.{layer}.mlp.experts.gate_proj"]
            # 4 experts: whole ones over ep 2, or FSDP2's dim-0 shard over 2 ranks (ep 1)
            assert stack[0] == 2, where
            gaps[where] = {"activations": memory.activations / got["saved_activations"] - 1,
                           "peak": memory.peak / got["peak"] - 1}  # fmt: skip
            if ep == 1:
                assert memory.activations == got["saved_activations"], where
    print(json.dumps(gaps, indent=1))
    assert all(abs(g["peak"]) <= 0.15 and abs(g["activations"]) <= 0.15
               for g in gaps.values()), gaps  # fmt: skip
