"""Seed-schema adapters: configs written for LMMs-Engine and the Transformer Lab plugin.

`translate(tree)` turns such a YAML tree into unmask's own tree before validation. Every
seed field is either mapped onto an unmask key or rejected with an InputError naming it;
nothing is silently dropped. Native sections (model/data/...) may sit beside seed fields;
where both set one key, the native value wins.

LMMs-Engine (`trainer_type: dllm_trainer`):
  model_config.load_from_config.{model_type, config.*} -> model.*
  model_config.load_from_pretrained_path -> model.pretrained
  dataset_config.{dataset_path, dataset_format, packing_length, dataset_type,
                  extra_kwargs.collator_type} -> data.* (a dataset_path that is not a local
                  path is a hub id: data.streaming)
  trainer_args.* -> optim.* / train.* (HF TrainingArguments names)

Transformer Lab plugin (flat keys): training_method, train_device, gpu_ids, max_length,
dtype, learning_rate(_schedule), warmup_ratio, num_train_epochs, train_steps, batch_size,
gradient_accumulation_steps, logging/eval/save_steps, lora*, load_in_4bit, mask_prompt_loss,
perbatch_cutoff, resp_cutoff_ratio, loss_weight_type, adaptor_name, log_to_wandb.
"""

from pathlib import Path
from typing import Any

from unmask.errors import InputError, did_you_mean
from unmask.models.hf import HF_DIRECT_KEYS

LMMS_KEYS = ("trainer_type", "model_config", "dataset_config", "trainer_args")

# training_method -> defaults (section, key, value); set only where the user did not.
TRAINING_METHODS = {
    "llada": [("diffusion", "objective", "sft"), ("model", "model_type", "llada")],
    "dream": [
        ("diffusion", "objective", "dream"),
        ("diffusion", "loss_weight", "cart[geo_p:0.3]"),
        ("model", "model_type", "dream"),
    ],
    "bert": [("diffusion", "objective", "bert"), ("model", "model_type", "modernbert")],
}

_TRAINER_ARGS = {
    "adam_beta1": ("optim", "adam_beta1"),
    "adam_beta2": ("optim", "adam_beta2"),
    "adam_epsilon": ("optim", "adam_epsilon"),
    "learning_rate": ("optim", "learning_rate"),
    "weight_decay": ("optim", "weight_decay"),
    "warmup_steps": ("optim", "warmup_steps"),
    "warmup_ratio": ("optim", "warmup_ratio"),
    "lr_scheduler_type": ("optim", "lr_scheduler_type"),
    "max_grad_norm": ("optim", "max_grad_norm"),
    "per_device_train_batch_size": ("train", "per_device_train_batch_size"),
    "per_device_eval_batch_size": ("train", "per_device_eval_batch_size"),
    "gradient_accumulation_steps": ("train", "gradient_accumulation_steps"),
    "max_steps": ("train", "max_steps"),
    "num_train_epochs": ("train", "num_train_epochs"),
    "output_dir": ("train", "output_dir"),
    "overwrite_output_dir": ("train", "overwrite_output_dir"),
    "logging_steps": ("train", "logging_steps"),
    "eval_steps": ("train", "eval_steps"),
    "save_steps": ("train", "save_steps"),
    "save_total_limit": ("train", "save_total_limit"),
    "seed": ("train", "seed"),
    "bf16": ("train", "bf16"),
    "gradient_checkpointing": ("train", "gradient_checkpointing"),
    "report_to": ("train", "report_to"),
    "run_name": ("train", "run_name"),
    "resume_from_checkpoint": ("train", "resume_from_checkpoint"),
    "disable_tqdm": ("train", "disable_tqdm"),
    "fsdp2": ("train", "fsdp2"),
}
_SEED_SPELLINGS = ("use_muon", "accelerator_config")
# Model config fields of LMMs-Engine's qwen3_dllm that unmask spells the same way.
_MODEL_FIELDS = (*HF_DIRECT_KEYS, "rope_theta")
_INFERENCE_ONLY = ("use_cache",)  # accepted: no effect on training

