"""Hugging Face folders: config.json <-> ModelConfig, safetensors weights, and saving.

Native parameter names equal HF Qwen3/Qwen2/Llama/Dream keys, so those load as a plain state
dict; a family with a key map (LLaDA) is renamed through it. Which config.json `model_type`
is which family and its key map come from models/families.py, how its folders hold a model
from its `FolderLayout` (models/layouts.py): this module switches on no family.
Only local folders are read (no hub, no remote code); weights come from safetensors only. A
loaded folder's config.json is kept on the model (`hf_source_config`) and written back on
save, so a Dream or LLaDA folder round-trips with its own fields (mask_token_id, auto_map...).
Every folder written carries its family under config.json's "unmask" tag, and under
"unmask": {"model": ...} the architecture fields its layout has no key for (`unwritten_fields`:
qk_norm false on Qwen3, a partial rotary on Llama, ...), so that it reloads as it was; a
config the layout holds whole gets no such entry, and transformers' classes ignore the tag.

This module never builds a model: `save_pretrained` needs only a model's `state_dict()`,
`config` and `hf_source_config`, and loading into a new model (`from_pretrained`) lives in
models/build.py, above both this module and models/transformer.py.
"""

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from unmask.errors import InputError, describe_validation_error
from unmask.models.config import ModelConfig
from unmask.models.families import (
    DEFAULT_FAMILY,
    FAMILIES,
    family_for_hf_type,
    from_folder_keys,
    native_hf_model_types,
    released_mask_token_id,
    to_folder_keys,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# --- config.json -> ModelConfig ------------------------------------------------------------


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict of a native family (Qwen3, Qwen2, Llama, Dream,
    LLaDA) or one written by unmask (its "unmask" tag names the family)."""
    model_type = hf.get("model_type")
    if model_type not in native_hf_model_types():
        raise InputError(
            f"config.json: model_type {model_type!r} is not supported; expected one of "
            f"{', '.join(native_hf_model_types())} (or a folder saved by unmask)"
        )
    name = (hf.get("unmask") or {}).get("model_type") or family_for_hf_type(model_type).name
    family = FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
        raise InputError(
            f"config.json: unmask.model_type {name!r} is not a model family; expected one of "
            f"{', '.join(FAMILIES)}"
        )
    fields = family.layout.fields(hf, family)  # the family's folder (models/layouts.py)
    fields.update(tagged_model_fields(hf))
    try:
        return ModelConfig(model_type=family.name, **fields)
    except ValidationError as err:
        raise InputError(f"config.json: {describe_validation_error(err, 'key')}") from None


def tagged_model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The architecture fields unmask wrote under "unmask": {"model": ...} because the
    family's config.json layout has no key for them (`unwritten_fields`); {} when absent."""
    tagged = (hf.get("unmask") or {}).get("model") or {}
    if not isinstance(tagged, dict):
        raise InputError('config.json: "unmask"."model" must map model fields to values')
    return {k: v for k, v in tagged.items() if k in ARCHITECTURE_FIELDS}


# --- ModelConfig -> config.json ------------------------------------------------------------

RUN_FIELDS = ("model_type", "attn_implementation", "loss_implementation", "pretrained", "lora",
              "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "adaptor_name",
              "lora_merge", "load_in_4bit", "freeze_vision")  # fmt: skip
"""ModelConfig fields that are not the architecture (how a run builds or trains it)."""
ARCHITECTURE_FIELDS = tuple(k for k in ModelConfig.model_fields if k not in RUN_FIELDS)
"""ModelConfig fields a folder must give back (config.json keys, else the "unmask" tag)."""


def unwritten_fields(cfg: ModelConfig, written: dict[str, Any]) -> dict[str, Any]:
    """The architecture fields of cfg that config.json dict `written` does not give back
    when read (a switch its layout has no key for: `qk_norm: false` on Qwen3, a bias on
    Qwen2's o_proj...), as JSON values; {} for a config its layout holds whole."""
    try:
        read = config_from_hf(written)
    except InputError:
        read = None
    values = cfg.model_dump(mode="json")
    return {key: values[key] for key in ARCHITECTURE_FIELDS
            if read is None or _differs(read, cfg, key)}  # fmt: skip


def _differs(read: ModelConfig, cfg: ModelConfig, key: str) -> bool:
    if key == "head_dim":  # None = hidden_size // heads, which the layouts write out
        return read.resolved_head_dim != cfg.resolved_head_dim
    return getattr(read, key) != getattr(cfg, key)


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A config.json dict for cfg in its family's layout (Qwen3/Qwen2/Llama load in
    transformers as they are; Dream and LLaDA in their own remote-code layouts). Encoder
    families have no native layout: their fields ride in the default family's, tagged."""
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    family = FAMILIES[cfg.model_type]
    if not family.native:
        family = FAMILIES[DEFAULT_FAMILY]
    out = family.layout.config(cfg, family, dtype_name)  # the family's folder
    for key in family.hf_absent_keys:
        out.pop(key, None)
    out.update(family.hf_extra)
    tag = out.setdefault("unmask", {"model_type": cfg.model_type})
    missing = unwritten_fields(cfg, out)
    if missing:  # what the layout cannot say rides in unmask's own tag
        tag["model"] = {**(tag.get("model") or {}), **missing}
    return out


