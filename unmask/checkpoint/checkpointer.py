"""Save and restore a training run's state: one Checkpointer for one process and for many.

A checkpoint-N/ folder holds, for both kinds:
  - the model: one process writes an HF folder (config.json + model.safetensors, or a LoRA
    run's peft adapter), so `unmask generate --model checkpoint-N` works; several processes
    write their shards of model and optimizer with torch.distributed.checkpoint (DCP) into
    dcp/, loadable at any world size, plus config.json for export;
  - optimizer.pt (one process), scheduler.pt, rng_state.pt (loaded with weights_only=True),
    trainer_state.json (step, data-loader position, ...), the tokenizer and the run's extra
    files (generation_config.json);
  - rank_state/rank-R.pt (weights_only), only when a rank has state of its own that the
    steps after the checkpoint need: the rank's cached rollouts of a grpo run saved inside
    a cycle of inner iterations (each rank holds other rows). Every rank writes its file
    before its part of the model's save, which rank 0's publication waits for.
Written into a temporary folder and published atomically (layout.py); under DCP, rank 0
renames after every rank finished, so a rank dying mid-save leaves the previous checkpoint
as the newest complete one.

async_checkpoint: model and optimizer go through DCP's async_save at any world size (a
one-process run too: its checkpoints are then of the DCP kind). The state is copied to CPU
memory before save() returns, the files are written by a background thread while training
goes on, and the small files are written at once into the same temporary folder; the
publication (manifest, fsync, rename, rotation) follows only after every rank's write
finished, so a crash mid-write leaves no folder that looks complete. The next save, the
final save, a restore and the end of train() (also by a signal or an error) wait for it.
"""

import json
import os
import pickle
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from unmask.checkpoint.generation import write_generation_files
from unmask.checkpoint.layout import (
    CONFIG_FILE,
    DCP_DIR,
    RANK_STATE_DIR,
    STATE_FILE,
    damaged,
    is_distributed_checkpoint,
    list_checkpoints,
    older_one,
    publish,
    read_trainer_state,
    temporary_folder,
)
from unmask.checkpoint.state import RunState
from unmask.errors import InputError, RunStopped
from unmask.models import ModelConfig, hf_config_dict
from unmask.models.build import build_empty_like
from unmask.models.diffusion_gemma_layout import VISION_SOURCE_KEYS
from unmask.models.families import FAMILIES
from unmask.models.hf import native_state, read_safetensors, shape_mismatch, split_carried
from unmask.models.lora import ADAPTER_FILE, apply_lora, load_adapter, save_adapter, save_lora
from unmask.parallel.fsdp import full_model_state
from unmask.sampling.generation_file import GENERATION_FILE

OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE = "optimizer.pt", "scheduler.pt", "rng_state.pt"


