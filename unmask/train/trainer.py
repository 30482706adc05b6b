"""The one training loop: batches -> objective -> (loss_sum, count) -> backward ->
global normalization -> clip -> optimizer -> schedule -> metrics and checkpoints.

Everything that can reject user input (config, tokenizer, data, output_dir, resume
path) runs before anything is written, so bad input never leaves a half-made run.
"""

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from unmask.config import RunConfig, dump_config
from unmask.data import (
    BatchLoader,
    adopt_mask_token,
    build_datasets,
    build_tokenizer,
    ensure_special_tokens,
)
from unmask.diffusion import build_objective
from unmask.diffusion.cutoffs import random_length_cut
from unmask.errors import InputError
from unmask.models import build_model
from unmask.models.hf import folder_mask_token_id
from unmask.models.lora import (
    apply_lora,
    check_lora_settings,
    lora_settings,
    lora_targets,
    save_lora,
)
from unmask.models.lora import check_request as check_lora_request
from unmask.models.quant import check_4bit, quantize_4bit
from unmask.optim.config import build_optimizer
from unmask.optim.schedule import build_scheduler, resolve_warmup
from unmask.parallel import distributed as par
from unmask.parallel.fsdp import compile_blocks
from unmask.train.checkpoint import (
    STATE_FILE,
    base_fingerprint,
    check_base_fingerprint,
    is_distributed_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_distributed_checkpoint,
    resolve_resume,
    save_checkpoint,
    save_distributed_checkpoint,
)
from unmask.train.metrics import MetricsLogger

RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "tensorboard", "final", "eval_results.json")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("train.device is 'cuda' but no CUDA device is visible; use auto or cpu")
    return torch.device(name)


def every(value: float, total: int) -> int:
    """An interval in steps from an int count or a fraction (< 1) of the total; 0 = never."""
    if value <= 0:
        return 0
    if value < 1:
        return max(1, math.ceil(value * total))
    return int(value)


@dataclass
class Plan:
    """Step counts derived once from the config and the data size."""

    total_steps: int
    warmup_steps: int
    logging_every: int
    eval_every: int
    save_every: int
    tokens_per_step: int


def make_plan(cfg: RunConfig, num_rows: int, world_size: int = 1) -> Plan:
    t = cfg.train
    rows_per_step = t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size
    if t.max_steps > 0:
        total = t.max_steps
    else:
        total = math.ceil(t.num_train_epochs * num_rows / rows_per_step)
    if total <= 0:
        raise InputError("nothing to train: set train.max_steps > 0 or train.num_train_epochs > 0")
    return Plan(
        total_steps=total,
        warmup_steps=resolve_warmup(cfg.optim.warmup_steps, cfg.optim.warmup_ratio, total),
        logging_every=every(t.logging_steps, total) or total,
        eval_every=every(t.eval_steps, total),
        save_every=every(t.save_steps, total),
        tokens_per_step=rows_per_step * cfg.data.packing_length,
    )


def prepare_output_dir(out: Path, cfg: RunConfig) -> Path | None:
    """Check output_dir before anything is written; returns the checkpoint to resume from."""
    t = cfg.train
    resume = resolve_resume(out, t.resume_from_checkpoint)
    holds_run = out.is_dir() and any(out.iterdir())
    if out.exists() and not out.is_dir():
        raise InputError(f"output_dir {str(out)!r} is a file; choose a folder path")
    if resume is None and holds_run:
        if not t.overwrite_output_dir:
            raise InputError(
                f"output_dir {str(out)!r} already holds a run; set "
                "train.resume_from_checkpoint=true to continue it, "
                "train.overwrite_output_dir=true to replace it, or choose another output_dir"
            )
        for path in list_checkpoints(out) + [out / name for name in RUN_ARTIFACTS]:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    return resume


