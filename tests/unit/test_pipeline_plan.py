"""Pipeline parallelism's plan and its bad input: the stages' layers, the micro-batch count,
and every refusal as one line with exit code 2 before any process group is opened.

The CLI cases run `unmask train` in this process with a launcher's environment for two
processes (WORLD_SIZE=2) but no rendezvous address: a run that got as far as opening the
process group would fail there with a traceback (exit code 1), not with the one line.
"""

import pytest

from unmask.cli import main
from unmask.errors import InputError
from unmask.parallel.pipeline_plan import (
    LayerCosts,
    PipelinePlan,
    balanced_split,
    balancing_notice,
    bubble_formula,
    layer_costs,
    plan_pipeline,
    schedule_idle,
)
from unmask.parallel.schedules import PIPELINE_SCHEDULES

pytestmark = pytest.mark.usefixtures("one_thread")


def equal(layers: int, embedding: float = 0.0, head: float = 0.0) -> LayerCosts:
    """Layers of cost 1 each, the embedding and the head costing what is given."""
    return LayerCosts((1.0,) * layers, embedding, head)


def test_equal_layers_split_evenly_into_consecutive_stages():
    plan = plan_pipeline(2, "1f1b", 1, None, None, equal(4), rows=8)
    assert plan.layers == ((0, 1), (2, 3))
    assert plan.microbatches == 8  # default: one per row of the step
    assert plan.stages_of(0) == [0] and plan.stages_of(1) == [1]
    assert plan.costs == (2.0, 2.0) and plan.shares == (0.5, 0.5)


def test_interleaved_stages_loop_over_the_ranks():
    plan = plan_pipeline(2, "interleaved_1f1b", 2, 4, None, equal(8), rows=8)
    assert plan.layers == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.stages_of(0) == [0, 2] and plan.stages_of(1) == [1, 3]
    assert [plan.owner(s) for s in range(4)] == [0, 1, 0, 1]


def test_a_head_that_costs_k_layers_takes_k_layers_off_the_last_stage():
    # 10 layers + a head of 2 layers = 12: 6 and 4 + head; interleaved, 14 + 2 = 16 over 4
    # stages: 4, 4, 4 and 2 + head
    assert balanced_split(equal(10, head=2.0), 2) == [6, 4]
    plan = plan_pipeline(2, "interleaved_1f1b", 2, 4, None, equal(14, head=2.0), rows=8)
    assert [len(layers) for layers in plan.layers] == [4, 4, 4, 2]
    assert plan.costs == (4.0, 4.0, 4.0, 4.0)
    # an embedding of 1 layer takes one off the first stage, both ends at once
    assert balanced_split(equal(10, embedding=1.0, head=1.0), 2) == [5, 5]
    assert balanced_split(equal(10, embedding=1.0, head=3.0), 3) == [3, 5, 2]
    # whole layers: the largest stage as small as they allow (5 and 4 + 1.5, not 6 and
    # 3 + 1.5), then the smallest sum of squares (2, 2, 3 rather than 3, 1, 3: both reach 3)
    assert balanced_split(equal(9, head=1.5), 2) == [5, 4]
    assert balanced_split(LayerCosts((1.0, 1.0, 1.0, 1.0, 3.0), 0.0, 0.0), 3) == [2, 2, 1]
    # a head heavier than an even share: the last stage keeps its one layer
    assert balanced_split(equal(4, head=10.0), 2) == [3, 1]
    # unequal layers (MoE after a dense one): the cut follows the costs
    assert balanced_split(LayerCosts((1.0, 3.0, 3.0, 1.0, 1.0, 1.0), 0.0, 0.0), 2) == [2, 4]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 stages"):
        balanced_split(equal(3), 4)


