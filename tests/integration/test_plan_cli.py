

def test_gpu_suite_dry_run_is_consistent_with_the_planner():
    # benchmarks/gpu.py --dry: the suite imports, and each case's plan has train/mfu.py's
    # FLOPs, the trainer's tokens per step, and fits (no GPU needed)
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    proc = subprocess.run([sys.executable, str(script), "--dry", "--world", "2"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "checks" in line]
    assert len(lines) == 2
    assert all(line.endswith("checks flops ok, tokens ok, fits ok") for line in lines), lines