class Trainer:
    """Builds every component from its config section and runs the loop."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        t = cfg.train
        check_lora_request(cfg.model)
        self.device = resolve_device(t.device)
        self.dist = par.setup(t, self.device)  # world size 1: no process group, no mesh
        self.device = self.dist.device
        check_4bit(cfg.model, self.device, self.dist.world_size)
        self.tokenizer = build_tokenizer(cfg.data)
        if cfg.model.pretrained is not None:  # LLaDA / Dream folders name their mask id
            folder_mask = folder_mask_token_id(cfg.model.pretrained)
            if folder_mask is not None:
                source = f"{cfg.model.pretrained}/config.json"
                adopt_mask_token(self.tokenizer, folder_mask, source)
        added_tokens = ensure_special_tokens(self.tokenizer)
        if added_tokens and cfg.model.lora:
            raise InputError(
                "the tokenizer has no mask (or EOS) token and one cannot be added under "
                "model.lora: true (the embeddings are frozen); use a tokenizer that has one"
            )
        self.train_rows, self.eval_rows = build_datasets(cfg.data, self.tokenizer)
        self.plan = make_plan(cfg, len(self.train_rows), self.dist.batch_ranks)
        self.output_dir = Path(t.output_dir)
        self.resume_path = par.share_from_rank0(lambda: prepare_output_dir(self.output_dir, cfg))

        torch.manual_seed(t.seed)
        self.model = build_model(cfg.model)
        if added_tokens or self.model.config.vocab_size < len(self.tokenizer):
            self.model.resize_token_embeddings(
                max(len(self.tokenizer), self.model.config.vocab_size)
            )
        if cfg.model.load_in_4bit:  # QLoRA: frozen NF4 base, quantized onto the device
            compute = torch.bfloat16 if t.bf16 else torch.float32
            targets = lora_targets(cfg.model, self.model)
            quantize_4bit(self.model, targets, self.device, compute)
        self.model.gradient_checkpointing = t.gradient_checkpointing
        if t.torch_compile and self.dist.mesh is None:  # FSDP2 compiles inside apply_fsdp
            compile_blocks(self.model)
        if cfg.model.lora:  # peft wrapper: base frozen, LoRA factors train (AdamW)
            self.model = apply_lora(self.model, cfg.model)
        self.model.to(self.device)
        if self.dist.mesh is not None:
            par.shard_model(self.model, self.dist, t)
        self.objective = build_objective(cfg.diffusion, self.tokenizer.mask_token_id)
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = build_scheduler(
            self.optimizer,
            cfg.optim.lr_scheduler_type,
            self.plan.total_steps,
            self.plan.warmup_steps,
            cfg.optim.min_lr_ratio,
        )
        # every rank reads the global micro-batch; train_step keeps this rank's rows
        self.loader = BatchLoader(self.train_rows, self.dist.global_batch_size, seed=t.seed)
        self.noise = torch.Generator(device=self.device)
        self.noise.manual_seed(t.seed + 1)
        self.step = 0
        self.tokens_seen = 0
        self._lora_base: list[float] | None = None

        if self.resume_path is not None:  # before config.yaml: a mismatch changes nothing
            self._restore(self.resume_path)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            (self.output_dir / "config.yaml").write_text(dump_config(cfg))

    # -- state ---------------------------------------------------------------------------
    def _rng_state(self) -> dict:
        return {"torch": torch.get_rng_state(), "noise": self.noise.get_state()}

    def _restore(self, path: Path) -> None:
        saved = json.loads((path / STATE_FILE).read_text())  # settings first, then tensors
        check_lora_settings(saved.get("lora"), self.cfg.model, path)
        load = load_distributed_checkpoint if is_distributed_checkpoint(path) else load_checkpoint
        state, rng = load(path, self.model, self.optimizer, self.scheduler)
        check_base_fingerprint(state.get("lora_base_fingerprint"), self.model, path)
        self.step = state["step"]
        self.tokens_seen = state.get("tokens_seen", 0)
        self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(rng["torch"])
        self.noise.set_state(rng["noise"])

    def _trainer_state(self) -> dict:
        state = {"loader": self.loader.state_dict(), "tokens_seen": self.tokens_seen}
        if self.cfg.model.lora:
            state["lora"] = lora_settings(self.cfg.model)
        if self.cfg.model.lora and self.dist.mesh is None:  # adapter-only checkpoints
            if self._lora_base is None:
                self._lora_base = base_fingerprint(self.model)
            state["lora_base_fingerprint"] = self._lora_base
        return state

    def _sampling_file(self) -> dict[str, str]:
        """generation_config.json: how this model must be sampled (Dream's shift, BD3LM's
        block-causal attention; only what the objective fixes), so `unmask generate`,
        export and lm-eval need no flags."""
        from unmask.eval.export import generation_config
        from unmask.sampling.loading import GENERATION_FILE, training_sampling_defaults

        sampling = training_sampling_defaults(self.cfg.diffusion)
        config = generation_config(self.tokenizer, sampling, complete=False)
        return {GENERATION_FILE: json.dumps(config, indent=2)}

    def save(self) -> Path:
        save = save_distributed_checkpoint if self.dist.mesh is not None else save_checkpoint
        return save(
            self.output_dir,
            self.step,
            self.model,
            self.tokenizer,
            self.optimizer,
            self.scheduler,
            self._trainer_state(),
            self._rng_state(),
            self.cfg.train.save_total_limit,
            self._sampling_file(),
        )

    # -- one step ------------------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.train.bf16)

    def train_step(self, batches: list[dict]) -> dict:
        """One optimizer step over micro-batches; the loss is normalized once, globally."""
        loss_sum_total = torch.zeros((), device=self.device)
        count_total = torch.zeros((), device=self.device)
        for index, batch in enumerate(batches):
            batch = self._to_device(batch)
            # LLaDA's random length: seeded by the step, so every rank/micro-batch cuts alike
            batch = random_length_cut(
                batch, self.cfg.diffusion.random_length_prob, self.cfg.train.seed, self.step
            )
            noise = self.noise
            if self.dist.mesh is not None:  # this rank's rows (and its noise generator)
                batch, noise = par.rank_batch(
                    batch, self.objective, self.noise, self.dist, (self.step, index)
                )
                par.sync_gradients(self.model, index == len(batches) - 1)
            with self._autocast():
                loss_sum, count = self.objective(self.model, batch, noise)
            loss_sum.backward()
            loss_sum_total += loss_sum.detach().float()
            count_total += count.detach().float()
        if self.dist.mesh is not None:  # sum over ranks: the normalization stays global
            loss_sum_total, count_total = par.all_reduce_sum(loss_sum_total, count_total)
        scale = 1.0 / count_total.clamp(min=1.0)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(scale.to(param.grad.dtype))
        grad_norm = None
        if self.cfg.optim.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.cfg.optim.max_grad_norm
            )
        learning_rate = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"loss": (loss_sum_total * scale).item(), "learning_rate": learning_rate}
        if grad_norm is not None:
            stats["grad_norm"] = float(par.full_value(grad_norm))
        return stats

    @torch.no_grad()
    def evaluate(self) -> float:
        """Eval loss on held-out rows with fixed noise, so evaluations are comparable."""
        from unmask.data import eval_batches

        was_training = self.model.training
        self.model.eval()
        noise = torch.Generator(device=self.device)
        noise.manual_seed(self.cfg.train.seed + 12345)
        loss_sum_total, count_total = 0.0, 0.0
        batches = eval_batches(self.eval_rows, self.cfg.train.per_device_eval_batch_size)
        for index, batch in enumerate(batches):
            if self.cfg.train.eval_max_batches is not None:
                if index >= self.cfg.train.eval_max_batches:
                    break
            with self._autocast():
                loss_sum, count = self.objective(self.model, self._to_device(batch), noise)
            loss_sum_total += float(loss_sum)
            count_total += float(count)
        self.model.train(was_training)
        return loss_sum_total / max(count_total, 1.0)

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, plan = self.cfg, self.plan
        logger = (MetricsLogger if self.dist.is_main else par.SilentLogger)(
            self.output_dir,
            plan.total_steps,
            start_step=self.step,
            report_to=tuple(cfg.train.report_to),
            run_name=cfg.train.run_name,
            show_progress=not cfg.train.disable_tqdm,
            config=cfg.model_dump(mode="json"),
        )
        logger.print(self._summary())
        routing = getattr(self.optimizer, "routing", None)
        if routing is not None:
            logger.print(routing.summary())
        self.model.train()
        window_loss, window_steps, window_tokens = 0.0, 0, 0
        window_start = time.perf_counter()
        last: dict = {}
        try:
            while self.step < plan.total_steps:
                batches = [next(self.loader) for _ in range(cfg.train.gradient_accumulation_steps)]
                stats = self.train_step(batches)
                self.step += 1
                self.tokens_seen += plan.tokens_per_step
                window_loss += stats["loss"]
                window_steps += 1
                window_tokens += plan.tokens_per_step
                logger.advance(self.step, {"loss": f"{stats['loss']:.3f}"})
                at_end = self.step == plan.total_steps
                values: dict = {}
                if self.step % plan.logging_every == 0 or at_end:
                    elapsed = time.perf_counter() - window_start
                    values.update(
                        loss=window_loss / window_steps,
                        learning_rate=stats["learning_rate"],
                        tokens_per_second=window_tokens / max(elapsed, 1e-9),
                        tokens_seen=self.tokens_seen,
                    )
                    if "grad_norm" in stats:
                        values["grad_norm"] = stats["grad_norm"]
                    window_loss, window_steps, window_tokens = 0.0, 0, 0
                    window_start = time.perf_counter()
                if (plan.eval_every and self.step % plan.eval_every == 0) or at_end:
                    if len(self.eval_rows):
                        values["eval_loss"] = self.evaluate()
                if values:
                    logger.log(self.step, values)
                    last.update(values)
                if (plan.save_every and self.step % plan.save_every == 0) or at_end:
                    self.save()
            final = self.output_dir / "final"
            if self.dist.mesh is not None:
                par.save_full_model(self.model, final)  # gathers on every rank, rank 0 writes
            elif cfg.model.lora:
                self.model = save_lora(self.model, self.output_dir, final, cfg.model)
            else:
                self.model.save_pretrained(final)
            if self.dist.is_main:
                self.tokenizer.save_pretrained(str(final))
                for name, text in self._sampling_file().items():
                    (final / name).write_text(text)
            if cfg.eval.generate_accuracy:
                last["heldout_exact_match"] = self._heldout_accuracy(logger)
        finally:
            logger.close()
        return last

    def _heldout_accuracy(self, logger: MetricsLogger) -> float:
        from unmask.data import heldout_examples
        from unmask.sampling.accuracy import heldout_accuracy
        from unmask.sampling.loading import training_sampling_defaults

        examples = heldout_examples(self.cfg.data)
        started = time.perf_counter()
        accuracy, rows = heldout_accuracy(
            self.model,
            self.tokenizer,
            examples,
            self.cfg.eval,
            self.cfg.data.packing_length,
            self.device,
            training_sampling_defaults(self.cfg.diffusion),
        )
        for prompt, expected, got in rows[:5]:
            mark = "ok " if expected == got else "bad"
            logger.print(f"  [{mark}] {prompt}{got}   (expected {expected})")
        logger.print(
            f"held-out exact match: {accuracy:.1%} on {len(rows)} prompts "
            f"({time.perf_counter() - started:.0f}s)"
        )
        result = {"heldout_exact_match": accuracy, "num_examples": len(rows), "step": self.step}
        if self.dist.is_main:
            (self.output_dir / "eval_results.json").write_text(json.dumps(result, indent=2))
        logger.log(self.step, {"heldout_exact_match": accuracy})
        return accuracy

    def _summary(self) -> str:
        n_params = sum(p.numel() for p in self.model.parameters())
        start = f"resuming from {self.resume_path} at step {self.step}" if self.step else "fresh"
        return (
            f"unmask: {n_params / 1e6:.2f}M parameters | {len(self.train_rows)} train rows, "
            f"{len(self.eval_rows)} eval rows of {self.cfg.data.packing_length} tokens | "
            f"{self.plan.total_steps} steps on {self.device}{self.dist.describe()} | {start} | "
            f"output_dir {self.output_dir}"
        )