class Checkpointer:
    """Writes checkpoint-N/ folders of one run and restores a run from one.

    sharded: the model and optimizer are FSDP2-sharded over a process group (every rank
    calls save/load; DCP). tokenizer and files (name -> text) are written into every
    checkpoint; save_total_limit keeps the newest N, and also the one with the lowest eval
    loss with keep_best (the trainer states record it as `eval_loss`).
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        sharded: bool = False,
        tokenizer=None,
        files: dict[str, str] | None = None,
        save_total_limit: int | None = None,
        keep_best: bool = False,
        async_save: bool = False,
        timeout_s: int = 1800,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.sharded = sharded
        self.tokenizer = tokenizer
        self.files = dict(files or {})
        self.save_total_limit = save_total_limit
        self.keep_best = keep_best
        self.async_save = async_save
        self._pending: _Pending | None = None  # the async write in flight
        # the async writes' collectives run in a background thread: a gloo group of their
        # own, so they never interleave with the training's collectives (every rank builds it)
        self._group = None
        if async_save and sharded:
            from datetime import timedelta

            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    @property
    def _is_writer(self) -> bool:
        return not self.sharded or dist.get_rank() == 0

    def save(
        self, step: int, model: nn.Module, optimizer, scheduler, trainer_state: dict,
        rng_state: dict, rank_state: dict | None = None,
    ) -> Path:  # fmt: skip
        """Write checkpoint-{step}; every rank calls it when sharded. rank_state: this
        rank's own state (tensors, ints, lists, dicts), written to rank_state/rank-R.pt when
        given. Asynchronous (async_save): returns once the state is copied; the folder
        appears when the write finished (wait())."""
        self.wait()  # the previous asynchronous write is published first
        state = {**trainer_state, "step": step}
        tmp = self._temporary_folder(step)
        if rank_state:  # before the model's save: its collectives order it before publish
            (tmp / RANK_STATE_DIR).mkdir(exist_ok=True)
            torch.save(rank_state, tmp / self._rank_state_file)
        if self.async_save:
            return self._save_async(step, tmp, model, optimizer, scheduler, state, rng_state)
        if self.sharded:
            import torch.distributed.checkpoint as dcp  # only multi-process runs (0.6 s import)

            model_state, optim_state = sharded_state(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / DCP_DIR))
            state["world_size"] = dist.get_world_size()
        elif hasattr(model, "peft_config"):  # a LoRA run: its adapter
            save_adapter(model, tmp)
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        else:
            model.save_pretrained(tmp)
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if self._is_writer:
            if self.sharded:  # the architecture, for export and sampling
                write_architecture(tmp, model)
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
            torch.save(rng_state, tmp / RNG_FILE)
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            self._write_run_files(tmp)
            keep = best_checkpoint(self.output_dir, tmp) if self.keep_best else None
            publish(tmp, step, self.save_total_limit, keep)
        if self.sharded:
            dist.barrier()
        return self.output_dir / f"checkpoint-{step}"

    def save_state(
        self, step: int, model: nn.Module, optimizer, scheduler, state: RunState
    ) -> Path:
        """`save` with the trainer state, RNG state and this rank's state collected from the
        run's parts (state.py)."""
        trainer_state, rng_state, rank_state = state.collect()
        return self.save(step, model, optimizer, scheduler, trainer_state, rng_state,
                         rank_state or None)  # fmt: skip

    def restore(self, path: Path, model: nn.Module, optimizer, scheduler, state: RunState,
                device: torch.device) -> int:  # fmt: skip
        """Load checkpoint `path` into model, optimizer, scheduler and every part of `state`
        (its checks first, on trainer_state.json alone); returns the checkpoint's step."""
        path = Path(path)
        saved = read_trainer_state(path)  # settings first, then tensors
        for check in state.checks:
            check(saved, path)
        trainer_state, rng_state = self.load(path, model, optimizer, scheduler)
        state.load(trainer_state, rng_state, self.load_rank_state(path, device) or {})
        return trainer_state["step"]

    def _save_async(self, step, tmp, model, optimizer, scheduler, state, rng_state) -> Path:
        import torch.distributed.checkpoint as dcp

        if not self.sharded:  # one process: DCP warns that it saves in a single one (the
            # intent); the warning comes from its writer thread, so the filter is global
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model_state, optim_state = sharded_state(model, optimizer)
        # staged synchronously: a CPU copy of every tensor before this returns, so the next
        # optimizer step (in place) cannot change what is written
        upload = dcp.async_save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=str(tmp / DCP_DIR),
            process_group=self._group,
            no_dist=not self.sharded,
        )
        if self.sharded:
            state["world_size"] = dist.get_world_size()
        if self._is_writer:  # the small files now: they describe this step
            write_architecture(tmp, model)
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
            torch.save(rng_state, tmp / RNG_FILE)
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            self._write_run_files(tmp)
        self._pending = _Pending(upload, tmp, step, self)
        return self.output_dir / f"checkpoint-{step}"

    def _publish(self, tmp: Path, step: int) -> None:
        """Rank 0 (the one writer): manifest, fsync, rename, rotation."""
        if self._is_writer:
            keep = best_checkpoint(self.output_dir, tmp) if self.keep_best else None
            publish(tmp, step, self.save_total_limit, keep)

    def poll(self) -> None:
        """Between steps: an asynchronous write that finished is done with (its error, if
        it failed, raised here); never blocks."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> Path | None:
        """Block until the asynchronous write in flight (if any) is written and published;
        its error, if it failed, is raised here. Returns the published folder."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.result()

    def bytes_needed(self, model: nn.Module, optimizer) -> int:
        """About what the next checkpoint takes on disk: the newest one's size, else the
        model and optimizer state (global sizes, also when sharded), plus 10%."""
        existing = list_checkpoints(self.output_dir)
        if existing:
            size = sum(f.stat().st_size for f in existing[-1].rglob("*") if f.is_file())
        else:
            tensors = list(model.state_dict().values())
            tensors += [v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]  # fmt: skip
            size = sum(t.numel() * t.element_size() for t in tensors)
        return int(size * 1.1)

    def _temporary_folder(self, step: int) -> Path:
        """Where checkpoint N is written before it is published: one folder per writer
        process, or one that rank 0 makes for every rank of a sharded run."""
        if not self.sharded:
            return temporary_folder(self.output_dir, step, f"-{os.getpid()}")
        if dist.get_rank() == 0:
            temporary_folder(self.output_dir, step)
        dist.barrier()
        return self.output_dir / f".tmp-checkpoint-{step}"

    def _write_run_files(self, folder: Path) -> None:
        """The tokenizer and the run's files (generation_config.json)."""
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(folder))
        for name, text in self.files.items():
            if name == GENERATION_FILE:  # transformers' part and unmask's own (generation.py)
                write_generation_files(folder, text)
            else:
                (folder / name).write_text(text)

    @property
    def _rank_state_file(self) -> str:
        return f"{RANK_STATE_DIR}/rank-{dist.get_rank() if self.sharded else 0}.pt"

    def load_rank_state(self, path: Path, device: torch.device) -> dict | None:
        """This rank's rank_state of checkpoint `path` with its tensors on `device`; None
        when it wrote none."""
        name = self._rank_state_file
        if not (Path(path) / name).is_file():
            return None
        return _torch_load(Path(path), name, device)

    def load(self, path: Path, model: nn.Module, optimizer, scheduler) -> tuple[dict, dict]:
        """Restore model, optimizer and scheduler in place from checkpoint `path` (either
        kind, at any world size); returns (trainer_state, rng_state)."""
        self.wait()  # a rollback restores the newest checkpoint: it may be in flight
        path = Path(path)
        sharded = is_distributed_checkpoint(path)
        for name in (SCHEDULER_FILE, RNG_FILE) + (() if sharded else (OPTIMIZER_FILE,)):
            if not (path / name).is_file():  # every piece is there before any is loaded
                raise damaged(path, f"{name} is missing")
        trainer_state = read_trainer_state(path)
        if sharded:
            _load_sharded(path, model, optimizer)
        else:
            _load_model(path, model)
            _load_into(path, OPTIMIZER_FILE, optimizer, "optim")
        _load_into(path, SCHEDULER_FILE, scheduler, "optim.lr_scheduler_type")
        rng_state = _torch_load(path, RNG_FILE)
        return trainer_state, rng_state

    def save_final(self, model: nn.Module, model_cfg: ModelConfig | None = None) -> nn.Module:
        """output_dir/final: the trained model as one HF folder with the tokenizer and the
        run's files. Sharded: every rank gathers the full state, rank 0 writes it through an
        unsharded model of the same architecture. A LoRA run (model_cfg.lora): the peft
        adapter, or the merged model with model_cfg.lora_merge (returned by a one-process
        run, to use from then on; otherwise `model` itself)."""
        self.wait()
        folder = self.output_dir / "final"
        lora = model_cfg is not None and model_cfg.lora
        if self.sharded:
            state = full_model_state(model)  # collective: every rank
            if dist.get_rank() == 0:  # peft names under LoRA: load into a plain peft model
                plain = build_empty_like(model)
                plain = apply_lora(plain, model_cfg) if lora else plain
                plain.load_state_dict(state)
                if lora:
                    save_lora(plain, self.output_dir, folder, model_cfg)
                else:
                    plain.save_pretrained(str(folder))
            dist.barrier()
        elif lora:
            model = save_lora(model, self.output_dir, folder, model_cfg)
        else:
            model.save_pretrained(str(folder))
        if self._is_writer:
            self._write_run_files(folder)
            if lora:  # the adapter folder too: tokenizer and base record, to sample it
                self._write_run_files(self.output_dir / model_cfg.adaptor_name)
        return model


