"""Where training numbers go: the console (progress bar + log lines), metrics.jsonl,
TensorBoard, W&B and trackio. The trainer calls `log(step, values)`; this module owns formats."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from unmask.errors import InputError
from unmask.runs.report import METRICS_FILE, format_duration


def progress_postfix(values: dict) -> dict | None:
    """What the progress bar shows beside the step: the mean reward of a reward-driven run
    (grpo: see `format_line`), else the loss; None when neither was logged."""
    if "reward_mean" in values:
        return {"reward": f"{values['reward_mean']:.3f}"}
    return {"loss": f"{values['loss']:.3f}"} if "loss" in values else None


def format_line(step: int, total: int, values: dict, eta_s: float | None) -> str:
    """'step 40/400 | loss 1.234 | lr 1.00e-03 | 5.1k tok/s | mfu 41.2% | eta 2m10s', with
    'qk_max 87.3 (4 heads clipped)' when QK-clip is on (optim.qk_clip_threshold).

    A grpo run shows 'reward 0.625 (std 0.48)' (the mean and std of its rollouts' total
    reward since the last line) instead of the loss: the policy loss of group-centered
    advantages sits near 0 by construction and says nothing about progress (metrics.jsonl
    keeps it)."""
    parts = [f"step {step}/{total}"]
    if "reward_mean" in values:
        reward = f"reward {values['reward_mean']:.3f}"
        if "reward_std" in values:
            reward += f" (std {values['reward_std']:.2f})"
        parts.append(reward)
    elif "loss" in values:
        parts.append(f"loss {values['loss']:.4f}")
    if "eval_loss" in values:
        parts.append(f"eval_loss {values['eval_loss']:.4f}")
    if "heldout_exact_match" in values:
        parts.append(f"held-out exact match {values['heldout_exact_match']:.1%}")
    if "learning_rate" in values:
        parts.append(f"lr {values['learning_rate']:.2e}")
    if "tokens_per_second" in values:
        parts.append(f"{values['tokens_per_second'] / 1000:.1f}k tok/s")
    if "mfu" in values:
        model = values.get("mfu_model_only")
        parts.append(f"mfu {values['mfu']:.1%}" + (f" (model {model:.1%})" if model else ""))
    if "qk_max_logit" in values:  # QK-clip on: the largest attention logit, heads scaled
        clipped = int(values.get("qk_clipped_heads", 0))
        parts.append(f"qk_max {values['qk_max_logit']:.1f} ({clipped} heads clipped)")
    if values.get("skipped_steps"):
        parts.append(f"skipped {values['skipped_steps']}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "unmask[wandb]"),
    "trackio": ("trackio", "unmask[trackio]"),
}  # name -> (module, what to install)


def check_trackers(report_to: list[str]) -> None:
    """InputError for a tracker whose package is not installed (before anything is
    written), with the pip command."""
    for name in report_to:
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise InputError(
                f"train.report_to: {name} needs the {module} package, which is not installed: "
                f"pip install '{extra}' (or drop {name} from train.report_to)"
            )


def tensorboard_tag(key: str) -> str:
    """'loss' -> 'train/loss', 'eval_loss' -> 'eval/loss', 'heldout_exact_match' -> 'eval/...'."""
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key.startswith("heldout_"):
        return f"eval/{key}"
    return f"train/{key}"


#: with no progress bar (output to a file or a pipe), a progress line is printed when no
#: line was printed for this many seconds, so a log shows the run moving between log lines
PROGRESS_SECONDS = 30.0


class MetricsLogger:
    """Writes one JSON object per logged step; mirrors to TensorBoard/W&B when asked. On a
    terminal a tqdm bar shows progress; elsewhere (a file, a pipe, CI) a plain line
    `step 120/1400 | loss 0.123 | eta 4m10s` is printed every PROGRESS_SECONDS without
    another line."""

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        start_step: int = 0,
        report_to: tuple[str, ...] = (),
        run_name: str | None = None,
        show_progress: bool = True,
        config: dict | None = None,
    ):
        self.total_steps = total_steps
        self.start_step = start_step
        self.path = output_dir / METRICS_FILE
        self.jsonl = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self.tensorboard = None
        self.wandb = self.trackio = None
        name = run_name or output_dir.name
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter  # only when asked: slow import

            self.tensorboard = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        if "wandb" in report_to:
            import wandb  # optional extra (wandb)

            self.wandb = wandb.init(name=name, config=config, dir=str(output_dir))
        if "trackio" in report_to:
            import trackio  # optional extra (trackio)

            self.trackio = trackio.init(project=name, name=name, config=config)
        self.bar = None
        if show_progress and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, unit="step")
        self.started = time.perf_counter()
        #: plain progress lines (no bar): when the last line was printed, None when off
        self.quiet_since = self.started if show_progress and self.bar is None else None
        self.progress_seconds = PROGRESS_SECONDS
        self.postfix: dict | None = None  # the last values the bar (or line) shows

    def eta(self, step: int) -> float | None:
        done = step - self.start_step
        if done <= 0:
            return None
        elapsed = time.perf_counter() - self.started
        return elapsed / done * (self.total_steps - step)

    def advance(self, step: int, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
        elif self.quiet_since is not None:
            if postfix:
                self.postfix = postfix
            if time.perf_counter() - self.quiet_since >= self.progress_seconds:
                parts = [f"step {step}/{self.total_steps}"]
                parts += [f"{k} {v}" for k, v in (self.postfix or {}).items()]
                eta = self.eta(step)
                if eta is not None:
                    parts.append(f"eta {format_duration(eta)}")
                self.print(" | ".join(parts))

    def log(self, step: int, values: dict, show: bool = True) -> None:
        """One metrics.jsonl record (and the trackers'); show: print the progress line."""
        record = {"step": step, **values}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(tensorboard_tag(key), value, step)
                elif key == "samples":  # grpo's sample completions, as text
                    self.tensorboard.add_text(key, json.dumps(value, indent=1), step)
            self.tensorboard.flush()
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        if self.trackio is not None:
            self.trackio.log(numbers, step=step)
        if show:
            self.print(format_line(step, self.total_steps, values, self.eta(step)))

    def rewind(self, step: int) -> None:
        """Forget the records after `step` (the run goes back there and logs them again)."""
        self.jsonl.close()
        truncate_metrics(self.path.parent, step)
        self.jsonl = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)
            if self.quiet_since is not None:
                self.quiet_since = time.perf_counter()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.trackio is not None:
            self.trackio.finish()


