"""The one training loop: batches -> objective -> (loss_sum, count) -> backward ->
global normalization -> clip -> optimizer -> schedule -> metrics and checkpoints.

Everything that can reject user input (config, tokenizer, data, output_dir, resume
path) runs before anything is written, so bad input never leaves a half-made run.
"""

import copy
import json
import shutil
import time
from pathlib import Path

import torch

from unmask.checkpoint import STATE_FILE, Checkpointer, list_checkpoints, resolve_resume
from unmask.config import RunConfig, dump_config
from unmask.data import (
    adopt_mask_token,
    build_datasets,
    build_tokenizer,
    ensure_special_tokens,
    eval_batches,
    heldout_examples,
    make_loader,
)
from unmask.data.streaming import StreamSpec
from unmask.diffusion import build_objective
from unmask.diffusion.cutoffs import random_length_cut
from unmask.errors import InputError
from unmask.models import build_model, decoder_layers, folder_mask_token_id
from unmask.models.lora import (
    apply_lora,
    base_fingerprint,
    check_base_fingerprint,
    check_lora_settings,
    lora_settings,
    lora_targets,
)
from unmask.models.lora import check_request as check_lora_request
from unmask.models.quant import check_4bit, quantize_4bit
from unmask.optim.config import build_optimizer
from unmask.optim.schedule import build_scheduler
from unmask.parallel.batch import per_rank_batch_size, rank_generator
from unmask.parallel.distributed import all_reduce_sum, full_value, setup
from unmask.parallel.fsdp import apply_fsdp, compile_blocks, sync_gradients
from unmask.parallel.mesh import launch_env, share_from_rank0
from unmask.sampling.accuracy import heldout_accuracy
from unmask.sampling.config import GENERATION_FILE, fixed_by_training, generation_config_text
from unmask.train.metrics import MetricsLogger, SilentLogger
from unmask.train.plan import make_plan

RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "tensorboard", "final", "eval_results.json")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("train.device is 'cuda' but no CUDA device is visible; use auto or cpu")
    return torch.device(name)


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
        env = launch_env()
        # rows per micro-batch on this rank; the global batch grows with the world size
        # unless split_batches (then per_device_train_batch_size is the global batch)
        self.local_batch_size = per_rank_batch_size(
            t.per_device_train_batch_size, env.world_size, t.split_batches
        )
        batch_ranks = 1 if t.split_batches else env.world_size
        self.dist = setup(resolve_device(t.device), shard=t.fsdp2, dp_replicate=t.dp_replicate,
                          dp_shard=t.dp_shard, timeout_s=t.ddp_timeout, env=env)  # fmt: skip
        self.device = self.dist.device
        self.sharded = self.dist.mesh is not None  # world size 1: no process group, no mesh
        check_4bit(cfg.model, self.device, self.dist.world_size)
        self.tokenizer = build_tokenizer(cfg.data)
        saved_tokenizer = copy.deepcopy(self.tokenizer)  # token stores were made with this
        if cfg.model.pretrained is not None:  # LLaDA / Dream folders name their mask id
            folder_mask = folder_mask_token_id(cfg.model.pretrained)
            if folder_mask is not None:
                source = f"model.pretrained {cfg.model.pretrained!r}"
                adopt_mask_token(self.tokenizer, folder_mask, source)
        added_tokens = ensure_special_tokens(self.tokenizer)
        if added_tokens and cfg.model.lora:
            raise InputError(
                "the tokenizer has no mask (or EOS) token and one cannot be added under "
                "model.lora: true (the embeddings are frozen); use a tokenizer that has one"
            )
        data = build_datasets(cfg.data, self.tokenizer, saved_tokenizer)
        self.train_rows, self.eval_rows = data.train, data.eval
        self.notices = [*cfg.notices, *data.notices]  # the config file's, then the data's
        self.num_rows = None if isinstance(data.train, StreamSpec) else len(data.train)
        self.plan = make_plan(cfg, self.num_rows, batch_ranks)
        self.output_dir = Path(t.output_dir)
        self.resume_path = share_from_rank0(lambda: prepare_output_dir(self.output_dir, cfg))

        torch.manual_seed(t.seed)
        self.model = self._build_model(added_tokens)
        self.objective = build_objective(cfg.diffusion, self.tokenizer.mask_token_id)
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = build_scheduler(
            self.optimizer,
            cfg.optim.lr_scheduler_type,
            self.plan.total_steps,
            self.plan.warmup_steps,
            cfg.optim.min_lr_ratio,
        )
        # each rank reads only its rows of every global micro-batch, in worker processes
        # ahead of the step when asked
        self.loader = make_loader(
            self.train_rows, self.local_batch_size, t.seed, self.dist.rank,
            self.dist.world_size, t.dataloader_num_workers, self.device.type == "cuda",
        )  # fmt: skip
        self.noise = torch.Generator(device=self.device)
        self.noise.manual_seed(t.seed + 1)
        self.step = 0
        self.tokens_seen = 0
        self._lora_base: list[float] | None = None
        # generation_config.json: how this model must be sampled (Dream's shift, BD3LM's
        # block-causal attention; only what the objective fixes), so `unmask generate`,
        # export and lm-eval need no flags
        sampling = generation_config_text(
            self.tokenizer, fixed_by_training(cfg.diffusion), complete=False
        )
        self.checkpointer = Checkpointer(
            self.output_dir,
            sharded=self.sharded,
            tokenizer=self.tokenizer,
            files={GENERATION_FILE: sampling},
            save_total_limit=t.save_total_limit,
        )

        if self.resume_path is not None:  # before config.yaml: a mismatch changes nothing
            self._restore(self.resume_path)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            (self.output_dir / "config.yaml").write_text(dump_config(cfg))

    def _build_model(self, added_tokens: int) -> torch.nn.Module:
        """The model on its device, in torchtitan's order: vocabulary resize, 4-bit base,
        activation checkpointing, per-block compile, LoRA, then FSDP2 over the mesh."""
        cfg, t = self.cfg, self.cfg.train
        model = build_model(cfg.model)
        if added_tokens or model.config.vocab_size < len(self.tokenizer):
            model.resize_token_embeddings(max(len(self.tokenizer), model.config.vocab_size))
        if cfg.model.load_in_4bit:  # QLoRA: frozen NF4 base, quantized onto the device
            compute = torch.bfloat16 if t.bf16 else torch.float32
            quantize_4bit(model, lora_targets(cfg.model, model), self.device, compute)
        model.gradient_checkpointing = t.gradient_checkpointing
        if t.torch_compile:
            compile_blocks(decoder_layers(model))
        if cfg.model.lora:  # peft wrapper: base frozen, LoRA factors train (AdamW)
            model = apply_lora(model, cfg.model)
        model.to(self.device)
        if self.sharded:
            apply_fsdp(model, self.dist.mesh, decoder_layers(model), bf16=t.bf16,
                       reshard_after_forward=t.reshard_after_forward)  # fmt: skip
        return model

    # -- state ---------------------------------------------------------------------------
    def _rng_state(self) -> dict:
        return {"torch": torch.get_rng_state(), "noise": self.noise.get_state()}

    def _restore(self, path: Path) -> None:
        saved = json.loads((path / STATE_FILE).read_text())  # settings first, then tensors
        check_lora_settings(saved.get("lora"), self.cfg.model, path)
        state, rng = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler)
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
        if self.cfg.model.lora and not self.sharded:  # adapter-only checkpoints
            if self._lora_base is None:
                self._lora_base = base_fingerprint(self.model)
            state["lora_base_fingerprint"] = self._lora_base
        return state

    def save(self) -> Path:
        return self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler,
                                      self._trainer_state(), self._rng_state())  # fmt: skip

    # -- one step ------------------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.train.bf16)

    def _rank_noise(self, batch: dict, where: tuple[int, int]) -> tuple[dict, torch.Generator]:
        """This rank's micro-batch with the noise its objective uses, and the generator.
        An objective with `global_noise` draws the randomness of the whole global batch
        from the generator every rank holds in the same state and keeps this rank's rows:
        a row gets the noise it would get in a one-process run of the same global batch,
        so losses do not depend on the world size. Other objectives draw on their own rows
        from a generator seeded by (seed, where = (step, micro-batch), rank)."""
        if getattr(self.objective, "global_noise", False):
            b = self.local_batch_size
            rows = (self.dist.rank * b, self.dist.world_size * b)
            return self.objective.with_noise(batch, self.noise, rows), self.noise
        return batch, rank_generator(self.noise, where, self.dist.rank)

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
            if self.sharded:
                batch, noise = self._rank_noise(batch, (self.step, index))
                sync_gradients(self.model, index == len(batches) - 1)
            with self._autocast():
                loss_sum, count = self.objective(self.model, batch, noise)
            loss_sum.backward()
            loss_sum_total += loss_sum.detach().float()
            count_total += count.detach().float()
        if self.sharded:  # sum over ranks: the normalization stays global
            loss_sum_total, count_total = all_reduce_sum(loss_sum_total, count_total)
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
            stats["grad_norm"] = float(full_value(grad_norm))
        return stats

    @torch.no_grad()
    def evaluate(self) -> float:
        """Eval loss on held-out rows with fixed noise, so evaluations are comparable."""
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
        logger = (MetricsLogger if self.dist.is_main else SilentLogger)(
            self.output_dir,
            plan.total_steps,
            start_step=self.step,
            report_to=tuple(cfg.train.report_to),
            run_name=cfg.train.run_name,
            show_progress=not cfg.train.disable_tqdm,
            config=cfg.model_dump(mode="json"),
        )
        logger.print(self._summary())
        for notice in self.notices:
            logger.print(notice)
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
            self.model = self.checkpointer.save_final(self.model, cfg.model)
            if cfg.eval.generate_accuracy:
                last["heldout_exact_match"] = self._heldout_accuracy(logger)
        finally:
            logger.close()
            self.loader.close()
        return last

    def _heldout_accuracy(self, logger: MetricsLogger) -> float:
        examples = heldout_examples(self.cfg.data)
        started = time.perf_counter()
        accuracy, rows = heldout_accuracy(
            self.model,
            self.tokenizer,
            examples,
            self.cfg.eval,
            self.cfg.data.packing_length,
            self.device,
            fixed_by_training(self.cfg.diffusion),
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
        rows = "streamed" if self.num_rows is None else self.num_rows
        start = f"resuming from {self.resume_path} at step {self.step}" if self.step else "fresh"
        return (
            f"unmask: {n_params / 1e6:.2f}M parameters | {rows} train rows, "
            f"{len(self.eval_rows)} eval rows of {self.cfg.data.packing_length} tokens | "
            f"{self.plan.total_steps} steps on {self.device}{self.dist.describe()} | {start} | "
            f"output_dir {self.output_dir}"
        )