# --- folders: config.json, weights, mask id ------------------------------------------------


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json as a dict; one clear error when it cannot be read."""
    if not folder.is_dir():
        raise InputError(
            f"model folder {str(folder)!r} does not exist; set model.pretrained to a local "
            "folder holding config.json and model.safetensors"
        )
    path = folder / "config.json"
    if not path.is_file():
        raise InputError(
            f"{str(path)!r} is missing; model.pretrained must be a Hugging Face model folder "
            "with config.json and model.safetensors"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{str(path)!r} is not valid JSON ({err}); fix or re-export it") from err


def _weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, AttributeError):
            raise InputError(
                f"{str(index)!r} is not a weight index; copy the whole folder"
            ) from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing or not files:
            raise InputError(
                f"{str(index)!r} names missing shard files {missing}; copy the whole folder"
            )
        return files
    raise InputError(
        f"no weights in {str(folder)!r}: expected model.safetensors or "
        "model.safetensors.index.json (convert .bin weights to safetensors first)"
    )


def read_safetensors(path: Path, fix: str = "copy or re-export the folder") -> dict:
    """The tensors of one safetensors file; a truncated or foreign file is an InputError
    naming it and `fix`."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise InputError(
            f"{str(path)!r} is damaged or not a safetensors file ({err}); {fix}"
        ) from None


def tensor_names(folder: Path) -> set[str] | None:
    """The names of the folder's weight tensors, from the safetensors headers (no tensor
    read); None for a folder with no weight files (a config.json alone, as `unmask plan`
    reads one; loading it is refused in its own line); a damaged file is one line naming it."""
    if (
        not (folder / "model.safetensors").is_file()
        and not (folder / "model.safetensors.index.json").is_file()
    ):
        return None
    names: set[str] = set()
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), "pt") as f:
                names.update(f.keys())
        except (SafetensorError, OSError) as err:
            raise InputError(
                f"{str(path)!r} is damaged or not a safetensors file ({err}); copy or re-export "
                "the folder"
            ) from None
    return names


def check_weight_files(folder: Path) -> None:
    """Every weight file of the folder is there and whole (headers only: cheap)."""
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), "pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise InputError(
                f"{str(path)!r} is damaged or not a safetensors file ({err}); copy or re-export "
                "the folder"
            ) from None


def read_state_dict(
    folder: Path, family: str, cfg: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    """The folder's safetensors weights under native key names (family: its key map; MoE
    families: experts stacked, LLaDA2.0 names converted, which needs the folder's cfg)."""
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        state.update(read_safetensors(path))
    return native_state(state, family, cfg, folder)


def native_state(state: dict[str, torch.Tensor], family: str, cfg: ModelConfig | None,
                 folder: Path) -> dict[str, torch.Tensor]:  # fmt: skip
    """A folder's tensors (as `save_pretrained` writes them) under native key names:
    `read_state_dict`'s conversion of what it read (folder: named in errors)."""
    if FAMILIES[family].key_map:
        state = from_folder_keys(state, family)
    state = FAMILIES[family].layout.to_native(state, cfg, folder)  # experts, fused tensors
    if not any(key.startswith("model.") for key in state):  # a bare Qwen3Model checkpoint
        state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in state.items()}
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