class _Pending:
    """One asynchronous checkpoint write: DCP's upload future, then (in a thread of its own,
    on the writer) the publication once every rank's files are written; DCP's save ends
    with a gather to rank 0, so rank 0's upload finishing means every rank's did."""

    def __init__(self, upload: Future, tmp: Path, step: int, owner: Checkpointer) -> None:
        self.path = owner.output_dir / f"checkpoint-{step}"
        self.error: BaseException | None = None
        self._finished = threading.Event()

        def finish() -> None:
            try:
                upload.result()
                owner._publish(tmp, step)
            except BaseException as err:  # raised in the training thread by result()
                self.error = _write_failed(err, step, owner.output_dir)
            finally:
                self._finished.set()

        threading.Thread(target=finish, name=f"unmask-publish-{step}", daemon=True).start()

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self) -> Path:
        self._finished.wait()
        if self.error is not None:
            raise self.error
        return self.path


def _write_failed(err: BaseException, step: int, output_dir: Path) -> RunStopped:
    """An asynchronous write's error as a RunStopped naming the first failure (DCP wraps
    each rank's in a CheckpointException) and the newest complete checkpoint; `err` is its
    cause, so the trainer can tell a lost peer process from a disk that failed."""
    first_failure = err
    failures = getattr(err, "failures", None)
    if failures:
        first_failure = next(iter(failures.values()))[0]
    first = (str(first_failure).strip().splitlines() or [""])[0]
    saved = list_checkpoints(output_dir)
    last = str(saved[-1]) if saved else "none (no checkpoint yet)"
    stopped = RunStopped(
        f"checkpoint-{step} could not be written ({type(first_failure).__name__}: {first}); the "
        f"last complete checkpoint is {last}: fix the cause and resume with "
        "train.resume_from_checkpoint=true"
    )
    stopped.__cause__ = err
    return stopped


def check_async_request(async_checkpoint: bool, lora: bool) -> None:
    """train.async_checkpoint with settings it cannot write: an InputError before anything
    is written."""
    if async_checkpoint and lora:
        raise InputError(
            "train.async_checkpoint does not support model.lora (adapter checkpoints are "
            "written synchronously); set train.async_checkpoint=false"
        )


def best_checkpoint(output_dir: Path, new: Path | None = None) -> Path | None:
    """The checkpoint with the lowest eval_loss in its trainer_state.json, among those in
    output_dir and `new` (the one being written); None when that is `new` or none recorded
    one."""
    best, best_loss = None, float("inf")
    for path in [*list_checkpoints(output_dir), *([new] if new else [])]:
        try:
            loss = json.loads((path / STATE_FILE).read_text()).get("eval_loss")
        except (OSError, json.JSONDecodeError):
            continue
        if loss is not None and loss < best_loss:
            best, best_loss = path, loss
    return None if best == new else best  # the new one is the newest: never pruned


CARRIED_FILE = "carried.safetensors"
"""A DCP checkpoint's folder tensors the model carries unrun (DiffusionGemma's frozen vision
tower), which its model state does not hold."""


def write_architecture(folder: Path, model: nn.Module) -> None:
    """A DCP checkpoint's config.json (the model's architecture, with a DiffusionGemma
    folder's vision keys: its tower) and `CARRIED_FILE` (the carried tensors, if any), so
    its export and sampling rebuild the model with its tower (saved.py
    gather_distributed_checkpoint)."""
    config = hf_config_dict(model.config)
    source = getattr(model, "hf_source_config", None) or {}
    config.update({key: source[key] for key in VISION_SOURCE_KEYS if key in source})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    carried = getattr(model, "hf_carried_weights", None) or {}
    if carried:
        save_file({k: v.contiguous() for k, v in carried.items()}, str(folder / CARRIED_FILE))


