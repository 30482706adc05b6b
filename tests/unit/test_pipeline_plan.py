"""Pipeline parallelism's plan and its bad input: the stages' layers, the micro-batch count,
and every refusal as one line with exit code 2 before any process group is opened.

The CLI cases run `unmask train` in this process with a launcher's environment for two
processes (WORLD_SIZE=2) but no rendezvous address: a run that got as far as opening the
process group would fail there with a traceback (exit code 1), not with the one line.
"""

import pytest

from unmask.cli import main
from unmask.errors import InputError
from unmask.parallel.pipeline import PipelinePlan, balancing_notice, plan_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def test_even_split_puts_consecutive_layers_on_each_stage():
    plan = plan_pipeline(2, "1f1b", 1, None, None, num_layers=4, rows=8)
    assert plan.layers == ((0, 1), (2, 3))
    assert plan.microbatches == 8  # default: one per row of the step
    assert plan.stages_of(0) == [0] and plan.stages_of(1) == [1]


def test_interleaved_stages_loop_over_the_ranks():
    plan = plan_pipeline(2, "interleaved_1f1b", 2, 4, None, num_layers=8, rows=8)
    assert plan.layers == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.stages_of(0) == [0, 2] and plan.stages_of(1) == [1, 3]
    assert [plan.owner(s) for s in range(4)] == [0, 1, 0, 1]


def test_split_by_hand_and_the_start_up_line():
    plan = plan_pipeline(2, "gpipe", 1, 2, [3, 1], num_layers=4, rows=8)
    assert plan.layers == ((0, 1, 2), (3,))
    assert plan.describe() == (
        "pipeline: 2 stages over 2 ranks, gpipe, 2 micro-batches per step; stage 0 (pp rank "
        "0): layers 0-2 + embeddings; stage 1 (pp rank 1): layer 3 + norm + head"
    )
    assert isinstance(plan, PipelinePlan)


def test_moe_balancing_line_when_micro_batches_differ_from_accumulation():
    from unmask.models.config import ModelConfig

    moe = ModelConfig(model_type="qwen3_moe_dllm", num_experts=4, num_experts_per_tok=2,
                      router_aux_loss_coef=0.01)  # fmt: skip
    plan = plan_pipeline(2, "1f1b", 1, None, None, num_layers=2, rows=8)  # 8 micro-batches
    assert balancing_notice(plan, moe, accumulation=2) == (
        "the MoE balancing losses span each of the 8 pipeline micro-batches, not the 2 "
        "gradient-accumulation micro-batches of the run without a pipeline: set "
        "train.pipeline_microbatches=2 (when the schedule allows) for the same balancing"
    )
    same = plan_pipeline(2, "1f1b", 1, 2, None, num_layers=2, rows=8)
    assert balancing_notice(same, moe, accumulation=2) is None
    # no balancing loss (the sigmoid router's bias counts the step's load), or a dense model
    bias_only = moe.model_copy(update={"router_aux_loss_coef": 0.0})
    assert balancing_notice(plan, bias_only, accumulation=2) is None
    assert balancing_notice(plan, ModelConfig(), accumulation=2) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, "1f1b", 1, None, None, 5, 8), "model.num_hidden_layers=5 does not divide into "
                                           "train.pipeline_parallel=2 stages"),
        ((2, "1f1b", 1, None, [2, 1], 4, 8), "train.pipeline_split=[2, 1] must give 2 stages"),
        ((2, "1f1b", 1, None, [4, 0], 4, 8), "at least one layer each"),
        ((4, "1f1b", 1, 2, None, 4, 8), "train.pipeline_microbatches=2 is fewer than the 4 "
                                        "pipeline ranks"),
        ((2, "1f1b", 1, 3, None, 4, 8), "train.pipeline_microbatches=3 does not divide the 8 "
                                        "rows"),
        ((2, "interleaved_1f1b", 1, None, None, 4, 8), "set train.pipeline_stages_per_rank >= 2"),
        ((2, "zero_bubble", 1, None, None, 4, 8), "set train.pipeline_stages_per_rank >= 2"),
        ((2, "gpipe", 2, None, None, 4, 8), "runs one stage per rank"),
        ((2, "interleaved_1f1b", 2, 3, None, 8, 12), "a multiple of train.pipeline_parallel=2"),
    ],
)  # fmt: skip
def test_plan_refusals_are_one_line(args, message):
    with pytest.raises(InputError) as err:
        plan_pipeline(*args)
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
        ({"model": {"num_hidden_layers": 3}}, "model.num_hidden_layers=3 does not divide into "
                                              "train.pipeline_parallel=2 stages"),
        ({"train": {"pipeline_microbatches": 1}}, "train.pipeline_microbatches=1 is fewer than"),
        ({"train": {"pipeline_schedule": "interleaved_1f1b"}},
         "interleaves several stages per rank; set train.pipeline_stages_per_rank >= 2"),
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
        ({"train": {"context_parallel": 2}}, "does not combine with train.context_parallel"),
        ({"diffusion": {"random_length_prob": 0.1}}, "diffusion.random_length_prob=0.1 cuts rows"),
        ({"eval": {"generate_accuracy": True}}, "no sampler runs through the pipeline"),
        ({"diffusion": {"objective": "bd3lm", "block_size": 4,
                        "block_schedule": {"decay": [4], "decay_steps": 1}}},
         "diffusion.adaptation / diffusion.block_schedule change it during the run"),
        ({"model": {"model_type": "qwen3_moe_dllm", "num_experts": 4, "num_experts_per_tok": 2},
          "train": {"expert_parallel": 2}},
         "train.expert_parallel=2 does not divide the data-parallel x context ranks (1)"),
        # an MoE model's layers (its dense first_k_dense_replace ones too) divide as any
        ({"model": {"model_type": "llada2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1, "num_hidden_layers": 3}},
         "model.num_hidden_layers=3 does not divide into train.pipeline_parallel=2 stages"),
        ({"train": {"pipeline_schedule": "zero_bubble", "pipeline_stages_per_rank": 2,
                    "bf16": True}}, "zero_bubble does not run under train.bf16 yet"),
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
