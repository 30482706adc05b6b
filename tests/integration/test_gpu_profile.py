"""benchmarks/gpu.py --profile, the prepared GPU run, on the CPU: --cases in the order given
and unknown names refused; a phase cut mid-way keeps its timed steps and takes its
children with it; the budget estimate of --plan-only; the CUDA tests phase fails when
pytest does; the full-row data."""

import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "gpu.py"
sys.path.insert(0, str(BENCHMARKS))

import gpu  # noqa: E402
import gpu_profile  # noqa: E402
import gpu_train  # noqa: E402


def test_cases_run_in_the_order_given_and_unknown_names_exit_2_writing_nothing(tmp_path):
    assert gpu.phase_names(["serve", "env", "serve"]) == ["serve", "env"]
    assert gpu.phase_names([]) == gpu.PROFILE_PHASES
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--profile", "--dry", "--out", str(out),
                           "--cases", "env", "train-llada-8b-muon-256k", "tran-dream"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "gpu.py --profile: unknown --cases train-llada-8b-muon-256k, tran-dream; the phases are env,"
    ), proc.stderr
    assert not out.exists()


def test_the_order_puts_what_the_targets_need_first():
    assert gpu.PROFILE_PHASES[:7] == [
        "env", "train-llada-8b-muon", "train-llada-8b-adamw", "train-llada-8b-muon-64k",
        "train-dream-7b-adamw", "train-llada-moe-7b-a1b-muon", "train-diffusion-gemma-26b-a4b",
    ]  # fmt: skip
    assert gpu.TARGET_PHASES == gpu.PROFILE_PHASES[:7]
    assert {n.removeprefix("train-") for n in gpu.PROFILE_PHASES if n.startswith("train-")} == set(
        gpu_train.TRAIN_CASES
    )


@pytest.mark.slow
def test_a_phase_cut_mid_way_keeps_its_timed_steps_and_its_children_are_ended(tmp_path):
    """The LLaDA phase, dry, with its diagnostics replaced by one that starts a child (as
    the serve and CUDA-test phases do) and hangs; the run cuts it there (the same path as
    the budget's deadline): the JSON holds every timed step, the child is gone."""
    out, pid_file = tmp_path / "out", tmp_path / "child.pid"
    wrapper = tmp_path / "phase.py"
    wrapper.write_text(
        textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(BENCHMARKS)!r})
        from pathlib import Path
        import gpu_train

        def hang(*args, **kwargs):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            Path({str(pid_file)!r}).write_text(str(child.pid))
            time.sleep(300)

        gpu_train._diagnose = hang
        gpu_train.phase_train(Path({str(out)!r}), "llada-8b-muon", dry=True)
    """)
    )
    outcome = gpu.run_phase_process([sys.executable, str(wrapper)], tmp_path / "log.txt", 240,
                                    should_stop=pid_file.exists)  # fmt: skip
    assert outcome.startswith("cut off"), (outcome, (tmp_path / "log.txt").read_text()[-2000:])
    result = json.loads((out / "train-llada-8b-muon.json").read_text())
    assert result["stage"] == "projected"  # the last stage saved before the diagnostics
    assert set(result["data"]) == {"packed", "full-row"}
    for data in result["data"].values():
        assert len(data["step_s"]) == len(data["flops_per_step"]) == 2
        assert data["mfu_end_to_end"] > 0
    assert result["projection_256k"]["micro_batches"] == 32
    assert not running(int(pid_file.read_text()))


def running(pid: int) -> bool:
    """pid exists and is no zombie (an ended orphan waits there for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_plan_only_estimates_the_target_phases_within_the_budget():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--profile", "--plan-only"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu.py --plan-only: the phases through train-diffusion-gemma-26b-a4b "
                           "fit in 480 s ("), last  # fmt: skip
    assert int(last.split("(")[1].split()[0]) <= 480
    rows = [line.split()[0] for line in proc.stdout.splitlines()[2:-1]]
    assert rows == gpu.PROFILE_PHASES


def test_the_cuda_tests_phase_lists_its_files_and_fails_when_pytest_does(tmp_path, monkeypatch):
    files = gpu_profile.cuda_test_files()
    assert {"tests/unit/test_cuda_paths.py", "tests/unit/test_models.py",
            "tests/unit/test_moe.py"} <= set(files)  # fmt: skip
    broken = tmp_path / "test_broken.py"
    broken.write_text("import a_module_that_is_not_there\n")
    monkeypatch.setattr(gpu_profile, "cuda_test_files", lambda: [str(broken)])
    with pytest.raises(SystemExit, match="cuda-tests: pytest exited 2"):
        gpu_profile.phase_cuda_tests(tmp_path / "out", dry=True)
    result = json.loads((tmp_path / "out" / "cuda-tests.json").read_text())
    assert result["files"] == [str(broken)] and result["returncode"] == 2


def test_full_rows_hold_one_maskable_document_each_with_diverse_ids():
    batch = next(gpu_train.full_rows(2, 4096, 157184, mask_id=5))
    assert batch["doc_ids"].eq(0).all() and batch["maskable"].all()
    assert batch["position_ids"][1].tolist() == list(range(4096))
    assert not batch["input_ids"].eq(5).any()
    assert batch["input_ids"].unique().numel() > 8000  # the packed rows hold 22 distinct ids


def test_the_bundle_inside_the_results_folder_leaves_itself_out(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "env.json").write_text("{}")
    bundle = out / "gpu-profile.tar.gz"
    gpu._bundle(out, bundle)
    gpu._bundle(out, bundle)  # the second sees the first in the folder
    with tarfile.open(bundle) as tar:
        assert sorted(tar.getnames()) == ["results", "results/env.json"]