def test_layer_costs_of_a_model_in_flops_per_token():
    from unmask.models.config import ModelConfig

    # hidden 64, 4 heads of 16 (q, o: 64 x 64), 2 key/value heads (k, v: 64 x 32), SwiGLU
    # 192, rows of 32 tokens: 6 x (2 x 4096 + 2 x 2048 + 3 x 64 x 192) + 12 x 64 x 32
    cfg = ModelConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=10,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=3200)  # fmt: skip
    costs = layer_costs(cfg, 32, head_share=0.5)
    layer = 6 * (2 * 4096 + 2 * 2048 + 3 * 64 * 192) + 12 * 64 * 32
    assert costs.layers == (layer,) * 10 and layer == 319488
    assert costs.embedding == 2 * 64
    # the norm, then half the tokens through the fused head: 3 passes of 2 x (64 + 1) x 3200
    assert costs.head == 12 * 64 + 0.5 * 3 * 2 * 65 * 3200 == 624768  # 1.96 layers
    assert balanced_split(costs, 2) == [6, 4]
    # GPipe's chunked loss makes the head's gradients in its backward (logits recomputed):
    # 4 passes, 2.61 layers
    chunked = layer_costs(cfg, 32, head_share=0.5, head_loss="chunked")
    assert chunked.head == 12 * 64 + 0.5 * 4 * 2 * 65 * 3200 and chunked.layers == costs.layers
    assert balanced_split(chunked, 2) == [6, 4]
    fused = ("1f1b", "interleaved_1f1b", "zero_bubble")
    assert {PIPELINE_SCHEDULES[s].head_loss for s in fused} == {"fused"}
    assert PIPELINE_SCHEDULES["gpipe"].head_loss == "chunked"
    # an MoE layer: its active weights (router 8 x 64, top-2 of 8 experts of 32, one shared
    # expert of 32); the dense first layer keeps its SwiGLU of 192
    moe = ModelConfig(model_type="llada2_moe", hidden_size=64, intermediate_size=192,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      num_shared_experts=1, first_k_dense_replace=1, vocab_size=128)  # fmt: skip
    moe_costs = layer_costs(moe, 32, head_share=1.0)
    attention = 6 * (2 * 4096 + 2 * 2048) + 12 * 64 * 32
    active = 8 * 64 + 2 * 3 * 32 * 64 + 3 * 64 * 32
    assert moe_costs.layers == (attention + 6 * 3 * 64 * 192, attention + 6 * active,
                                attention + 6 * active)  # fmt: skip


@pytest.mark.parametrize("model", ["qwen3_dllm", "llada2_moe"])
def test_layer_costs_are_the_mfu_flops_of_the_layers(model):
    # the split's per-token cost of the layers is the MFU's step FLOPs without the head
    # (train/mfu.py, read from the built model), per token
    from unmask.models import build_model
    from unmask.models.config import ModelConfig
    from unmask.train.mfu import flop_model

    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "num_shared_experts": 1, "first_k_dense_replace": 1}  # fmt: skip
    moe = moe if model == "llada2_moe" else {}
    cfg = ModelConfig(model_type=model, hidden_size=64, intermediate_size=192,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=128, **moe)  # fmt: skip
    length = 48
    flops = flop_model(build_model(cfg)).step_flops(length, length, 0)
    assert sum(layer_costs(cfg, length, head_share=0.5).layers) == flops / length


def test_split_by_hand_and_the_start_up_line():
    plan = plan_pipeline(2, "gpipe", 1, 2, [3, 1], equal(4, head=1.0), rows=8)
    assert plan.layers == ((0, 1, 2), (3,))
    assert plan.describe() == (
        "pipeline: 2 stages over 2 ranks, gpipe, 2 micro-batches per step, split by "
        "parallel.pipeline_split (share of the forward + backward FLOPs per token); stage 0 (pp "
        "rank 0): layers 0-2 + embeddings (60.0%); stage 1 (pp rank 1): layer 3 + norm + head "
        "(40.0%)"
    )
    assert isinstance(plan, PipelinePlan)
    cut = plan_pipeline(2, "gpipe", 1, 2, None, equal(4, head=1.0), rows=8)
    assert cut.layers == ((0, 1), (2, 3)) and not cut.by_hand
    assert cut.describe().startswith(
        "pipeline: 2 stages over 2 ranks, gpipe, 2 micro-batches per step, split by estimated "
        "cost (share of the forward + backward FLOPs per token); stage 0 (pp rank 0): layers "
        "0-1 + embeddings (40.0%); stage 1"
    )


