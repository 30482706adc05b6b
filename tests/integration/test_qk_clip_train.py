"""`unmask train` with QK-clip (optim.qk_clip_threshold, low enough that it clips at every
step) on 2 gloo processes against one process: FSDP2 (dp_shard=2), tensor parallelism
(tp=2: each rank captures and clips its own heads), context parallelism (cp=2: each rank
captures its heads over whole rows) and pipeline parallelism (pp=2: each stage its layers),
MuonAdamW, 20 steps each (the issue's length). The
loss curve, the logged max logit, the count of clipped heads and the final weights equal the
one-process run's within 1e-5; the same run without the clip ends with other query/key
weights."""

from pathlib import Path

import pytest
from conftest import by_step, losses, train_in_process, write_run_config
from launch import train_in_ranks
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
STEPS = 20
BASE = {
    "model": {"num_attention_heads": 4, "num_key_value_heads": 2, "qk_norm": False},
    "data": {"packing": True, "packing_length": 16},
    "optim": {"name": "muon", "ns_dtype": "float32", "learning_rate": 0.02,
              "qk_clip_threshold": 0.03, "qk_clip_alpha": 0.3},
    "train": {"split_batches": True, "max_steps": STEPS, "per_device_train_batch_size": 4,
              "logging_steps": 1, "eval_steps": 0, "save_steps": 0},
}  # fmt: skip
LAYOUTS = {"dp2": {"dp_shard": 2}, "tp2": {"tensor_parallel": 2}, "cp2": {"context_parallel": 2},
           "pp2": {"pipeline_parallel": 2, "pipeline_microbatches": 2}}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qk_clip")
    configs = [write_run_config(root, name, BASE, {"parallel": layout})
               for name, layout in LAYOUTS.items()]  # fmt: skip
    results = train_in_ranks(2, root / "results.json", *configs)
    reference = train_in_process(write_run_config(root, "one", BASE, {}), root / "one-1")
    return root, results, reference


def final_weights(run: Path) -> dict:
    return load_file(run / "final" / "model.safetensors")


def test_the_clip_changes_the_weights(runs, tmp_path):
    """Off, the same run's q/k weights differ by more than the 1e-5 the layouts agree to."""
    off = {"optim": {"qk_clip_threshold": None}}
    plain = train_in_process(write_run_config(tmp_path, "off", BASE, off), tmp_path / "off-1")
    clipped, unclipped = final_weights(runs[2]), final_weights(plain)
    assert not by_step(plain, "qk_max_logit")  # logged only when on
    q = [name for name in clipped if name.endswith(("q_proj.weight", "k_proj.weight"))]
    assert q and all((clipped[n] - unclipped[n]).abs().max() > 1e-3 for n in q)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_equal_one_with_clipping_active(runs, layout):
    root, results, reference = runs
    assert results[layout]["rc"] == 0, results[layout]["stderr"]
    got: Path = root / layout
    clipped = by_step(reference, "qk_clipped_heads")
    assert len(clipped) == STEPS and all(n > 0 for n in clipped.values())  # it clips
    for key in ("loss", "qk_max_logit", "qk_clipped_heads"):
        want, have = by_step(reference, key), by_step(got, key)
        assert sorted(have) == sorted(want), key
        for step in want:
            assert abs(have[step] - want[step]) <= 1e-5 * max(1.0, abs(want[step])), (key, step)
    assert losses(got)
    want, have = final_weights(reference), final_weights(got)
    assert sorted(have) == sorted(want)
    for name in want:
        assert (have[name] - want[name]).abs().max() <= 1e-5, name


def test_the_console_line_shows_the_max_logit_and_the_start_up_the_per_head_split(tmp_path,
                                                                                   capsys):  # fmt: skip
    """With QK-clip on, each logged step's console line says `qk_max X (N heads clipped)`,
    the values metrics.jsonl holds; with per-head Muon the start-up split lists it."""
    from conftest import read_metrics

    from unmask.cli import main

    extra = {"optim": {"muon_per_head": True},
             "train": {"max_steps": 3, "disable_tqdm": True}}  # fmt: skip
    assert main(["train", str(write_run_config(tmp_path, "run", BASE, extra))]) == 0
    out = capsys.readouterr().out
    assert "  muon per head        6 tensors (k_proj, q_proj, v_proj; heads of 8 rows)" in out
    records = [r for r in read_metrics(tmp_path / "run") if "qk_max_logit" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        line = next(x for x in out.splitlines() if x.startswith(f"step {r['step']}/3 |"))
        assert (f"qk_max {r['qk_max_logit']:.1f} ({int(r['qk_clipped_heads'])} heads clipped)"
                in line), line  # fmt: skip
