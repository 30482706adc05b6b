"""`unmask train` with pipeline parallelism on 2 and 4 gloo processes against the
one-process run.

Two torchrun launches (dist_workers/train_worker.py) run every multi-process config in
order: on 2 processes pp=2 with each schedule (gpipe, 1f1b, interleaved 1F1B and
interleaved zero bubble with 2 stages per rank), with MuonAdamW, and with gradient
accumulation 4; on 4 processes dp_shard=2 x pp=2 and pp=2 x tp=2 with AdamW and with
MuonAdamW and gradient accumulation 4, then a MuonAdamW run under dp_shard=2 x pp=2 that
saves a DCP checkpoint at step 4, and runs that resume it under pp=4 and under
tp=2 x dp_shard=2. The one-process references (and the one-process resume) run here.
Every config uses split_batches, so the global batch (8 rows) is the same in every layout;
the tiny model has 4 layers (pp=4: one each) and 4 query and key/value heads (tp=2).
"""

import json
from pathlib import Path

import pytest
from conftest import by_step, deep_update, losses, train_in_process, write_run_config
from launch import train_in_ranks

from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.slow
STEPS = 20
BASE = {
    "model": {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4},
    "train": {"split_batches": True, "eval_steps": 10, "save_steps": 0, "logging_steps": 1,
              "max_steps": STEPS, "per_device_eval_batch_size": 16},
}  # fmt: skip
MUON = {"optim": {"name": "muon", "ns_dtype": "float32"}}
ACCUM4 = {"train": {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 2}}
TWO = {  # pp=2 on 2 processes: every schedule, Muon, accumulation
    "pp2-gpipe": {"train": {"pipeline_schedule": "gpipe"}},
    "pp2-1f1b": {"train": {"pipeline_schedule": "1f1b"}},
    "pp2-interleaved": {"train": {"pipeline_schedule": "interleaved_1f1b",
                                  "pipeline_stages_per_rank": 2, "pipeline_microbatches": 4}},
    "pp2-zerobubble": {"train": {"pipeline_schedule": "zero_bubble",
                                 "pipeline_stages_per_rank": 2}},
    "pp2-1f1b-muon": MUON,
    "pp2-gpipe-accum4": deep_update(ACCUM4, {"train": {"pipeline_schedule": "gpipe"}}),
}  # fmt: skip
FOUR = {  # 4 processes: pp composed with FSDP2 and TP
    "dp2pp2": {"train": {"dp_shard": 2}},
    "dp2pp2-muon-accum4": deep_update(deep_update(MUON, ACCUM4), {"train": {"dp_shard": 2}}),
    # zero bubble's deferred weight passes under FSDP2 (their gradients reduced with the rest)
    "dp2pp2-zerobubble": {"train": {"dp_shard": 2, "pipeline_schedule": "zero_bubble",
                                    "pipeline_stages_per_rank": 2, "pipeline_microbatches": 4}},
    "pp2tp2": {"train": {"tensor_parallel": 2}},
    "pp2tp2-muon-accum4": deep_update(deep_update(MUON, ACCUM4),
                                      {"train": {"tensor_parallel": 2}}),
}  # fmt: skip
#: zero bubble under bf16 (FSDP2 mixed precision) and interleaved 1F1B on the same 4 stages
BF16 = {
    f"dp2pp2-{name}-bf16": {"train": {"dp_shard": 2, "bf16": True, "pipeline_schedule": schedule,
                                      "pipeline_stages_per_rank": 2, "pipeline_microbatches": 4}}
    for name, schedule in (("zerobubble", "zero_bubble"), ("interleaved", "interleaved_1f1b"))
}  # fmt: skip
DCP = deep_update(MUON, {"train": {"max_steps": 8, "save_steps": 4, "eval_steps": 0}})
RESUMES = {"resume-pp4": {"pipeline_parallel": 4},
           "resume-tp2dp2": {"pipeline_parallel": 1, "tensor_parallel": 2, "dp_shard": 2}}  # fmt: skip