def torch_order(schedule: str, p: int, v: int, m: int) -> dict:
    """torch's own action order of `schedule` for every rank ({rank: [(stage, kind, mb)]}):
    the schedule's pipeline_order, built under a fake process group (no peers). 1F1B's as
    its step runs it (Schedule1F1B._step_microbatches: min(m, p - r) forwards, then a
    backward and a forward in turn, then the backwards left); its pipeline_order, drawn for
    torch's visualizer, numbers the last rank's forwards from 1."""
    if schedule == "1f1b":
        order = {}
        for r in range(p):
            warmup = min(m, p - r)
            actions = [(r, "F", i) for i in range(warmup)]
            for i in range(m):
                actions.append((r, "B", i))
                if warmup + i < m:
                    actions.append((r, "F", warmup + i))
            order[r] = actions
        return order
    import torch
    from torch import nn
    from torch.distributed import pipelining

    from unmask.plan.shards import fake_world

    with fake_world(0, p):
        x = torch.zeros(1, 2)
        stages = [pipelining.PipelineStage(nn.Linear(2, 2), s, p * v, torch.device("cpu"),
                                           input_args=x, output_args=x)
                  for s in range(0, p * v, p)]  # fmt: skip
        built = PIPELINE_SCHEDULES[schedule].schedule_class()(
            stages if v > 1 else stages[0], m, loss_fn=lambda out, target: out.sum()
        )
        return {rank: [(a.stage_index, a.computation_type.value, a.microbatch_index)
                       for a in actions if a is not None and a.computation_type.value in "FBIW"]
                for rank, actions in built.pipeline_order.items()}  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "p", "v", "m"),
    [("gpipe", 2, 1, 8), ("1f1b", 2, 1, 8), ("1f1b", 4, 1, 16),
     ("interleaved_1f1b", 2, 2, 8), ("interleaved_1f1b", 4, 2, 8),
     ("zero_bubble", 2, 2, 8), ("zero_bubble", 4, 2, 16), ("zero_bubble", 3, 3, 6)],
)  # fmt: skip
def test_bubble_formula_is_torchs_schedule_with_equal_stages(schedule, p, v, m):
    # every stage's forward 1, backward 2 (input and weight pass 1 each): torch's order
    # idles (p - 1) / (v m + p - 1), zero bubble (p - 1) / (3 v m + p - 1)
    order = torch_order(schedule, p, v, m)
    assert sum(len(actions) for actions in order.values()) == (
        3 if schedule == "zero_bubble" else 2) * p * v * m  # fmt: skip
    costs = {(s, k): c for s in range(p * v) for k, c in (("F", 1), ("B", 2), ("I", 1), ("W", 1))}
    idle = schedule_idle(order, costs)
    assert idle == pytest.approx(bubble_formula(schedule, p, m, v), rel=1e-12)
    work = 3 * v * m if schedule == "zero_bubble" else v * m
    assert idle == pytest.approx((p - 1) / (work + p - 1), rel=1e-12)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 8), (4, 2, 16), (3, 3, 6)])
@pytest.mark.parametrize("passes", [(60, 65, 43), (1, 1.5, 0.5), (1, 2, 1), (1, 0.8, 1.2)])
def test_zero_bubble_formula_at_unequal_passes_is_torchs_schedule(p, v, m, passes):
    # forward, input pass and weight pass costs of every stage (the first as measured on
    # CPU, ms): torch's interleaved zero bubble idles (p-1)(F+I-W) / (vm(F+I+W) + that);
    # a weight pass dearer than the input pass leaves (p-1) F, as with equal passes
    order = torch_order("zero_bubble", p, v, m)
    forward, input_pass, weight_pass = passes
    costs = {(s, k): c for s in range(p * v)
             for k, c in (("F", forward), ("I", input_pass), ("W", weight_pass))}  # fmt: skip
    idle = schedule_idle(order, costs)
    assert idle == pytest.approx(bubble_formula("zero_bubble", p, m, v, passes), rel=1e-12)
    drain = (p - 1) * (forward + max(input_pass - weight_pass, 0))
    assert idle == pytest.approx(drain / (v * m * sum(passes) + drain), rel=1e-12)