_TL_DIRECT = {
    "learning_rate": ("optim", "learning_rate"),
    "learning_rate_schedule": ("optim", "lr_scheduler_type"),
    "warmup_ratio": ("optim", "warmup_ratio"),
    "num_train_epochs": ("train", "num_train_epochs"),
    "batch_size": ("train", "per_device_train_batch_size"),
    "gradient_accumulation_steps": ("train", "gradient_accumulation_steps"),
    "logging_steps": ("train", "logging_steps"),
    "eval_steps": ("train", "eval_steps"),
    "save_steps": ("train", "save_steps"),
    "max_length": ("data", "packing_length"),
    "mask_prompt_loss": ("diffusion", "mask_prompt_loss"),
    "perbatch_cutoff": ("diffusion", "perbatch_cutoff"),
    "resp_cutoff_ratio": ("diffusion", "resp_cutoff_ratio"),
    "loss_weight_type": ("diffusion", "loss_weight"),
    "adaptor_name": ("model", "adaptor_name"),
    "lora": ("model", "lora"),
    "lora_r": ("model", "lora_r"),
    "lora_alpha": ("model", "lora_alpha"),
    "lora_dropout": ("model", "lora_dropout"),
    "lora_target_modules": ("model", "lora_target_modules"),
    "load_in_4bit": ("model", "load_in_4bit"),
}
TL_KEYS = (
    *_TL_DIRECT,
    "training_method",
    "train_device",
    "gpu_ids",
    "dtype",
    "train_steps",
    "log_to_wandb",
)


def translate(tree: dict) -> dict:
    """unmask's own tree for a tree in any accepted schema (native trees pass unchanged)."""
    out: dict[str, Any] = {}
    if any(key in tree for key in LMMS_KEYS):
        _lmms_engine(tree, out)
    if any(key in tree for key in TL_KEYS):
        _transformer_lab(tree, out)
    if not out:
        return tree
    rest = {k: v for k, v in tree.items() if k not in LMMS_KEYS and k not in TL_KEYS}
    return _merge(out, rest)