def split_carried(
    state: dict[str, torch.Tensor], family: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A folder's state -> (what the model loads, the tensors it carries unrun: the keys
    under the family's `carried` prefixes, e.g. DiffusionGemma's vision tower)."""
    prefixes = FAMILIES[family].carried
    if not prefixes:
        return state, {}
    carried = {k: v for k, v in state.items() if k.startswith(prefixes)}
    return {k: v for k, v in state.items() if k not in carried}, carried


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Load a folder's (native-named) state into model, strictly; tied heads share the
    embedding. One clear error naming what is missing or unexpected."""
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise InputError(
            f"weights in {str(folder)!r} do not match config.json: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]} (is it a {_family_label(model.config)} checkpoint "
            "with this config?)"
        )
    wrong = shape_mismatch(model, state)
    if wrong:
        raise InputError(f"weights in {str(folder)!r} do not match config.json: {wrong}")
    model.load_state_dict(state, strict=True)


def _family_label(cfg: ModelConfig) -> str:
    """The family a folder's config.json names, as its architecture (DiffusionGemmaFor...)
    and model_type: what the error about its weights asks the user to check."""
    family = FAMILIES[cfg.model_type]
    return f"{family.architecture} ({cfg.model_type})"


def shape_mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> str:
    """'' when every tensor of `state` that the model has fits it, else the first that does
    not, as 'NAME is (A, B) there, (C, D) in the model'."""
    own = model.state_dict()
    for name, tensor in state.items():
        if name in own and tuple(own[name].shape) != tuple(tensor.shape):
            return f"{name} is {tuple(tensor.shape)} there, {tuple(own[name].shape)} in the model"
    return ""


def folder_mask_token_id(folder: str | Path) -> int | None:
    """The mask token id a model folder names: config.json's `mask_token_id` (LLaDA and Dream
    folders carry it); else, for a folder in a family's own released layout (config.json not
    written by unmask), that family's released id (LLaDA 126336, Dream 151666); else None
    (also when the folder has no readable config.json)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # the model loader reports the broken file
    value = config.get("mask_token_id")
    if value is None:
        return released_mask_token_id(config)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{str(path)!r}: mask_token_id {value!r} is not an integer token id")
    return value


# --- saving --------------------------------------------------------------------------------


def save_pretrained(model: nn.Module, folder: str | Path) -> None:
    """Write config.json and model.safetensors (tied: embed_tokens only, like HF) for a native
    model: uses only `model.state_dict()`, `model.config`, `model.hf_source_config` and
    `model.hf_carried_weights` (a folder's tensors unmask does not run, written back as read:
    `split_carried`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[model.config.model_type]
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    dtype = state["model.embed_tokens.weight"].dtype  # the first parameter's
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # a carried part the model runs as a registered module (a trained vision tower) has
    # the folder's names already
    own = {k: v for k, v in state.items() if family.carried and k.startswith(family.carried)}
    state = {k: v for k, v in state.items() if k not in own}
    state = family.layout.to_folder(to_folder_keys(state, family.name))
    state.update(own)
    state.update(getattr(model, "hf_carried_weights", None) or {})
    config = hf_config_dict(model.config, dtype)
    source = getattr(model, "hf_source_config", None)
    if source is not None and config_from_hf(source) == _plain(model.config):
        # unchanged architecture: keep the folder's own config.json; remote-code configs
        # (Dream, LLaDA) stay byte for byte, transformers-native ones get the tag
        config = dict(source)
        if not family.keeps_source_config:  # an MoE tag of a folder unmask wrote stays
            config["unmask"] = {**(source.get("unmask") or {}), "model_type": family.name}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _plain(cfg: ModelConfig) -> ModelConfig:
    return cfg.model_copy(
        update={"attn_implementation": "auto", "loss_implementation": "chunked", "pretrained": None}
    )