class LogWindow:
    """Loss, throughput and MFU since the last logging step (skipped steps left out).

    Step losses (and model FLOPs) may be 0-d device tensors: they are summed on the device,
    losses in float64 (each float32 loss widened, added in step order: the same arithmetic
    as summing them as Python floats), and read once, by `values` at a logging step, so the
    steps between cost no host-device sync. `peak_flops` (FLOP/s of the device, mfu.py)
    turns the window's FLOPs into `mfu`, over the same wall time as `tokens_per_second`.
    """

    def __init__(self, peak_flops: float | None = None, timer=None) -> None:
        self.peak_flops = peak_flops
        self.peak_raised = False  # set when a window ran faster than peak_flops
        self.timer = timer  # mfu.DeviceTimer: reads the steps' optimizer marks
        self.restart()

    def restart(self) -> None:
        """An empty window, starting now."""
        self.loss: float | torch.Tensor = 0.0
        self.flops: float | torch.Tensor = 0.0
        self.objective: dict[str, torch.Tensor] = {}  # the objective's step means, summed
        self.optimizer_marks: list = []  # (start, stop) of each step's optimizer update
        self.steps, self.tokens = 0, 0
        self.started = time.perf_counter()

    def add(self, stats: dict, tokens: int) -> None:
        loss = stats["loss"]
        self.loss = self.loss + (loss.detach().double() if isinstance(loss, torch.Tensor) else loss)
        self.flops = self.flops + stats.get("flops", 0.0)
        for key, value in stats.get("objective", {}).items():
            self.objective[key] = self.objective.get(key, 0.0) + value.detach().double()
        if "optimizer_marks" in stats:
            self.optimizer_marks.append(stats["optimizer_marks"])
        self.steps += 1
        self.tokens += tokens

    def values(self, stats: dict) -> dict:
        """The window's logged values, and a new window."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        values = {"loss": float(self.loss) / max(self.steps, 1),
                  "learning_rate": stats["learning_rate"],
                  "tokens_per_second": self.tokens / elapsed}  # fmt: skip
        if "grad_norm" in stats:
            values["grad_norm"] = float(stats["grad_norm"])
        for key in ("qk_max_logit", "qk_clipped_heads"):  # QK-clip: the last step's
            if key in stats:
                values[key] = float(stats[key])
        for key, total in self.objective.items():  # e.g. preference's reward_accuracy
            values[key] = float(total) / max(self.steps, 1)
        if self.peak_flops and "flops" in stats:
            rate = float(self.flops) / elapsed
            if rate > self.peak_flops:  # the peak was measured low (a busy machine): the
                self.peak_flops = rate  # achieved model FLOP rate is a lower bound of it
                self.peak_raised = True
            values["mfu"] = rate / self.peak_flops
            if self.timer is not None and self.optimizer_marks:  # the steps less the updates
                optimizer = sum(self.timer.seconds(a, b) for a, b in self.optimizer_marks)
                model = max(elapsed - optimizer, 1e-9)
                values["mfu_model_only"] = float(self.flops) / model / self.peak_flops
        self.restart()
        return values


def truncate_metrics(out: Path, step: int) -> int:
    """Keep only the metrics.jsonl records of steps <= step (a resumed run logs the later
    ones again); returns how many were dropped. Rewritten atomically."""
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            dropped += 1  # a line cut by a kill mid-write
            continue
        if record_step > step:
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped


class SilentLogger:
    """The MetricsLogger interface, doing nothing: ranks other than 0 log nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def print(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass

    def log(self, *args, **kwargs) -> None:
        pass

    def rewind(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass
