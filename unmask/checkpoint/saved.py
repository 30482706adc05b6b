"""The model in any folder unmask writes, as one plain model in this process.

Four kinds of model folder (`saved_kind`):
  - "hf": config.json + model.safetensors (a one-process checkpoint-N, final/, an exported
    or downloaded folder, a LoRA run's merged final/);
  - "dcp": a multi-process checkpoint-N (config.json + dcp/ shards): the model entries only
    are read here, in one process without a process group (never the optimizer's);
  - "lora-dcp": the same, of a LoRA run: the shards hold the base weights and the LoRA
    factors under peft's names; they are read into a peft model and merged;
  - "adapter": a LoRA adapter in peft's format (a one-process LoRA checkpoint-N, the
    unmerged final/, output_dir/adaptor): its base is rebuilt from what the adapter
    records (`adapter_base`) and the adapter merged into it.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from unmask.checkpoint.checkpointer import CARRIED_FILE, dcp_load
from unmask.checkpoint.layout import (
    ADAPTER_CONFIG,
    CONFIG_FILE,
    DCP_DIR,
    STATE_FILE,
    is_distributed_checkpoint,
)
from unmask.errors import InputError
from unmask.models import (
    DiffusionTransformer,
    ModelConfig,
    build_empty,
    build_model,
    config_from_hf,
    from_pretrained,
)
from unmask.models.diffusion_gemma_layout import TOWER
from unmask.models.diffusion_gemma_vision import attach_vision, register_empty_vision
from unmask.models.hf import read_config
from unmask.models.lora import (
    LORA_BASE_FILE,
    LORA_SETTINGS,
    adapts_vision,
    apply_lora,
    merge_adapter,
    weights_fingerprint,
)

RUN_CONFIG = "config.yaml"  # the run's resolved config, in output_dir


def _base_fix(model: str = "the model it was trained on") -> str:
    return f"pass --base FOLDER with {model} (lm-eval: base=FOLDER in model_args)"


def saved_kind(folder: Path) -> str:
    """The kind of model folder: hf, dcp, lora-dcp or adapter (the module docstring)."""
    folder = Path(folder)
    if is_distributed_checkpoint(folder):
        return "lora-dcp" if _dcp_lora_settings(folder) is not None else "dcp"
    if not (folder / CONFIG_FILE).is_file() and (folder / ADAPTER_CONFIG).is_file():
        return "adapter"
    return "hf"


@dataclass
class AdapterBase:
    """The base model of a LoRA adapter: a folder, or a config and seed to rebuild it."""

    folder: Path | None  # model.pretrained (or --base); None: built from `model` and `seed`
    model: ModelConfig | None
    seed: int
    vocab_size: int | None  # after the run's resize, when recorded
    fingerprint: list[float] | None  # base_fingerprint at training time, when recorded


def adapter_base(folder: Path, base: str | Path | None = None) -> AdapterBase:
    """Where the base of the adapter in folder comes from: `base` (a folder, --base) when
    given, else what the adapter records: lora_base.json (written since unmask records
    bases), peft's base_model_name_or_path, or, for older checkpoints, the run's config.yaml
    in the parent folder. A base folder that is not there is one InputError naming it."""
    folder = Path(folder)
    record = _base_record(folder)
    if record is None:
        raise InputError(
            f"LoRA adapter {str(folder)!r} records no base model (no {LORA_BASE_FILE}, no "
            f"base_model_name_or_path in {ADAPTER_CONFIG}, no {RUN_CONFIG} beside it); "
            + _base_fix()
        )
    model = _base_config(record.get("model"), folder)
    pretrained = record.get("pretrained")
    fingerprint = record.get("fingerprint")
    if fingerprint is None and (folder / STATE_FILE).is_file():
        fingerprint = _read_json(folder / STATE_FILE).get("lora_base_fingerprint")
    if (record.get("model") or {}).get("load_in_4bit"):  # trained on 4-bit weights, merged
        fingerprint = None  # into the full-precision base: another fingerprint
    if base is not None:
        chosen = Path(base).expanduser()
        if not (chosen / CONFIG_FILE).is_file():
            raise InputError(
                f"--base {str(base)!r} is not a model folder (no {CONFIG_FILE}); give the "
                "folder of the model the adapter was trained on"
            )
    elif pretrained is not None:
        chosen = Path(pretrained).expanduser()
        if not (chosen / CONFIG_FILE).is_file():
            raise InputError(
                f"LoRA adapter {str(folder)!r} was trained on base model {pretrained!r}, which "
                f"is not a model folder here; {_base_fix('that model')}"
            )
    elif model is None:
        raise InputError(f"LoRA adapter {str(folder)!r} names no local base model; {_base_fix()}")
    else:
        chosen = None
    return AdapterBase(chosen, model, int(record.get("seed", 42)), record.get("vocab_size"),
                       fingerprint)  # fmt: skip


def _base_config(section: dict | None, folder: Path) -> ModelConfig | None:
    """The recorded model section as the base's config (no LoRA, no 4-bit)."""
    if not section:
        return None
    try:
        return ModelConfig(**{**section, "lora": False, "load_in_4bit": False})
    except ValueError as err:  # pydantic's ValidationError
        first = str(err).strip().splitlines()[0]
        raise InputError(
            f"LoRA adapter {str(folder)!r}: the base model it records is not a valid model "
            f"config ({first}); {_base_fix()}"
        ) from None


