"""`unmask plan`'s pieces: the shards come from the run's own parallelize code (a changed
rule changes the plan), shard shapes and traffic against hand formulas, refusals."""

import math
from dataclasses import replace

import pytest

import unmask.train.setup as train_setup
from unmask.config import load_config
from unmask.errors import InputError
from unmask.models.families import FAMILIES
from unmask.models.moe import SparseMoE
from unmask.parallel.dims import ParallelDims
from unmask.parallel.pipeline_plan import PipelinePlan
from unmask.plan.devices import DEVICES, resolve_device
from unmask.plan.memory import StepShape, activation_bytes, in_flight, state_bytes
from unmask.plan.memory_models import memory_terms
from unmask.plan.planner import (
    bubble_fraction,
    make_run_plan,
    newton_schulz_flops,
    step_shape,
)
from unmask.plan.report import refusal
from unmask.plan.shards import planned_model_config, shard_model
from unmask.plan.traffic import step_collectives

TINY = [
    "model.model_type=qwen3_dllm", "model.vocab_size=96", "model.hidden_size=64",
    "model.intermediate_size=128", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2",
    "data.packing_length=32", "train.per_device_train_batch_size=2", "train.max_steps=10",
    "optim.name=muon",
]  # fmt: skip


def tiny(*overrides: str):
    return planned_model_config(load_config(None, [*TINY, *overrides]))


