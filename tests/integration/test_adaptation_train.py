"""Adaptation runs from a tiny `ar` run: resume in the middle of an anneal or a block
schedule equals the uninterrupted run, the adapted folder records the shift, and bad
adaptation input is one line, exit code 2, nothing written."""

import json
import shutil

import pytest
from conftest import losses, save_tiny_model, write_run_config

from unmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ar_final(tmp_path_factory):
    root = tmp_path_factory.mktemp("ar")
    config = write_run_config(root, "ar", {}, {"diffusion": {"objective": "ar"}})
    assert main(["train", str(config)]) == 0
    return root / "ar" / "final"


def _resume_equals_uninterrupted(root, extra: dict) -> dict:
    """Run 8 steps, then resume a copy of checkpoint-4 to 8: the losses of steps 5..8 and
    the final weights are the same. Returns the uninterrupted run's losses."""
    base = {"train": {"max_steps": 8, "save_steps": 4, "eval_steps": 0}}
    config = write_run_config(root, "full", base, extra)
    assert main(["train", str(config)]) == 0
    stopped = root / "stopped"
    stopped.mkdir()
    shutil.copytree(root / "full" / "checkpoint-4", stopped / "checkpoint-4")
    again = write_run_config(root, "stopped", base, {**extra, "train": {
        "resume_from_checkpoint": True}})  # fmt: skip
    assert main(["train", str(again)]) == 0
    full, resumed = losses(root / "full"), losses(stopped)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert resumed[step] == full[step]
    a = (root / "full" / "final" / "model.safetensors").read_bytes()
    assert a == (stopped / "final" / "model.safetensors").read_bytes()
    return full


def test_resume_mid_anneal_equals_the_uninterrupted_run(ar_final, tmp_path, capsys):
    extra = {"model": {"pretrained": str(ar_final)},
             "diffusion": {"objective": "mdlm", "adaptation": {
                 "attention": "anneal", "anneal_steps": 8, "shift": True}}}  # fmt: skip
    _resume_equals_uninterrupted(tmp_path, extra)
    out = capsys.readouterr().out  # the start-up line names what is adapted
    assert (
        f"adapting {ar_final} (a causal checkpoint): attention annealed over 8 steps, "
        "logit shift on"
    ) in out
    saved = json.loads((tmp_path / "full" / "final" / "generation_config.json").read_text())
    assert saved["unmask"]["shift_logits"] is True  # the adapted model samples shifted


def test_resume_mid_block_schedule_equals_the_uninterrupted_run(ar_final, tmp_path, capsys):
    schedule = {"warmup": [1, 4], "warmup_steps": 2, "stable_steps": 2, "decay": [10, 5],
                "decay_steps": 1}  # fmt: skip
    extra = {
        "model": {"pretrained": str(ar_final)},
        "diffusion": {"objective": "bd3lm", "block_schedule": schedule},
    }
    _resume_equals_uninterrupted(tmp_path, extra)
    saved = json.loads((tmp_path / "full" / "final" / "generation_config.json").read_text())
    assert saved["unmask"]["block_causal"] is True and saved["unmask"]["block_length"] == 5
    assert (
        "block schedule: bd3lm blocks of 1 to step 2, 4 to step 4, the whole row to "
        "step 6, 10 to step 7, then 5"
    ) in capsys.readouterr().out


@pytest.mark.parametrize(
    "case",
    ["not_causal", "shift_on_encoder", "anneal_too_long", "schedule_too_long", "no_pretrained"],
)
def test_bad_adaptation_input_is_one_line(ar_final, tmp_path, capsys, case):
    dlm = save_tiny_model(tmp_path / "dlm")
    adaptation = {"attention": "anneal", "anneal_steps": 4, "shift": True}
    extra, message = {
        "not_causal": ({"model": {"pretrained": str(dlm)}, "diffusion": {"objective": "mdlm",
                        "adaptation": adaptation}}, "is not one (a DLM or an encoder)"),
        "shift_on_encoder": ({"model": {"model_type": "bert"}, "diffusion": {"objective": "mdlm",
                              "adaptation": {"shift": True}}},
                             "adaptation.shift needs a decoder family"),
        "anneal_too_long": ({"model": {"pretrained": str(ar_final)}, "diffusion": {
            "objective": "mdlm", "adaptation": {**adaptation, "anneal_steps": 100}}},
            "anneal_steps (100) is longer than the run (train.max_steps 6)"),
        "schedule_too_long": ({"model": {"pretrained": str(ar_final)}, "diffusion": {
            "objective": "bd3lm", "block_schedule": {"warmup": [2], "warmup_steps": 6,
                                                      "decay": [4]}}},
            "block_schedule reaches its last block size at step 6"),
        "no_pretrained": ({"diffusion": {"objective": "mdlm", "adaptation": {"shift": True}}},
                          "adapts a causal checkpoint: set model.pretrained"),
    }[case]  # fmt: skip
    config = write_run_config(tmp_path, "bad", {}, extra)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("unmask: error:") and message in err[0], err
    assert not (tmp_path / "bad").exists()


