"""Trainer settings, in the HF TrainingArguments vocabulary users already know."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class AcceleratorConfig(BaseModel):
    """The HF TrainingArguments ``accelerator_config`` keys unmask reads."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    split_batches: bool | None = None
    """Same as train.split_batches."""


class TrainConfig(BaseModel):
    """The training loop: length, batch, logging, evaluation, checkpoints, precision."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    output_dir: str = "runs/quickstart"
    """Run directory: config.yaml, metrics.jsonl, checkpoint-N/, final/. A config file that
    leaves it out runs in runs/<the file's name> (run.yaml: runs/run)."""
    overwrite_output_dir: bool = False
    """Replace an existing run in output_dir (its checkpoints and metrics are removed)."""
    resume_from_checkpoint: bool | str | None = None
    """true: continue from the newest checkpoint in output_dir, which must be intact (a
    folder with none yet starts fresh; a finished run is left as it is); a path: from that
    checkpoint."""
    max_steps: int = -1
    """Optimizer steps to run; -1 = derive from num_train_epochs."""
    num_train_epochs: float = Field(1.0, ge=0)
    """Passes over the training rows, used when max_steps is -1."""
    per_device_train_batch_size: int = Field(8, ge=1)
    """Rows per micro-batch on each device."""
    per_device_eval_batch_size: int = Field(32, ge=1)
    """Rows per batch when computing the eval loss (no backward, no optimizer state: larger
    than the train batch runs faster; on a 2-core CPU 32 rows gave 1.5-4x the rows/s of 8,
    and 128 no more than 32). With the default masked-diffusion objective the eval loss does
    not depend on it (each row's noise has its own seed; SFT, Dream and BD3LM draw per
    batch); eval_max_batches counts these batches."""
    dataloader_num_workers: int = Field(0, ge=0)
    """Worker processes that read and build the next batches while the model trains (0 = in
    the training process). Each rank reads only its own rows either way."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step; the loss is normalized over all of them together."""
    logging_steps: float = Field(10, ge=0)
    """Log every N steps (float < 1 = fraction of max_steps)."""
    eval_steps: float = Field(0, ge=0)
    """Eval loss every N steps (float < 1 = fraction of max_steps); 0 = only at the end."""
    eval_max_batches: int | None = Field(8, ge=1)
    """Eval batches per evaluation (None = the whole eval split)."""
    save_steps: float = Field(500, ge=0)
    """Checkpoint every N steps (float < 1 = fraction of max_steps); the last step is always saved."""
    save_total_limit: int | None = Field(None, ge=1)
    """Keep only the newest N checkpoints (None = keep all); the newest is never deleted."""
    keep_best: bool = False
    """With save_total_limit: also keep the checkpoint with the lowest eval loss."""
    async_checkpoint: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint's async_save): the
    loop stops only while the state is copied to CPU memory, then trains on while the files
    are written; the folder is published (manifest, rename, rotation) once they are. Its
    checkpoints are of the DCP kind (dcp/ + config.json) also in a one-process run. The
    stall is logged as save_stall_seconds; docs/operations.md has the measurement. Not with
    model.lora."""
    on_disk_full: Literal["stop", "continue"] = "stop"
    """When the disk cannot hold the next checkpoint (checked before writing it): stop with
    a message naming the last checkpoint, or skip this save and train on to the next."""
    max_bad_steps: int = Field(5, ge=1)
    """Steps in a row with a non-finite loss or gradient norm before the run stops (each
    such step is skipped: no update, schedule unchanged, counted in metrics.jsonl)."""
    nan_rollback: bool = False
    """After max_bad_steps bad steps in a row, go back to the last checkpoint and continue
    with the learning rate scaled by lr_backoff, instead of stopping."""
    lr_backoff: float = Field(0.5, gt=0.0, le=1.0)
    """Learning-rate factor applied at each nan_rollback (they multiply)."""
    nonfinite_check: Literal["step", "logging"] = "step"
    """When the non-finite flag is read. `step`: every step, before the update (a bad step
    is skipped, as max_bad_steps says; the step's one host-device sync). `logging`: with the
    logging window, before each log line, evaluation and checkpoint (no sync in the steps
    between, as torchtitan: on a GPU the host runs ahead and queues the next step's kernels
    while this one runs); a bad step has updated the weights by then, so the run stops, or
    with nan_rollback goes back to its last checkpoint, and under several processes a stop
    signal is acted on at that read too. docs/operations.md."""
    seed: int = 42
    """Seed for model init, data order and noise."""
    bf16: bool = False
    """Run forward/backward under bfloat16 autocast (weights and optimizer stay float32)."""
    float8: bool = False
    """Train the decoder blocks' linear layers in float8 (torchao's dynamic tensorwise scales;
    GPUs of compute capability 8.9 and newer: H100, H200, L4): torchtitan measured +28%
    tokens/s on an 8B model. The LM head, embedding and MoE experts stay bf16; needs
    train.bf16 and `pip install 'unmask[float8]'` (docs/parallelism.md)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward to save memory."""
    activation_checkpointing: Literal["auto", "none", "full", "selective"] | None = "auto"
    """Which decoder layers recompute their activations in backward: none, full (every layer; the same as gradient_checkpointing: true) or selective (every activation_checkpointing_every-th layer, counting from the first). auto (or unset): `unmask train` takes the least recomputation whose peak memory `unmask plan` puts within the device's (none, else selective, else full) and says which at start-up; a gradient_checkpointing given in the config decides instead (true: full, false: none)."""
    activation_checkpointing_every: int = Field(2, ge=1)
    """selective activation checkpointing: checkpoint layers 0, n, 2n, ... (n = this)."""
    torch_compile: bool = False
    """torch.compile each transformer block (after activation checkpointing, before FSDP2)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu."""
    num_threads: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    """Torch's intra-op threads (torch.set_num_threads). auto: a model under 5M parameters on
    a CPU gets one thread per core not busy with other work at start-up (on a shared 2-core
    machine one thread trained a tiny model 2-12x faster than two; idle, two are 1.7x faster:
    README, CPU threads), unless OMP_NUM_THREADS is set; otherwise torch's default (every
    core). A number sets that many."""
    trim_host_memory: bool = True
    """CPU runs on Linux: return freed memory to the OS at once (glibc malloc's trim
    threshold set to 0) instead of keeping freed activations in the heap, where the next
    large allocation (an embedding's gradient) cannot reuse them. Peak RSS 11% lower at
    hidden 256 / 4 layers, vocabulary 151,936 (benchmarks/results/train_step.md); false =
    glibc's defaults."""
    report_to: list[str] = []
    """Extra loggers: "tensorboard", "wandb" (the wandb extra; WANDB_MODE=offline works
    without a network) and "trackio" (the trackio extra, local by default); "none" =
    nothing. A logger whose package is missing stops the run before anything is written."""
    run_name: str | None = None
    """Name shown by loggers; defaults to the output_dir's name."""
    log_level: Literal["info", "debug"] = "info"
    """debug: the start-up log also lists every trainable parameter with its shape, its
    optimizer (Muon or AdamW) and the routing rule that chose it (`unmask train --debug`
    sets it)."""
    log_mfu: bool = True
    """Log mfu (model FLOPs utilization, 0-1: the model's FLOPs per second over the device's
    peak; formula in docs/operations.md) at every logging step. The peak is a known GPU's
    datasheet number, else a short matmul measurement at start-up, cached in
    ~/.cache/unmask/peak_flops.json ($UNMASK_CACHE_DIR to move it)."""
    disable_tqdm: bool = False
    """Hide the live progress bar (log lines are still printed)."""
    split_batches: bool = False
    """per_device_train_batch_size is the global batch, split over the processes (it must divide by the world size)."""
    accelerator_config: AcceleratorConfig | None = None
    """Seed spelling (HF/LMMs-Engine): accelerator_config.split_batches sets split_batches."""
    ddp_timeout: int = Field(1800, ge=1)
    """Seconds a collective may wait for a peer before the run stops (one line naming the step, the newest checkpoint and the resume command; exit code 1)."""

    @model_validator(mode="after")
    def _accelerator_config(self):
        accelerator = self.accelerator_config
        if accelerator is not None and accelerator.split_batches is not None:
            self.split_batches = accelerator.split_batches
        return self

    @field_validator("max_steps")
    @classmethod
    def _max_steps(cls, value: int) -> int:
        if value < 1 and value != -1:
            raise ValueError("must be >= 1, or -1 to derive it from num_train_epochs")
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value):
        if value is None or value == "none":
            return []
        if isinstance(value, str):
            return [value]
        return [v for v in value if v != "none"]

    @field_validator("report_to")
    @classmethod
    def _known_reporters(cls, value):
        for name in value:
            if name not in ("tensorboard", "wandb", "trackio"):
                raise ValueError(
                    f"unknown reporter {name!r}; use tensorboard, wandb, trackio or none"
                )
        return value