def _base_record(folder: Path) -> dict | None:
    """lora_base.json; else peft's base_model_name_or_path and the run's config.yaml (the
    parent folder's: checkpoints of runs from before the record existed); None: nothing."""
    path = folder / LORA_BASE_FILE
    if path.is_file():
        return _read_json(path)
    record: dict = {}
    run_config = folder.parent / RUN_CONFIG
    if run_config.is_file():
        try:
            tree = yaml.safe_load(run_config.read_text()) or {}
        except yaml.YAMLError:
            tree = {}
        if isinstance(tree.get("model"), dict) and tree["model"].get("lora"):
            record = {"model": tree["model"], "pretrained": tree["model"].get("pretrained"),
                      "seed": (tree.get("train") or {}).get("seed", 42)}  # fmt: skip
    peft_base = _read_json(folder / ADAPTER_CONFIG).get("base_model_name_or_path")
    if peft_base:
        record["pretrained"] = peft_base
    return record or None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{str(path)!r} is not readable JSON ({err}); copy it again") from None
    if not isinstance(value, dict):
        raise InputError(f"{str(path)!r} is not a JSON object; copy it again")
    return value


@dataclass
class SavedFolder:
    """A model folder checked before anything heavy is read (`inspect_saved`)."""

    folder: Path
    kind: str  # saved_kind
    base: AdapterBase | None  # an adapter's

    @property
    def config_folder(self) -> Path | None:
        """The folder whose config.json describes the model (an adapter's base folder)."""
        if self.base is not None:
            return self.base.folder
        return self.folder


def inspect_saved(folder: Path, base: str | Path | None = None) -> SavedFolder:
    """folder's kind, with its config.json read (a broken one is named as such) or, for an
    adapter, its base found; `base` (--base) overrides an adapter's recorded base and is an
    error for anything else."""
    folder = Path(folder)
    kind = saved_kind(folder)
    if base is not None and kind != "adapter":
        raise InputError(
            f"--base is for unmerged LoRA adapters; {str(folder)!r} holds a whole model "
            "(drop --base)"
        )
    if kind != "adapter":
        read_config(folder)
        return SavedFolder(folder, kind, None)
    return SavedFolder(folder, kind, adapter_base(folder, base))


def load_saved_model(saved: SavedFolder, dtype: torch.dtype | None = None) -> DiffusionTransformer:
    """The full model (on the CPU, in eval mode, `dtype` or float32) of an `inspect_saved`
    folder; an adapter is merged into its base."""
    if saved.kind == "hf":
        return from_pretrained(saved.folder, dtype=dtype).eval()
    if saved.kind == "adapter":
        model = _merged_adapter(saved.folder, saved.base)
    else:
        model = gather_distributed_checkpoint(saved.folder)
    return model.to(dtype) if dtype is not None else model


def _merged_adapter(folder: Path, spec: AdapterBase) -> DiffusionTransformer:
    """The base as the run built it (same seed: a resized vocabulary gets the same rows),
    checked against the recorded fingerprint, with the adapter merged in."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = from_pretrained(spec.folder) if spec.folder is not None else build_model(spec.model)
        if adapts_vision(folder):  # its vision tower registered, as the run's base had it
            attach_vision(model, True)
        if spec.vocab_size is not None and model.config.vocab_size < spec.vocab_size:
            model.resize_token_embeddings(spec.vocab_size)
    if spec.fingerprint is not None:
        now = weights_fingerprint(model.parameters())
        if any(abs(a - b) > 1e-6 * max(1.0, abs(a)) for a, b in zip(spec.fingerprint, now)):
            source = str(spec.folder) if spec.folder else "the config it records"
            raise InputError(
                f"LoRA adapter {str(folder)!r} was trained on other base weights than those "
                f"of {source!r}; {_base_fix()}"
            )
    return merge_adapter(model, folder).eval()


def _dcp_lora_settings(folder: Path) -> dict | None:
    """The LoRA settings a sharded checkpoint's trainer_state.json records (None: no LoRA)."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text()).get("lora")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return settings if isinstance(settings, dict) else None


def _with_tower(model: nn.Module, source: dict, path: Path) -> None:
    """A DiffusionGemma checkpoint's vision tower on the empty model: its config.json's keys
    and carried tensors (checkpointer.py write_architecture), and the registered (trained)
    tower where the DCP state holds one."""
    if "vision_config" not in source:
        return
    from torch.distributed.checkpoint import FileSystemReader

    carried = path / CARRIED_FILE
    model.hf_source_config = source
    model.hf_carried_weights = load_file(str(carried)) if carried.is_file() else {}
    keys = FileSystemReader(str(path / DCP_DIR)).read_metadata().state_dict_metadata
    if any(f".{TOWER}" in key for key in keys):
        register_empty_vision(model, source)


def gather_distributed_checkpoint(path: Path) -> DiffusionTransformer:
    """The full model of a sharded (DCP) checkpoint-N, in one process without a process
    group; only the model's entries are read. A LoRA run's (peft names: base weights and
    factors) is read into a peft model of its settings and merged."""
    path = Path(path)
    if not is_distributed_checkpoint(path):
        raise InputError(f"{str(path)!r} is not a sharded (DCP) unmask checkpoint")
    source = read_config(path)
    cfg = config_from_hf(source)
    model = build_empty(cfg)
    _with_tower(model, source, path)
    settings = _dcp_lora_settings(path)
    if settings is not None:
        lora = {k: v for k, v in settings.items() if k in LORA_SETTINGS and k != "load_in_4bit"}
        model = apply_lora(model, cfg.model_copy(update={**lora, "lora": True}))
    state = {"model": model.state_dict()}
    try:
        dcp_load(state, path / DCP_DIR, no_dist=True)
    except Exception as err:  # DCP wraps what went wrong in a CheckpointException
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise InputError(
            f"checkpoint {str(path)!r}: the shards in {DCP_DIR}/ do not match its "
            f"{CONFIG_FILE} ({first}); copy the whole checkpoint folder again"
        ) from None
    model.load_state_dict(state["model"])
    if settings is not None:
        model = model.merge_and_unload()
    return model.eval()