MOE = ["model.model_type=qwen3_moe_dllm", "model.num_experts=4", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=16"]  # fmt: skip


def tiny_moe(*overrides: str):
    return tiny(*MOE, *overrides)


PP = ["model.tie_word_embeddings=false", "eval.generate_accuracy=false"]


def tiny_pp(*overrides: str):
    return tiny(*PP, *overrides)


def shapes(model) -> dict[str, tuple]:
    return {s.name: s.local_shape for s in model.shards}


def test_fsdp_tp_shard_shapes_follow_the_formulas():
    # dp_shard 2 x tp 2 at world 4: column-parallel rows / tp then / dp_shard, row-parallel
    # columns / tp and rows / dp_shard, the vocab-parallel embedding rows / tp then
    # / dp_shard, the rest rows / dp_shard (torch.chunk: ceil first)
    model = shard_model(tiny("parallel.tensor_parallel=2"), 4, rank=0)
    got = shapes(model)
    h, inter, q, kv, vocab = 64, 128, 64, 32, 96
    assert got["model.layers.0.self_attn.q_proj.weight"] == (q // 2 // 2, h)
    assert got["model.layers.0.self_attn.k_proj.weight"] == (kv // 2 // 2, h)
    assert got["model.layers.0.mlp.gate_proj.weight"] == (inter // 2 // 2, h)
    assert got["model.layers.0.self_attn.o_proj.weight"] == (h // 2, q // 2)
    assert got["model.layers.0.mlp.down_proj.weight"] == (h // 2, inter // 2)
    assert got["model.embed_tokens.weight"] == (vocab // 2 // 2, h)
    assert got["model.layers.0.self_attn.q_norm.weight"] == (16 // 2,)
    assert model.layout == ParallelDims(1, 2, 1, 2)


def test_uneven_shards_last_rank_holds_less():
    # vocabulary 97 over 4 ranks: torch.chunk gives 25, 25, 25, 22 rows (the head is tied)
    cfg = tiny("model.vocab_size=97")
    rows = [shapes(shard_model(cfg, 4, rank=r))["model.embed_tokens.weight"][0] for r in range(4)]
    assert rows == [25, 25, 25, 22]


def test_state_bytes_follow_the_optimizer_rules():
    # one process, Muon: every 2-D hidden matrix one float32 momentum, the rest AdamW
    # (two float32 moments and a 4-byte step each); gradients as the parameters
    model = shard_model(tiny(), 1)
    params, grads, optim = state_bytes(model)
    total = sum(math.prod(s.global_shape) for s in model.shards)
    muon = sum(math.prod(s.global_shape) for s in model.shards if s.optimizer == "muon")
    adamw = [s for s in model.shards if s.optimizer == "adamw"]
    assert params == grads == 4 * total
    assert optim == 4 * muon + sum(8 * math.prod(s.global_shape) + 4 for s in adamw)
    hidden = {s.name for s in model.shards if s.optimizer == "muon"}
    assert "model.layers.1.mlp.down_proj.weight" in hidden
    assert "model.embed_tokens.weight" not in hidden


def test_a_changed_tensor_parallel_rule_changes_the_plan(monkeypatch):
    cfg = tiny("parallel.tensor_parallel=2")
    before = shapes(shard_model(cfg, 2))
    assert before["model.layers.0.mlp.up_proj.weight"] == (64, 64)  # column-parallel
    # the rule the trainer applies (the family's declaration), changed: up_proj not split
    family = FAMILIES[cfg.model.model_type]
    tensor = family.shape.tensor
    tensor = replace(tensor, colwise=tuple(n for n in tensor.colwise if n != "mlp.up_proj"))
    monkeypatch.setitem(FAMILIES, family.name,
                        replace(family, shape=replace(family.shape, tensor=tensor)))  # fmt: skip
    after = shapes(shard_model(cfg, 2))
    assert after["model.layers.0.mlp.up_proj.weight"] == (128, 64)
    assert after["model.layers.0.mlp.gate_proj.weight"] == (64, 64)


def test_a_changed_fsdp_unit_list_changes_the_collectives(monkeypatch):
    cfg = tiny()
    shape = StepShape(rows=2, length=32, micro_batches=1, bf16=False, checkpointing=False)
    calls = [c.calls for c in step_collectives(shard_model(cfg, 2), shape, 1)
             if c.kind == "all-gather"]  # fmt: skip
    assert calls == [2 * 3]  # the root and each layer, before forward and backward
    real = train_setup.decoder_layers
    monkeypatch.setattr(train_setup, "decoder_layers", lambda model: real(model)[:1])
    model = shard_model(cfg, 2)
    calls = [c.calls for c in step_collectives(model, shape, 1) if c.kind == "all-gather"]
    assert calls == [2 * 2]  # layer 1 now belongs to the root unit


def test_traffic_against_hand_counts():
    cfg = tiny("parallel.tensor_parallel=2", "train.bf16=true")
    model = shard_model(cfg, 4)
    shape = StepShape(rows=2, length=32, micro_batches=1, bf16=True, checkpointing=False)
    by_kind = {(c.dim, c.kind): c for c in step_collectives(model, shape, nodes=1)}
    tp = by_kind[("tp", "all-reduce")]
    # two forward, two backward per layer; the embedding's output; the vocab-parallel
    # loss's max and sums (one block of the 32 masked rows) and the rows' gradient
    assert tp.calls == 4 * 2 + 1 + 2 + 1
    masked = 2 * 32 // 2  # StepShape's default masked_fraction 0.5
    activations = (4 * 2 + 1) * 2 * 32 * 64 * 2  # rows x length x h x bf16
    assert tp.tensor_bytes == activations + masked * (3 + 64) * 4  # float32
    assert tp.wire_bytes == tp.tensor_bytes  # 2 (g - 1) / g with g = 2
    gather = by_kind[("dp_shard_cp", "all-gather")]
    gathered = sum(s.gathered_numel for s in model.shards)
    assert gather.tensor_bytes == 2 * gathered * 2  # every unit twice, in bf16
    muon = by_kind[("dp_shard_cp+tp", "all-to-all")]
    local_muon = sum(s.local_numel for s in model.shards if s.optimizer == "muon")
    assert muon.tensor_bytes == 2 * local_muon * 2 and muon.group == 4


def test_refusals_are_one_line():
    with pytest.raises(InputError, match=r"--device 'h1000' is not a device .*did you mean 'h100'"):
        resolve_device("h1000")
    with pytest.raises(InputError, match="does not divide the world size 6"):
        make_run_plan(tiny("parallel.tensor_parallel=4", "model.num_attention_heads=4",
                           "model.num_key_value_heads=4"), 6, DEVICES["h100"])  # fmt: skip
    with pytest.raises(InputError, match="--nodes 3 does not divide --world 4"):
        make_run_plan(tiny(), 4, DEVICES["h100"], nodes=3)
    # the trainer's own pipeline checks (train/setup.py, parallel/pipeline_plan.py)
    with pytest.raises(InputError, match="tie_word_embeddings makes them one matrix"):
        make_run_plan(tiny("parallel.pipeline_parallel=2", "model.tie_word_embeddings=true"), 4,
                      DEVICES["h100"])  # fmt: skip
    with pytest.raises(
        InputError,
        match="num_hidden_layers=2 is fewer than the parallel.pipeline_parallel=4 stages",
    ):
        make_run_plan(tiny_moe(*PP, "parallel.pipeline_parallel=4"), 4, DEVICES["h100"])
    with pytest.raises(InputError, match=r"expert_parallel=4 does not divide the data-parallel "
                                         r"x context ranks \(2\)"):  # fmt: skip
        make_run_plan(tiny_moe(*PP, "parallel.pipeline_parallel=2", "parallel.expert_parallel=4"), 4,
                      DEVICES["h100"])  # fmt: skip
    with pytest.raises(
        InputError,
        match="num_hidden_layers=2 is fewer than the parallel.pipeline_parallel=4 stages",
    ):
        make_run_plan(tiny_pp("parallel.pipeline_parallel=4"), 4, DEVICES["h100"])
    # the trainer's own tensor-parallel checks (parallel/tensor.py)
    with pytest.raises(
        InputError,
        match="parallel.tensor_parallel=2 splits the LM head by "
        "vocabulary, which model.loss_implementation=full",
    ):
        make_run_plan(tiny("parallel.tensor_parallel=2", "model.loss_implementation=full"), 2,
                      DEVICES["h100"])  # fmt: skip
    # the trainer's own expert-parallel checks (parallel/expert.py)
    with pytest.raises(InputError, match="expert_parallel=2 needs a mixture-of-experts model"):
        make_run_plan(tiny("parallel.expert_parallel=2"), 4, DEVICES["h100"])
    with pytest.raises(
        InputError, match="num_experts=4 is not divisible by parallel.expert_parallel=3"
    ):
        make_run_plan(tiny_moe("parallel.expert_parallel=3"), 6, DEVICES["h100"])


def test_a_layout_that_does_not_fit_names_its_largest_term_and_the_fix():
    cfg_overrides = ("train.per_device_train_batch_size=64", "data.packing_length=4096",
                     "model.max_position_embeddings=4096")  # fmt: skip
    cfg = load_config(None, [*TINY, *cfg_overrides])
    small = DEVICES["h100"].__class__(**{**DEVICES["h100"].__dict__, "memory_bytes": 3e8})
    plan = make_run_plan(cfg, 2, small)
    assert not plan.fits
    line = refusal(plan, cfg)
    assert "\n" not in line
    assert "largest term is activations" in line
    assert line.endswith("set train.activation_checkpointing=full")


def test_expert_parallel_shard_shapes_follow_the_formulas():
    # ep 2 over dp_shard 4 at world 4 (parallel/expert.py): each expert stack [E / ep, ...]
    # on every rank, replicated over the 2 replicas and left out of FSDP2; the rest rows /
    # dp_shard (the router's 4 rows: one per rank)
    model = shard_model(tiny_moe("parallel.expert_parallel=2"), 4, rank=3)
    got = {s.name: s for s in model.shards}
    experts, inner, h = 4, 16, 64
    for name, shape in (
        ("gate_proj", (inner, h)),
        ("up_proj", (inner, h)),
        ("down_proj", (h, inner)),
    ):
        stack = got[f"model.layers.1.mlp.experts.{name}"]
        assert stack.local_shape == (experts // 2, *shape)
        assert stack.mesh_dims == ("ep_replica", "ep") and stack.placements == ("R", "S(0)")
        assert stack.expert_parallel and stack.shard_group == 1
    assert got["model.layers.1.mlp.gate.weight"].local_shape == (experts // 4, h)
    assert got["model.layers.1.self_attn.q_proj.weight"].local_shape == (64 // 4, h)
    # bytes: the stacks whole on the rank (float32), the rest a quarter
    params, _, _ = state_bytes(model)
    stacks = 2 * 3 * (experts // 2) * inner * h
    rest = sum(s.local_numel for s in model.shards if not s.expert_parallel)
    assert params == 4 * (stacks + rest)


def test_a_changed_expert_parallel_rule_changes_the_plan(monkeypatch):
    cfg = tiny_moe("parallel.expert_parallel=2")
    assert shapes(shard_model(cfg, 4))["model.layers.0.mlp.experts.down_proj"] == (2, 64, 16)
    # the trainer's rule changed: down_proj no longer split over ep, so FSDP2 shards it
    monkeypatch.setattr(SparseMoE, "expert_stacks", ("experts.gate_proj", "experts.up_proj"))
    after = shard_model(cfg, 4)
    assert shapes(after)["model.layers.0.mlp.experts.down_proj"] == (1, 64, 16)
    assert shapes(after)["model.layers.0.mlp.experts.up_proj"] == (2, 16, 64)


def test_expert_parallel_traffic_against_hand_counts():
    # ep 2 over dp_shard 4, bf16: per MoE layer and micro-batch the routed rows go there
    # and come back in bfloat16 (autocast), forward and backward, plus the counts; the
    # replicas' float32 expert
    # gradients all-reduced once; FSDP2 gathers everything but the stacks
    model = shard_model(tiny_moe("parallel.expert_parallel=2", "train.bf16=true"), 4)
    shape = StepShape(rows=2, length=32, micro_batches=1, bf16=True, checkpointing=False)
    by_kind = {(c.dim, c.kind): c for c in step_collectives(model, shape, nodes=1)}
    rows = 2 * 32 * 2  # tokens x top-k
    a2a = by_kind[("ep", "all-to-all")]
    assert a2a.tensor_bytes == 2 * (2 * rows * 64 * (2 + 2) + 4 * 8) and a2a.group == 2
    assert a2a.calls == 2 * 5  # counts, there, back; backward: back, there
    reduce = by_kind[("ep_replica", "all-reduce")]
    assert reduce.tensor_bytes == 2 * 3 * 2 * 16 * 64 * 4 and reduce.group == 2
    gather = by_kind[("dp_shard_cp", "all-gather")]
    assert gather.tensor_bytes == 2 * 2 * sum(s.gathered_numel for s in model.shards
                                              if not s.expert_parallel)  # fmt: skip
    # Muon's owner all-to-all carries the 2-D matrices only: the stacks are orthogonalized
    # where they are (optim/distributed.py)
    muon = by_kind[("dp_shard_cp", "all-to-all")]
    matrices = sum(s.local_numel for s in model.shards
                   if s.optimizer == "muon" and len(s.global_shape) == 2)  # fmt: skip
    assert muon.tensor_bytes == 2 * matrices * 2
    assert matrices == sum(s.local_numel for s in model.shards if "self_attn" in s.name
                           and s.name.endswith("proj.weight"))  # fmt: skip


def pp4(*overrides: str):
    return tiny_pp("model.num_hidden_layers=4", "parallel.pipeline_parallel=2",
                   "train.per_device_train_batch_size=4", *overrides)  # fmt: skip


def test_pipeline_ranks_hold_their_stages_shards():
    # pp 2 x dp_shard 2 at world 4 (pp outermost: ranks 0, 1 hold stage 0, ranks 2, 3
    # stage 1): layers 0-1 + the embedding, layers 2-3 + norm and head, each FSDP2-sharded
    # over its 2 dp_shard ranks
    first, last = shard_model(pp4(), 4, rank=1), shard_model(pp4(), 4, rank=2)
    assert first.layer_indices == (0, 1) and last.layer_indices == (2, 3)
    assert first.stages == [0] and last.stages == [1] and last.holds_head
    a, b = shapes(first), shapes(last)
    assert a["model.embed_tokens.weight"] == (96 // 2, 64) and "lm_head.weight" not in a
    assert b["lm_head.weight"] == (96 // 2, 64) and "model.embed_tokens.weight" not in b
    assert a["model.layers.1.mlp.gate_proj.weight"] == (128 // 2, 64)
    assert b["model.layers.3.self_attn.o_proj.weight"] == (64 // 2, 64)
    assert not any(".layers.2." in n for n in a) and not any(".layers.0." in n for n in b)
    # the whole model's FLOPs on every rank (the step's), not the stage's
    assert first.flops == last.flops == shard_model(tiny_pp("model.num_hidden_layers=4"), 1).flops


def test_a_changed_pipeline_rule_changes_the_plan(monkeypatch):
    cfg = pp4("parallel.pipeline_schedule=interleaved_1f1b", "parallel.pipeline_stages_per_rank=2",
              "parallel.pipeline_microbatches=4")  # fmt: skip
    assert shard_model(cfg, 2, rank=0).layer_indices == (0, 2)  # looped: stages 0 and 2
    # the trainer's stage placement changed: rank r holds stages 2r, 2r + 1
    monkeypatch.setattr(PipelinePlan, "stages_of",
                        lambda self, r: [r * self.stages_per_rank + k
                                         for k in range(self.stages_per_rank)])  # fmt: skip
    model = shard_model(cfg, 2, rank=0)
    assert model.layer_indices == (0, 1) and not model.holds_head
    assert "lm_head.weight" in shapes(shard_model(cfg, 2, rank=1))


def test_pipeline_in_flight_p2p_and_bubble_against_hand_counts():
    # 1F1B, p 2, m 4 micro-batches of 1 row: rank 0 holds 2 micro-batches' saves at its
    # peak (and the step's ids), the last rank 1 (and the loss scale, a 0-d float32); each micro-batch's hidden states (1 x 32 x 64 float32) go
    # forward from stage 0 and their gradients back from stage 1; bubble (p-1)/(m+p-1)
    cfg = pp4("parallel.pipeline_microbatches=4")
    shape = step_shape(cfg, 4)
    assert (shape.rows, shape.micro_batches) == (1, 4)
    first, last = shard_model(cfg, 4, rank=0), shard_model(cfg, 4, rank=3)
    assert in_flight(first) == 2 and in_flight(last) == 1
    one = activation_bytes(first, shape)  # the step's ids: one storage of 4 x 32 tokens
    assert memory_terms(first, shape).activations == 2 * one + 4 * 32 * 8
    assert memory_terms(last, shape).activations == activation_bytes(last, shape) + 4
    send = {c.dim: c for c in step_collectives(first, shape, 1)}["pp"]
    assert (send.calls, send.tensor_bytes, send.wire_bytes) == (4, 4 * 32 * 64 * 4, 4 * 32 * 64 * 4)
    assert bubble_fraction(first, shape.length) == pytest.approx(1 / 5)
    plan = make_run_plan(cfg, 4, DEVICES["h100"])
    assert plan.step_s == pytest.approx(
        plan.compute_s / (1 - 1 / 5) + plan.optimizer_s + plan.exposed_comm_s
    )
    # GPipe: every micro-batch's forward first; interleaved 1F1B (v 2): warm-up chunks
    gpipe = shard_model(pp4("parallel.pipeline_schedule=gpipe"), 4, rank=0)
    assert in_flight(gpipe) == 4
    inter = shard_model(pp4("parallel.pipeline_schedule=interleaved_1f1b",
                            "parallel.pipeline_stages_per_rank=2"), 2, rank=0)  # fmt: skip
    assert in_flight(inter) == min(4 * 2, (2 - 1) * 2 + 2 * (2 - 1) + 1) / 2
    assert bubble_fraction(inter, shape.length) == pytest.approx(1 / (4 * 2 + 1))
    # zero bubble (v 2): the passes' FLOPs per token and layer, the attention scores'
    # backward (8 x width x length) in the input pass, every weight 2 in each pass
    zb = shard_model(pp4("parallel.pipeline_schedule=zero_bubble",
                         "parallel.pipeline_stages_per_rank=2"), 2, rank=0)  # fmt: skip
    m = zb.model_config
    width = m.num_attention_heads * m.resolved_head_dim
    weights = (2 * m.hidden_size * width + 2 * m.hidden_size * m.num_key_value_heads
               * m.resolved_head_dim + 3 * m.hidden_size * m.intermediate_size)  # fmt: skip
    scores = 4 * width * shape.length
    f, i, w = 2 * weights + scores, 2 * weights + 2 * scores, 2 * weights
    drain = (2 - 1) * (f + i - w)
    assert bubble_fraction(zb, shape.length) == pytest.approx(drain / (4 * 2 * (f + i + w) + drain))
    assert bubble_fraction(zb, shape.length) > 1 / (3 * 4 * 2 + 1)  # the equal-pass formula
    # what its memory estimate leaves out is said, under zero bubble only
    zb_cfg = pp4("parallel.pipeline_schedule=zero_bubble", "parallel.pipeline_stages_per_rank=2")
    said = [n for n in make_run_plan(zb_cfg, 2, DEVICES["h100"]).notes if "zero bubble" in n]
    assert said == ["zero bubble: each linear layer and norm holds its input and output "
                    "gradient from a micro-batch's input pass to its weight pass; the memory "
                    "estimate leaves them out (about one micro-batch's saved activations of "
                    "the stage per weight pass not yet run)"]  # fmt: skip
    assert not [n for n in plan.notes if "zero bubble" in n]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"])
def test_the_last_stage_holds_one_micro_batchs_head_gradients(schedule, monkeypatch):
    # the fused loss makes the head's gradients in the forward, and the last stage's
    # backward of that micro-batch runs next (test_pipeline_plan.py checks torch's orders;
    # GPipe's chunked loss makes them in its backward): whatever the micro-batches in flight
    # on the rank (1.5 under the interleaved schedules at p 2, v 2), one micro-batch's
    # head gradients are in the peak, here made larger than everything else
    import unmask.plan.memory as memory

    per_rank = ("parallel.pipeline_stages_per_rank=2",) if schedule in (
        "interleaved_1f1b", "zero_bubble") else ()  # fmt: skip
    cfg = pp4(f"parallel.pipeline_schedule={schedule}", *per_rank)
    last = shard_model(cfg, 2, rank=1)
    assert last.holds_head
    shape = step_shape(cfg, 2)
    sentinel = 10**15
    peaks = []
    for extra in (sentinel, 2 * sentinel):  # both peaks where the head's gradients are
        monkeypatch.setattr(memory, "head_gradient_bytes", lambda model, shape, e=extra: e)
        peaks.append(memory_terms(last, shape).peak)
    assert peaks[1] - peaks[0] == sentinel


def test_expert_stacks_that_do_not_fit_are_told_the_expert_parallel_that_fixes_it():
    # 64 experts of 64 x 256 over ep 2 at world 4: each rank holds 32 whole experts per
    # layer (their state is not sharded by FSDP2, so more ranks alone do not help)
    cfg = tiny_moe("model.num_experts=64", "model.moe_intermediate_size=256",
                   "parallel.expert_parallel=2")  # fmt: skip
    plan = make_run_plan(cfg, 4, DEVICES["h100"])
    memory = plan.ranks[0].memory
    stacks = 2 * 3 * 32 * 256 * 64 * 4  # two layers, float32
    assert memory.experts == stacks * 3  # parameters, gradients, Muon's momentum
    small = DEVICES["h100"].__class__(**{**DEVICES["h100"].__dict__,
                                         "memory_bytes": (memory.peak - stacks) / 0.9})  # fmt: skip
    plan = make_run_plan(cfg, 4, small)
    assert not plan.fits
    line = refusal(plan, cfg)
    assert line.endswith("set parallel.expert_parallel=4 (each rank holds 1/2 of the expert "
                         "stacks' parameters, gradients and optimizer state)"), line  # fmt: skip


def test_the_objective_entry_sets_the_head_share_and_the_dense_mask():
    # ar (its registry entry: head_share 1, an explicit causal mask): on a GPU the plan runs
    # the head on every token and counts sdpa's copy of the dense (B, 1, L, L) mask per
    # layer, which an mdlm plan on a GPU (flex's block mask) does not
    mdlm = make_run_plan(tiny(), 2, DEVICES["h100"])
    ar = make_run_plan(tiny("diffusion.objective=ar"), 2, DEVICES["h100"])
    tokens, h, vocab, layers = 2 * 32 * 2, 64, 96, 2
    assert ar.flops_per_step - mdlm.flops_per_step == 6 * h * vocab * tokens / 2
    mask_copy = 2 * 32 * 32 * 4  # rows x L x L, float32 (no bf16 here), per layer
    gap = ar.ranks[0].memory.activations - mdlm.ranks[0].memory.activations
    assert gap == layers * mask_copy


def test_the_full_logits_loss_adds_its_saves_by_hand():
    # model.loss_implementation full on 2 ranks (FSDP2, float32): the head's input (T h 4),
    # the log-softmax (T V 4), the targets and weights (T 12) and the 0-d total weight
    # replace the chunked loss's row mask (T 1); its backward holds T V 8 more (the
    # gradients of the log-softmax's output and input) beside them
    chunked = make_run_plan(tiny(), 2, DEVICES["h100"]).ranks[0].memory
    full = make_run_plan(tiny("model.loss_implementation=full"), 2, DEVICES["h100"])
    memory = full.ranks[0].memory
    tokens, h, vocab = 2 * 32, 64, 96
    saves = tokens * (h * 4 + vocab * 4 + 8 + 4) + 4
    assert memory.activations - chunked.activations == saves - tokens
    state = memory.parameters + memory.optimizer
    assert memory.peak >= state + memory.activations + tokens * vocab * 8


def test_the_optimizer_term_is_muons_newton_schulz_by_hand():
    # 2 layers of q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128; five
    # steps of 4 n^2 m + 2 n^3 (n the short side): 58,327,040 FLOPs a layer
    per_layer = 2 * 5 * 6 * 64**3 + 2 * 5 * (4 * 32**2 * 64 + 2 * 32**3)
    per_layer += 3 * 5 * (4 * 64**2 * 128 + 2 * 64**3)
    assert per_layer == 58_327_040
    h100 = DEVICES["h100"]
    plan = make_run_plan(tiny(), 1, h100)
    assert plan.optimizer_flops == 2 * per_layer
    assert plan.optimizer_s == pytest.approx(2 * per_layer / (h100.peak(True) * plan.mfu))
    assert plan.step_s == pytest.approx(plan.compute_s + plan.optimizer_s + plan.exposed_comm_s)
    assert make_run_plan(tiny("optim.name=adamw"), 1, h100).optimizer_flops == 0
    # FSDP2 over 2: each rank's share of every matrix; the two shares add up to the whole
    cfg = tiny()
    shares = [newton_schulz_flops(shard_model(cfg, 2, rank=r), cfg) for r in (0, 1)]
    assert sum(shares) == pytest.approx(2 * per_layer)
    assert shares[0] == pytest.approx(per_layer)


def test_the_fused_loss_block_is_the_devices_and_held_at_the_forwards_end():
    """The fused loss's block (diffusion/loss.py loss_block_elements) taken by device: the
    CPU's 4096 x 8192 logits, 2^28 on a GPU; at vocabulary 126,464 and 2 x 4096 tokens
    (4096 masked) that is 256 rows on a CPU and 2048 on an H200, each row float32 logits
    and under bf16 their bfloat16 copy; the forward's end holds it with the head's
    gradients, so the plans' peaks differ by the blocks' difference."""
    from unmask.plan.memory import loss_block_bytes
    from unmask.plan.planner import run_shape

    cfg = tiny("model.vocab_size=126464", "data.packing_length=4096", "train.bf16=true")
    model = shard_model(cfg, 1, rank=0)
    cpu, h200 = (run_shape(cfg, 1, resolve_device(d), 0.5) for d in ("cpu", "h200"))
    assert (cpu.loss_block, h200.loss_block) == (4096 * 8192, 1 << 28)
    assert loss_block_bytes(model, cpu) == 256 * 126_464 * 6
    assert loss_block_bytes(model, h200) == 2048 * 126_464 * 6
    peaks = [memory_terms(model, shape).peak for shape in (cpu, h200)]
    assert peaks[1] - peaks[0] == (2048 - 256) * 126_464 * 6


def test_pipeline_selective_checkpointing_plans_the_layers_the_model_recomputes():
    # selective checkpointing counts the whole model's layers (0, n, 2n, ...), also on a
    # pipeline rank: pp 2 over 6 layers, every 2nd: rank 1 holds layers 3, 4, 5 and
    # recomputes layer 4 only (not the rank's first and third, 3 and 5)
    from unmask.models.build import build_model
    from unmask.plan.memory import layer_saves
    from unmask.plan.traffic import _checkpointed_layers

    cfg = tiny_pp("model.num_hidden_layers=6", "parallel.pipeline_parallel=2",
                  "train.per_device_train_batch_size=4",
                  "train.activation_checkpointing=selective",
                  "train.activation_checkpointing_every=2")  # fmt: skip
    model = shard_model(cfg, 2, rank=1)
    assert model.layer_indices == (3, 4, 5)
    shape = step_shape(cfg, 2)
    assert shape.checkpointing == 2
    runtime = build_model(cfg.model)
    runtime.gradient_checkpointing = shape.checkpointing
    assert [runtime.checkpoints(i) for i in model.layer_indices] == [False, True, False]
    kept, held, _ = layer_saves(model, shape)
    input_only = min(kept)  # a checkpointed layer keeps only its input
    assert [k == input_only for k in kept] == [False, True, False]
    assert kept[0] == kept[2] > kept[1]
    assert _checkpointed_layers(model, shape.checkpointing) == 1