def _merge(base: dict, top: dict) -> dict:
    """base updated by top, recursively (top wins)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _put(out: dict, section: str, key: str, value: Any) -> None:
    out.setdefault(section, {})[key] = value


def _unsupported(where: str, key: str, known) -> InputError:
    hint = did_you_mean(key, known)
    return InputError(f"seed config field '{where}{key}' is not supported by unmask{hint}")


def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"seed config field '{where}' must be a mapping, got {value!r}")
    return value


# -- LMMs-Engine ---------------------------------------------------------------------------


def _lmms_engine(tree: dict, out: dict) -> None:
    trainer_type = tree.get("trainer_type", "dllm_trainer")
    if trainer_type != "dllm_trainer":
        raise InputError(
            f"seed config field 'trainer_type: {trainer_type}' is not supported; unmask runs "
            "the dllm_trainer recipe (trainer_type: dllm_trainer)"
        )
    _lmms_model(_mapping(tree.get("model_config"), "model_config"), out)
    _lmms_dataset(_mapping(tree.get("dataset_config"), "dataset_config"), out)
    _lmms_trainer_args(_mapping(tree.get("trainer_args"), "trainer_args"), out)


def _lmms_model(cfg: dict, out: dict) -> None:
    for key, value in cfg.items():
        if key == "load_from_pretrained_path":
            _put(out, "model", "pretrained", value)
        elif key == "load_from_config":
            sub = _mapping(value, "model_config.load_from_config")
            for k, v in sub.items():
                if k == "model_type":
                    _put(out, "model", "model_type", v)
                elif k == "config":
                    for field, fv in _mapping(v, "model_config.load_from_config.config").items():
                        if field in _MODEL_FIELDS:
                            _put(out, "model", field, fv)
                        elif field not in _INFERENCE_ONLY:
                            raise _unsupported(
                                "model_config.load_from_config.config.", field, _MODEL_FIELDS
                            )
                else:
                    raise _unsupported(
                        "model_config.load_from_config.", k, ("model_type", "config")
                    )
        elif key == "attn_implementation":
            if value not in ("sdpa", "flex"):  # flash_attention_2 etc. -> auto
                value = "auto"
            _put(out, "model", "attn_implementation", value)
        else:
            raise _unsupported(
                "model_config.", key, ("load_from_config", "load_from_pretrained_path")
            )


def _lmms_dataset(cfg: dict, out: dict) -> None:
    known = ("dataset_type", "dataset_format", "dataset_path", "packing_length", "extra_kwargs")
    for key, value in cfg.items():
        if key == "dataset_path":
            _put(out, "data", "dataset", value)
            if not Path(str(value)).expanduser().exists():  # a hub id: stream it
                _put(out, "data", "streaming", True)
        elif key == "dataset_format":
            # LMMs-Engine's hf_dataset is a hub id; unmask reads local folders (save_to_disk
            # folders or folders of jsonl/parquet/txt), which `auto` tells apart.
            fmt = {"hf_dataset": "auto", "json": "jsonl"}.get(value, value)
            _put(out, "data", "dataset_format", fmt)
        elif key == "packing_length":
            _put(out, "data", "packing_length", value)
        elif key == "dataset_type":
            pass  # LMMs-Engine's dataset class label; unmask reads the local path it is given
        elif key == "extra_kwargs":
            for k, v in _mapping(value, "dataset_config.extra_kwargs").items():
                if k == "collator_type" and v == "dllm":
                    continue  # the masked-diffusion collator is what unmask always uses
                raise _unsupported("dataset_config.extra_kwargs.", f"{k}: {v}", ())
        else:
            raise _unsupported("dataset_config.", key, known)


def _lmms_trainer_args(cfg: dict, out: dict) -> None:
    """HF TrainingArguments names onto unmask keys; the two seed spellings become the keys
    they mean (use_muon -> optim.name, accelerator_config.split_batches ->
    train.split_batches), so a native key the user also wrote wins, as for every field."""
    for key, value in cfg.items():
        if key in _TRAINER_ARGS:
            _put(out, *_TRAINER_ARGS[key], value)
        elif key == "use_muon":
            _put(out, "optim", "name", "muon" if value else "adamw")
        elif key == "accelerator_config":
            for k, v in _mapping(value, "trainer_args.accelerator_config").items():
                if k != "split_batches":
                    raise _unsupported("trainer_args.accelerator_config.", k, ("split_batches",))
                _put(out, "train", "split_batches", v)
        else:
            raise _unsupported("trainer_args.", key, [*_TRAINER_ARGS, *_SEED_SPELLINGS])


# -- Transformer Lab -------------------------------------------------------------------------


def _transformer_lab(tree: dict, out: dict) -> None:
    for key in TL_KEYS:
        if key not in tree:
            continue
        value = tree[key]
        if key in _TL_DIRECT:
            _put(out, *_TL_DIRECT[key], value)
            if key == "adaptor_name":
                _put(out, "train", "run_name", value)
        elif key == "train_device":
            if value not in ("cuda", "cpu"):
                raise InputError(f"train_device: {value!r} is not supported; use cuda or cpu")
            _put(out, "train", "device", value)
        elif key == "gpu_ids":
            if str(value).strip() not in ("auto", ""):
                raise InputError(
                    f"gpu_ids: {value!r} is not supported; use gpu_ids: auto and choose GPUs "
                    "with CUDA_VISIBLE_DEVICES"
                )
        elif key == "dtype":
            bf16 = {"bfloat16": True, "bf16": True, "float32": False, "fp32": False, "auto": False}
            if value not in bf16:
                raise InputError(f"dtype: {value!r} is not supported; use bfloat16 or float32")
            _put(out, "train", "bf16", bf16[value])
        elif key == "train_steps":
            if value and int(value) > 0:
                _put(out, "train", "max_steps", int(value))
        elif key == "log_to_wandb":
            if value:
                _put(out, "train", "report_to", ["wandb"])
        elif key == "training_method":
            _training_method(value, tree, out)


def _training_method(method: str, tree: dict, out: dict) -> None:
    if method not in TRAINING_METHODS:
        raise InputError(
            f"training_method: {method!r} is not supported; use one of "
            f"{', '.join(TRAINING_METHODS)}"
        )
    for section, key, value in TRAINING_METHODS[method]:
        native = _mapping(tree.get(section), section)
        if key in native or key in out.get(section, {}):
            continue
        if section == "model" and native.get("pretrained"):
            continue  # the folder's config.json names its family
        if key == "loss_weight" and "objective" in native:
            continue
        _put(out, section, key, value)