def test_a_v2_form_run_from_the_ar_run_samples_as_v2(ar_final, tmp_path, capsys):
    extra = {"model": {"pretrained": str(ar_final)},
             "diffusion": {"objective": "fastdllm_v2", "block_size": 4}}  # fmt: skip
    config = write_run_config(tmp_path, "v2", {}, extra)
    assert main(["train", str(config)]) == 0
    final = tmp_path / "v2" / "final"
    saved = json.loads((final / "generation_config.json").read_text())["unmask"]
    assert saved["blocks_from_start"] and saved["shift_logits"] and saved["block_causal"]
    capsys.readouterr()
    assert main(["generate", "--model", str(final), "--prompt", "rev 123=", "--jsonl",
                 "--gen-length", "8", "--threshold", "0.5"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out.strip())

    import torch

    from unmask.checkpoint import load_for_sampling
    from unmask.sampling import SamplingConfig, sample

    sm = load_for_sampling(str(final), None, "cpu", None)
    ids = torch.tensor([sm.tokenizer("rev 123=", add_special_tokens=False)["input_ids"]])
    config = SamplingConfig(**{**saved, "gen_length": 8, "threshold": 0.5, "row_length": None})
    out = sample(sm.model, ids, config, mask_id=sm.mask_id, eos_id=sm.eos_id)
    answer = out.answers[0].tolist()
    answer = answer[: answer.index(sm.eos_id)] if sm.eos_id in answer else answer
    assert record["completion"] == sm.tokenizer.decode(answer, skip_special_tokens=True)
    assert record["nfe"] == out.nfe


@pytest.mark.slow
def test_adaptation_under_fsdp2_matches_one_process(ar_final, tmp_path):
    """A shifted, annealed adaptation (Muon) on 2 gloo processes (FSDP2, the global batch
    split): every step's loss equals the one-process run's within 1e-5 relative, so the
    anneal's draws are the same on every rank and at every world size. A block schedule
    runs there too and records its last size (bd3lm draws each rank's noise from the
    rank's own generator, `global_noise` False, so its losses are not the one-process
    run's by design)."""
    from conftest import train_in_process
    from launch import train_in_ranks

    base = {"train": {"split_batches": True, "max_steps": 6, "eval_steps": 0,
                      "save_steps": 0, "logging_steps": 1},
            "optim": {"name": "muon", "ns_dtype": "float32"}}  # fmt: skip
    schedule = {"warmup": [1, 4], "warmup_steps": 1, "stable_steps": 2, "decay": [5]}
    cases = {
        "anneal": {"model": {"pretrained": str(ar_final)},
                   "diffusion": {"objective": "mdlm", "adaptation": {
                       "attention": "anneal", "anneal_steps": 6, "shift": True}}},
        "blocks": {"model": {"pretrained": str(ar_final)},
                   "diffusion": {"objective": "bd3lm", "block_schedule": schedule}},
    }  # fmt: skip
    configs = [write_run_config(tmp_path, name, base, extra) for name, extra in cases.items()]
    results = train_in_ranks(2, tmp_path / "results.json", *configs)
    for name in cases:
        assert results[name]["rc"] == 0, results[name]["stderr"]
    saved = json.loads((tmp_path / "blocks" / "final" / "generation_config.json").read_text())
    assert saved["unmask"]["block_length"] == 5
    assert sorted(losses(tmp_path / "blocks")) == list(range(1, 7))
    for config, name in zip(configs[:1], ["anneal"]):
        two = losses(tmp_path / name)
        one = losses(train_in_process(config, tmp_path / f"{name}-1"))
        assert sorted(two) == sorted(one) == list(range(1, 7))
        for step in one:
            assert abs(two[step] - one[step]) <= 1e-5 * abs(one[step]), (name, step)
