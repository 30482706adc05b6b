"""Start-up: how long `unmask --help` and `unmask generate --help` take against
`python -c "import torch"` (the floor: every unmask command needs torch).

Why: a command that decodes 5 tokens in 0.1 s should not spend seconds importing what it
never uses (transformers, DTensor with sympy under it, plotting, serving). The target is
at most 1.3x the torch import (issue 55); the README quotes the ratio.

Each command runs in a fresh process; the three are interleaved over rounds (rotated, so a
drift in the machine's load hits them alike). Measured per run: wall time, and CPU time
(user + system of the child, steadier than wall time on a shared machine). The ratio is
taken within a round (the command's time over that round's torch import), then the median
and min-max over rounds.

Run: python benchmarks/startup.py          (writes benchmarks/results/startup.md; 7 rounds,
                                            about a minute idle)
     python benchmarks/startup.py --quick  (1 round; prints, writes no file)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, RESULTS, load_average, machine, publish, rotated, with_spread

#: the target of issue 55: `--help` within this factor of `import torch`
TARGET = 1.3


def commands() -> dict[str, list[str]]:
    """The commands timed, by label; unmask through this interpreter's console script."""
    script = Path(sys.executable).with_name("unmask")
    unmask = [str(script)] if script.is_file() else [sys.executable, "-m", "unmask"]
    return {
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "unmask --help": [*unmask, "--help"],
        "unmask generate --help": [*unmask, "generate", "--help"],
    }


def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run of command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=REPO,
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})  # fmt: skip
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    """{label: {"wall": [...], "cpu": [...], "wall_ratio": [...], "cpu_ratio": [...]}}."""
    found = commands()
    labels = list(found)
    results = {label: {"wall": [], "cpu": [], "wall_ratio": [], "cpu_ratio": []}
               for label in labels}  # fmt: skip
    for label in labels:  # warm the file cache once, untimed
        timed(found[label])
    for index in range(rounds):
        this_round = {}
        for label in rotated(labels, index):
            this_round[label] = timed(found[label])
        floor_wall, floor_cpu = this_round[labels[0]]
        for label, (wall, cpu) in this_round.items():
            results[label]["wall"].append(wall)
            results[label]["cpu"].append(cpu)
            results[label]["wall_ratio"].append(wall / floor_wall)
            results[label]["cpu_ratio"].append(cpu / floor_cpu)
        print(f"round {index + 1}/{rounds}: " + ", ".join(
            f"{label} {wall:.2f} s" for label, (wall, _) in this_round.items()), flush=True)  # fmt: skip
    return results


def report(results: dict, rounds: int) -> str:
    lines = [
        "# Start-up: `unmask --help` against `import torch`",
        "",
        f"Machine: {machine('torch')}; load average at the end {load_average()}.",
        f"{rounds} interleaved rounds, each command in a fresh process; medians (min-max over "
        "rounds). Ratio: the command's time over the same round's `import torch`. Target: "
        f"<= {TARGET}x.",
        "",
        "| command | wall s | CPU s | ratio (wall) | ratio (CPU) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, r in results.items():
        lines.append(f"| `{label}` | {with_spread(r['wall'])} | {with_spread(r['cpu'])} | "
                     f"{with_spread(r['wall_ratio'])} | {with_spread(r['cpu_ratio'])} |")  # fmt: skip
    worst = max(statistics.median(r["cpu_ratio"]) for r in results.values())
    verdict = "within" if worst <= TARGET else "over"
    lines += ["", f"Largest median CPU ratio: {worst:.2f}x ({verdict} the {TARGET}x target).", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--quick", action="store_true", help="1 round, no results file")
    args = parser.parse_args()
    rounds = 1 if args.quick else max(3, args.rounds)
    results = measure(rounds)
    publish(report(results, rounds), None if args.quick else RESULTS / "startup.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