@pytest.mark.parametrize(("schedule", "p", "v", "m"),
                         [("1f1b", 2, 1, 8), ("1f1b", 4, 1, 16), ("interleaved_1f1b", 2, 2, 8),
                          ("interleaved_1f1b", 4, 2, 16), ("zero_bubble", 2, 2, 8),
                          ("zero_bubble", 4, 2, 16), ("zero_bubble", 3, 3, 6),
                          ("zero_bubble", 4, 2, 4)])  # fmt: skip
def test_the_last_stage_runs_each_backward_right_after_its_forward(schedule, p, v, m):
    # what lets these schedules' last stage use the fused loss (ScheduleSpec.head_loss) and the plan
    # count one micro-batch's head gradients (plan/memory.py): the gradients its forward
    # makes are taken by the very next action, its backward (zero bubble's input pass)
    assert PIPELINE_SCHEDULES[schedule].head_loss == "fused"
    last = p * v - 1
    actions = torch_order(schedule, p, v, m)[last % p]
    forwards = [i for i, (stage, kind, _) in enumerate(actions) if (stage, kind) == (last, "F")]
    assert len(forwards) == m
    backward = "I" if schedule == "zero_bubble" else "B"
    assert all(actions[i + 1] == (last, backward, actions[i][2]) for i in forwards)


def test_schedule_idle_of_unequal_stages_against_a_hand_count():
    # GPipe, 2 micro-batches, stage 1 twice stage 0 (F 2, B 4 against 1, 2): rank 1 ends
    # its forwards at 5 and its backwards at 13, rank 0's last backward at 15; rank 0 works
    # 6 of them, rank 1 12: the idler rank 0 idles 9 / 15
    order = {0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)],
             1: [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]}  # fmt: skip
    costs = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 2.0, (1, "B"): 4.0}
    assert schedule_idle(order, costs) == pytest.approx(9 / 15)
    with pytest.raises(ValueError, match="cannot run"):
        schedule_idle({0: [(0, "B", 0), (0, "F", 0)]}, {(0, "F"): 1.0, (0, "B"): 2.0})


def test_moe_balancing_line_when_micro_batches_differ_from_accumulation():
    from unmask.models.config import ModelConfig

    moe = ModelConfig(model_type="qwen3_moe_dllm", num_experts=4, num_experts_per_tok=2,
                      router_aux_loss_coef=0.01)  # fmt: skip
    plan = plan_pipeline(2, "1f1b", 1, None, None, equal(2), rows=8)  # 8 micro-batches
    assert balancing_notice(plan, moe, accumulation=2) == (
        "the MoE balancing losses span each of the 8 pipeline micro-batches, not the 2 "
        "gradient-accumulation micro-batches of the run without a pipeline: set "
        "parallel.pipeline_microbatches=2 (when the schedule allows) for the same balancing"
    )
    same = plan_pipeline(2, "1f1b", 1, 2, None, equal(2), rows=8)
    assert balancing_notice(same, moe, accumulation=2) is None
    # no balancing loss (the sigmoid router's bias counts the step's load), or a dense model
    bias_only = moe.model_copy(update={"router_aux_loss_coef": 0.0})
    assert balancing_notice(plan, bias_only, accumulation=2) is None
    assert balancing_notice(plan, ModelConfig(), accumulation=2) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, "1f1b", 1, None, None, 1, 8), "model.num_hidden_layers=1 is fewer than the "
                                           "parallel.pipeline_parallel=2 stages: each stage holds "
                                           "at least one layer; lower parallel.pipeline_parallel"),
        ((2, "zero_bubble", 2, None, None, 3, 8),
         "model.num_hidden_layers=3 is fewer than the parallel.pipeline_parallel=2 x "
         "parallel.pipeline_stages_per_rank=2 = 4 stages: each stage holds at least one layer; "
         "lower parallel.pipeline_parallel or parallel.pipeline_stages_per_rank"),
        ((2, "1f1b", 1, None, [2, 1], 4, 8), "parallel.pipeline_split=[2, 1] must give 2 stages"),
        ((2, "1f1b", 1, None, [4, 0], 4, 8), "at least one layer each"),
        ((4, "1f1b", 1, 2, None, 4, 8), "parallel.pipeline_microbatches=2 is fewer than the 4 "
                                        "pipeline ranks"),
        ((2, "1f1b", 1, 3, None, 4, 8), "parallel.pipeline_microbatches=3 does not divide the 8 "
                                        "rows"),
        ((2, "interleaved_1f1b", 1, None, None, 4, 8), "set parallel.pipeline_stages_per_rank >= 2"),
        ((2, "zero_bubble", 1, None, None, 4, 8), "set parallel.pipeline_stages_per_rank >= 2"),
        ((2, "gpipe", 2, None, None, 4, 8), "runs one stage per rank"),
        ((2, "interleaved_1f1b", 2, 3, None, 8, 12), "a multiple of parallel.pipeline_parallel=2"),
    ],
)  # fmt: skip
def test_plan_refusals_are_one_line(args, message):
    *settings, layers, rows = args
    with pytest.raises(InputError) as err:
        plan_pipeline(*settings, equal(layers), rows)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.fixture