def write_config(root: Path, name: str, extra: dict) -> Path:
    return write_run_config(root, name, deep_update(BASE, {"train": {"pipeline_parallel": 2}}),
                            extra)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    cfg = {name: write_config(root, name, extra) for name, extra in TWO.items()}
    results = train_in_ranks(2, root / "results2.json", *cfg.values(), timeout=900)
    four = {name: write_config(root, name, extra) for name, extra in {**FOUR, **BF16}.items()}
    four["dcp"] = write_config(root, "dcp", deep_update(DCP, {"train": {"dp_shard": 2}}))
    saved = str(root / "dcp" / "checkpoint-4")
    for name, train in RESUMES.items():
        train = {**train, "dp_shard": train.get("dp_shard", -1), "resume_from_checkpoint": saved}
        four[name] = write_config(root, name, deep_update(DCP, {"train": train}))
    results.update(train_in_ranks(4, root / "results4.json", *four.values(), timeout=900))
    return {"root": root, "cfg": {**cfg, **four}, "results": results}


def one_process(runs, source: str, **train) -> Path:
    """Config `source` run in this process (world size 1, no pipeline), into <source>-1."""
    return train_in_process(runs["cfg"][source], runs["root"] / f"{source}-1",
                            pipeline_parallel=1, tensor_parallel=1, dp_shard=-1,
                            pipeline_schedule="1f1b", pipeline_stages_per_rank=1,
                            pipeline_microbatches=None, **train)  # fmt: skip


def test_runs_succeeded(runs):
    for name, result in runs["results"].items():
        assert result["rc"] == 0, (name, result["stderr"][-2000:])


def test_zero_bubble_under_bf16_tracks_interleaved_1f1b(runs):
    """Zero bubble's split backward runs under bf16 with FSDP2 mixed precision (dp_shard=2 x
    pp=2): its 20 steps' losses equal interleaved 1F1B's on the same 4 stages within bf16's
    rounding (the two differ in the last stage's loss, chunked against fused, and in the
    order the gradients are summed; measured within 1e-4 relative)."""
    split = losses(runs["root"] / "dp2pp2-zerobubble-bf16")
    interleaved = losses(runs["root"] / "dp2pp2-interleaved-bf16")
    assert sorted(split) == sorted(interleaved) == list(range(1, STEPS + 1))
    for step in split:
        assert split[step] == pytest.approx(interleaved[step], rel=1e-3), step


@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_losses_match_one_process_for_20_steps(runs, name):
    single_dir = one_process(runs, name)
    single, split = losses(single_dir), losses(runs["root"] / name)
    assert sorted(single) == sorted(split) == list(range(1, STEPS + 1))
    for step in single:
        assert split[step] == pytest.approx(single[step], rel=1e-5), step
    # the eval loss runs forward only through the stages, on every rank
    single_eval = by_step(single_dir, "eval_loss")
    split_eval = by_step(runs["root"] / name, "eval_loss")
    assert sorted(split_eval) == sorted(single_eval) == [10, 20]
    for step in single_eval:
        assert split_eval[step] == pytest.approx(single_eval[step], rel=1e-5), step


def test_final_model_gathers_every_stage(runs):
    """final/ of a pp=2 run is one HF folder with every stage's weights: equal to the
    one-process run's final/ after 20 equal steps (within float rounding)."""
    from unmask.models import from_pretrained

    split = from_pretrained(runs["root"] / "pp2-1f1b" / "final").state_dict()
    single = from_pretrained(one_process(runs, "pp2-1f1b") / "final").state_dict()
    assert sorted(split) == sorted(single)
    for key, value in single.items():
        assert split[key].shape == value.shape, key
        assert (split[key] - value).abs().max() <= 1e-4 * max(1.0, value.abs().max()), key


def test_dcp_checkpoint_of_dp2_pp2_resumes_under_pp4_tp2dp2_and_one_process(runs):
    root = runs["root"]
    ckpt = root / "dcp" / "checkpoint-4"
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 4
    uninterrupted = losses(one_process(runs, "dcp", save_steps=0))
    resumed = {name: losses(root / name) for name in RESUMES}
    out = root / "resume-1"
    cfg = load_config(runs["cfg"]["resume-pp4"])
    cfg.train = cfg.train.model_copy(update={"output_dir": str(out)})
    cfg.parallel = cfg.parallel.model_copy(update={"pipeline_parallel": 1})
    trainer = Trainer(cfg)
    assert trainer.step == 4
    trainer.train()
    resumed["one process"] = losses(out)
    for layout, got in resumed.items():
        assert sorted(got) == [5, 6, 7, 8], layout
        for step in got:
            assert got[step] == pytest.approx(uninterrupted[step], rel=1e-5), (layout, step)