def _load_model(path: Path, model: nn.Module) -> None:
    """The weights of a one-process checkpoint into model (the adapter of a LoRA run)."""
    if hasattr(model, "peft_config"):
        load_adapter(path, model)
        return
    if not (path / "model.safetensors").is_file():
        lora = (path / ADAPTER_FILE).is_file()
        raise InputError(
            f"checkpoint {str(path)!r} holds no model.safetensors"
            + ("; it was written by a LoRA run: set model.lora: true" if lora else "")
            + "; resume with the config it was written with"
        )
    weights = read_safetensors(path / "model.safetensors", older_one(path))
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig) and FAMILIES[config.model_type].kind == "native":
        # save_pretrained wrote the family's folder names (key map, expert layout, carried
        # tensors): back to the model's own
        family = config.model_type
        weights, carried = split_carried(native_state(weights, family, config, path), family)
        own = model.state_dict()  # a registered (trained) vision tower's are the model's
        weights.update({key: value for key, value in carried.items() if key in own})
    wrong = shape_mismatch(model, weights)
    if wrong:
        raise InputError(
            f"checkpoint {str(path)!r} does not match the model in the config ({wrong}); "
            "resume with the config it was written with"
        )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise InputError(
            f"checkpoint {str(path)!r} does not match the model in the config "
            f"(missing {sorted(set(missing) - allowed_missing)[:3]}, unexpected "
            f"{sorted(unexpected)[:3]}); resume with the config it was written with"
        )


def _torch_load(path: Path, name: str, device: torch.device | None = None):
    """One torch file of checkpoint `path` (weights_only); a damaged one is an InputError."""
    try:
        return torch.load(path / name, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0]
        raise damaged(path, f"{name} cannot be read: {first}") from None


def _load_into(path: Path, name: str, target, section: str) -> None:
    """target.load_state_dict from checkpoint file `name`; a state of another shape (another
    optimizer or schedule than the config's `section`) is an InputError."""
    try:
        target.load_state_dict(_torch_load(path, name))
    except (ValueError, KeyError, RuntimeError, TypeError) as err:
        first = (str(err).strip().splitlines() or [""])[0] or type(err).__name__
        raise InputError(
            f"checkpoint {str(path)!r}: {name} does not match {section} in the config "
            f"({first}); resume with the config it was written with"
        ) from None


#: the optimizer's per-group list of parameter names: it differs between layouts (a
#: pipeline stage's groups hold that stage's names), so it is neither saved nor loaded
_GROUP_NAMES = ".param_names"


def sharded_state(model: nn.Module, optimizer, legacy: bool = False) -> tuple[dict, dict]:
    """(model, optimizer) state for DCP, the optimizer's flattened by parameter name
    ("state.<fqn>.<key>", "param_groups.<fqn>.<key>"): every entry names its parameter,
    so the state loads into any layout, also one whose optimizer groups the parameters
    otherwise (a pipeline stage holds only its own). legacy: groups by their index, as
    checkpoints written before were."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=not legacy)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if not legacy:
        optim_state = {k: v for k, v in optim_state.items() if not k.endswith(_GROUP_NAMES)}
    return model_state, optim_state


def _is_legacy(folder: Path) -> bool:
    """Whether a DCP folder holds the optimizer's groups by index (before flattening)."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return any(key.startswith("optim.param_groups.0.") for key in keys)


def _load_sharded(path: Path, model: nn.Module, optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    try:
        legacy = _is_legacy(path / DCP_DIR)
    except Exception:  # an unreadable folder: dcp_load below says so
        legacy = False
    model_state, optim_state = sharded_state(model, optimizer, legacy)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp_load(state, path / DCP_DIR)
    except Exception as err:  # DCP raises CheckpointException with every rank's traceback
        raise InputError(
            f"checkpoint {str(path)!r} does not match the model and optimizer in the config "
            f"({type(err).__name__}); resume with the config it was written with"
        ) from None
    optim_loaded = state["optim"]
    options = StateDictOptions(flatten_optimizer_state_dict=not legacy)
    if not legacy:  # this layout's group names, with everything else loaded
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        current = get_optimizer_state_dict(model, optimizer, options=options)
        names = {k: v for k, v in current.items() if k.endswith(_GROUP_NAMES)}
        optim_loaded = {**optim_loaded, **names}
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=optim_loaded, options=options)  # fmt: skip


def dcp_load(state: dict, folder: Path, no_dist: bool = False) -> None:
    """dcp.load in place: only the entries `state` holds are read. no_dist (or no process
    group): this process alone reads them, also inside a multi-process job; that is the
    intent, so no warning."""
    import torch.distributed.checkpoint as dcp  # only DCP checkpoints need it (0.6 s import)

    with warnings.catch_warnings():
        if no_dist or not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder), no_dist=no_dist)