def two_processes(monkeypatch):
    """A launcher's environment for 2 processes without a rendezvous address."""
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


PP2 = {"model": {"num_hidden_layers": 4}, "train": {"pipeline_parallel": 2}}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"model": {"num_hidden_layers": 1}}, "model.num_hidden_layers=1 is fewer than the "
                                              "parallel.pipeline_parallel=2 stages"),
        ({"train": {"pipeline_microbatches": 1}}, "parallel.pipeline_microbatches=1 is fewer than"),
        ({"train": {"pipeline_schedule": "interleaved_1f1b"}},
         "interleaves several stages per rank; set parallel.pipeline_stages_per_rank >= 2"),
        ({"train": {"pipeline_schedule": "1f1b", "pipeline_stages_per_rank": 2}},
         "runs one stage per rank"),
        ({"diffusion": {"objective": "dream", "perbatch_cutoff": True}},
         "needs an objective that says its loss's count before the forward (mdlm, llada, bert, "
         "sft, dream or bd3lm); diffusion.objective 'dream' with these settings (a cutoff draws "
         "the layout) cannot"),
        ({"diffusion": {"objective": "preference"}}, "diffusion.objective 'preference' cannot"),
        ({"model": {"model_type": "bert"}}, "needs a native decoder; model 'bert' is a wrapped "
                                            "transformers model"),
        ({"model": {"tie_word_embeddings": True}}, "model.tie_word_embeddings makes them one "
                                                   "matrix"),
        ({"train": {"context_parallel": 2}}, "does not combine with parallel.context_parallel"),
        ({"diffusion": {"random_length_prob": 0.1}}, "diffusion.random_length_prob=0.1 cuts rows"),
        ({"eval": {"generate_accuracy": True}}, "no sampler runs through the pipeline"),
        ({"diffusion": {"objective": "bd3lm", "block_size": 4,
                        "block_schedule": {"decay": [4], "decay_steps": 1}}},
         "diffusion.adaptation / diffusion.block_schedule change it during the run"),
        ({"model": {"model_type": "qwen3_moe_dllm", "num_experts": 4, "num_experts_per_tok": 2},
          "train": {"expert_parallel": 2}},
         "parallel.expert_parallel=2 does not divide the data-parallel x context ranks (1)"),
        # an MoE model's layers (its dense first_k_dense_replace ones too) count as any
        ({"model": {"model_type": "llada2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1, "num_hidden_layers": 3},
          "train": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b",
                    "pipeline_stages_per_rank": 2}},
         "model.num_hidden_layers=3 is fewer than the parallel.pipeline_parallel=2 x "
         "parallel.pipeline_stages_per_rank=2 = 4 stages"),
    ],
)  # fmt: skip
def test_bad_pipeline_requests_exit_2_with_one_line(two_processes, tiny_config, tmp_path,
                                                    capsys, extra, message):  # fmt: skip
    from conftest import deep_update

    config = tiny_config(deep_update(PP2, extra))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()  # nothing written
