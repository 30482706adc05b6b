"""LMMs-Engine's DLLM recipe configs (`trainer_type: dllm_trainer`), read as LMMs-Engine
0.1.4 reads them.

Two layouts exist:
- sections at the top: trainer_type, model_config, dataset_config, trainer_args (the hydra
  loader, `python -m lmms_engine.launch.cli config_yaml=FILE`, used by
  dllm_train_muon_single_gpu.yaml and dllm_train_adam_multi_gpu_deepspeed.yaml);
- a list of sections, `- type: trainer` + `config:` (the earlier `--config FILE` loader,
  used by dllm_train_muon_multi_gpu_fsdp2.yaml and dllm_train_example.yaml). That loader
  read `task_type` from each entry (default trainer; `type` was never read) and handed
  `config` over with trainer_type, model_config and dataset_config taken out and every
  other key passed to TrainingArguments as it is.
`sections_to_tree` turns the list layout into the first one, so messages name a training
argument `trainer_args.KEY` in both.

Every key is mapped onto an unmask key, accepted with no effect (listed once at start-up
with what unmask does instead), or refused with the reason; nothing is dropped silently.
"""

from pathlib import Path
from typing import Any

from unmask.config.compat.tree import NoEffect, mapping, put, refused, unsupported
from unmask.errors import InputError
from unmask.models.layouts import HF_DIRECT_KEYS

LMMS_KEYS = ("trainer_type", "model_config", "dataset_config", "trainer_args")
_TASK_KEYS = ("type", "task_type", "config")

# HF TrainingArguments (and LMMs-Engine's additions) that unmask has under its own name.
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
    "torch_compile": ("train", "torch_compile"),
    "run_name": ("train", "run_name"),
    "resume_from_checkpoint": ("train", "resume_from_checkpoint"),
    "disable_tqdm": ("train", "disable_tqdm"),
    "dataloader_num_workers": ("train", "dataloader_num_workers"),
    "ddp_timeout": ("train", "ddp_timeout"),
    "fsdp2": ("parallel", "fsdp2"),
}
# Training arguments that change nothing in unmask -> what unmask does instead. Each is
# listed in the start-up line; the values _REFUSED names are refused instead.
_NO_EFFECT = {
    "fp16": "bf16 is unmask's only mixed precision: train.bf16",
    "use_liger_kernel": "unmask computes the masked-only loss with its own chunked kernel",
    "use_rmpad": "packed rows hold no padding to remove",
    "include_num_input_tokens_seen": "tokens_seen is always logged",
    "include_tokens_per_second": "tokens_per_second is always logged",
    "dataloader_drop_last": "each epoch's last partial batch is always dropped",
    "dataloader_pin_memory": "batches are pinned when training on CUDA",
    "sp_ulysses_degree": "each rank holds whole rows",
    "tp_degree": "each rank holds whole layers (FSDP2 shards only along the data axis)",
    "ep_degree": "unmask's models have no experts",
    "deepspeed": "several processes shard with FSDP2: parallel.fsdp2",
    "eval_strategy": "the eval loss is computed every train.eval_steps and at the end",
    "evaluation_strategy": "the eval loss is computed every train.eval_steps and at the end",
    "logging_strategy": "metrics are logged every train.logging_steps",
    "logging_first_step": "metrics are logged every train.logging_steps",
    "logging_dir": "logs go to output_dir: metrics.jsonl, tensorboard/",
    "save_strategy": "checkpoints are saved every train.save_steps and at the last step",
    "save_safetensors": "model weights are always saved as safetensors",
}
_NO_PARALLELISM = "set it to 1 (unmask runs data parallel only)"
_REFUSED = {  # key -> (refuse this value?, reason)
    "fp16": (bool, "unmask's only mixed precision is bfloat16; set bf16: true"),
    "sp_ulysses_degree": (
        lambda v: v != 1,
        "Ulysses sequence (context) parallelism does not exist in unmask yet: every rank "
        f"holds whole rows; {_NO_PARALLELISM}",
    ),
    "tp_degree": (lambda v: v != 1, f"unmask has no tensor parallelism; {_NO_PARALLELISM}"),
    "ep_degree": (
        lambda v: v != 1,
        f"unmask's models have no experts to shard (no expert parallelism); {_NO_PARALLELISM}",
    ),
}
_STRATEGIES = {
    "eval_strategy": ("no", "steps", "epoch"),
    "evaluation_strategy": ("no", "steps", "epoch"),
    "logging_strategy": ("no", "steps", "epoch"),
    "save_strategy": ("no", "steps", "epoch", "best"),
}
_REPORTERS = ("tensorboard", "wandb")
_SEED_SPELLINGS = ("use_muon", "accelerator_config", "report_to")

# Model config fields of LMMs-Engine's qwen3_dllm that unmask spells the same way.
_MODEL_FIELDS = (*HF_DIRECT_KEYS, "rope_theta")
# LMMs-Engine's Qwen3DLLMConfig defaults where they differ from unmask's (whose defaults
# are a tiny model): a load_from_config entry that leaves a field out gets these, so it
# builds the model LMMs-Engine builds. num_key_value_heads defaults to the head count.
_QWEN3_DLLM_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
}
_INFERENCE_ONLY = {"use_cache": "training runs no KV cache"}

_DATASET_KEYS = (
    "dataset_type",
    "dataset_format",
    "dataset_path",
    "eval_dataset_path",
    "packing_length",
    "processor_config",
    "extra_kwargs",
)
# LMMs-Engine's hf_dataset is a hub id or a datasets folder; unmask reads local folders
# (save_to_disk folders, or folders of jsonl/parquet/txt files), which `auto` tells apart.
_DATASET_FORMATS = {"hf_dataset": "auto", "arrow": "auto", "json": "jsonl", "jsonl": "jsonl"}
# pure_text: an AutoTokenizer over processor_name; qwen3: the name the repository's earlier
# dllm_train_example.yaml gives it.
_TEXT_PROCESSORS = ("pure_text", "qwen3")


def sections_to_tree(entries: list, where: str) -> dict:
    """The top-level-sections tree of a list-of-sections file (`- type: trainer` +
    `config:`). One file is one run: exactly one trainer entry."""
    if len(entries) != 1:
        raise InputError(
            f"config file {where}: a list of sections is LMMs-Engine's layout and unmask runs "
            f"one training per file; give exactly one '- type: trainer' entry with its "
            f"config (got {len(entries)} entries)"
        )
    entry = entries[0]
    for key in entry:
        if key not in _TASK_KEYS:
            raise unsupported("", key, _TASK_KEYS)
    kind = entry.get("task_type", entry.get("type", "trainer"))
    if kind != "trainer":
        raise InputError(
            f"config file {where}: section type {kind!r} is not supported; unmask runs "
            "LMMs-Engine's trainer task (type: trainer)"
        )
    config = dict(mapping(entry.get("config"), "config"))
    args = {k: config.pop(k) for k in list(config) if k not in LMMS_KEYS}
    nested = mapping(config.pop("trainer_args", None), "config.trainer_args")
    return {**config, "trainer_args": {**args, **nested}}


def from_lmms_engine(tree: dict, out: dict, native: dict) -> NoEffect:
    """Translate the LMMs-Engine sections of `tree` into `out`; `native` is the file's own
    `model:` section (its values win). Returns the keys accepted with no effect."""
    trainer_type = tree.get("trainer_type", "dllm_trainer")
    if trainer_type != "dllm_trainer":
        raise InputError(
            f"seed config field 'trainer_type: {trainer_type}' is not supported; unmask runs "
            "the dllm_trainer recipe (trainer_type: dllm_trainer)"
        )
    no_effect = NoEffect()
    _model(mapping(tree.get("model_config"), "model_config"), out, native, no_effect)
    _dataset(mapping(tree.get("dataset_config"), "dataset_config"), out)
    _trainer_args(mapping(tree.get("trainer_args"), "trainer_args"), out, no_effect)
    return no_effect


def _model(cfg: dict, out: dict, native: dict, no_effect: NoEffect) -> None:
    for key, value in cfg.items():
        if key == "load_from_pretrained_path":
            put(out, "model", "pretrained", value)
        elif key == "load_from_config":
            _model_from_config(mapping(value, "model_config.load_from_config"), out, native,
                               no_effect)  # fmt: skip
        elif key == "attn_implementation":
            if value not in ("sdpa", "flex"):  # flash_attention_2, eager: same numbers
                value = "auto"
            put(out, "model", "attn_implementation", value)
        else:
            raise unsupported(
                "model_config.", key, ("load_from_config", "load_from_pretrained_path")
            )


def _model_from_config(sub: dict, out: dict, native: dict, no_effect: NoEffect) -> None:
    where = "model_config.load_from_config."
    for key in sub:
        if key not in ("model_type", "config"):
            raise unsupported(where, key, ("model_type", "config"))
    fields = mapping(sub.get("config"), where + "config")
    for field, value in fields.items():
        if field in _MODEL_FIELDS:
            put(out, "model", field, value)
        elif field in _INFERENCE_ONLY:
            no_effect.add(f"{where}config.{field}", _INFERENCE_ONLY[field])
        else:
            raise unsupported(where + "config.", field, _MODEL_FIELDS)
    if "model_type" not in sub:
        return
    put(out, "model", "model_type", sub["model_type"])
    if sub["model_type"] == "qwen3_dllm":
        given = {**fields, **native}
        for field, value in _QWEN3_DLLM_DEFAULTS.items():
            if field not in given:
                put(out, "model", field, value)
        if "num_key_value_heads" not in given:
            heads = given.get("num_attention_heads", _QWEN3_DLLM_DEFAULTS["num_attention_heads"])
            put(out, "model", "num_key_value_heads", heads)


def _dataset(cfg: dict, out: dict) -> None:
    for key, value in cfg.items():
        if key in ("dataset_path", "eval_dataset_path"):
            put(out, "data", "dataset" if key == "dataset_path" else "eval_dataset", value)
            if key == "dataset_path" and not Path(str(value)).expanduser().exists():
                put(out, "data", "streaming", True)  # a hub id: stream it
        elif key == "dataset_format":
            if value not in _DATASET_FORMATS:
                raise refused(
                    f"dataset_config.{key}", value,
                    "unmask reads jsonl/json, parquet, txt and save_to_disk (arrow) folders; "
                    "use dataset_format: hf_dataset or jsonl",
                )  # fmt: skip
            put(out, "data", "dataset_format", _DATASET_FORMATS[value])
        elif key == "packing_length":
            put(out, "data", "packing_length", value)
        elif key == "dataset_type":
            if value != "fineweb_edu":
                raise refused(
                    f"dataset_config.{key}", value,
                    "unmask's dllm recipe reads plain-text documents (a 'text' column), as "
                    "LMMs-Engine's fineweb_edu dataset does; use dataset_type: fineweb_edu",
                )  # fmt: skip
        elif key == "processor_config":
            _processor(mapping(value, "dataset_config.processor_config"), out)
        elif key == "extra_kwargs":
            for k, v in mapping(value, "dataset_config.extra_kwargs").items():
                if k != "collator_type":
                    raise unsupported("dataset_config.extra_kwargs.", k, ("collator_type",))
                if v != "dllm":  # the masked-diffusion collator is what unmask always uses
                    raise refused(
                        f"dataset_config.extra_kwargs.{k}", v,
                        "unmask trains masked diffusion only (collator_type: dllm)",
                    )  # fmt: skip
        else:
            raise unsupported("dataset_config.", key, _DATASET_KEYS)


def _processor(cfg: dict, out: dict) -> None:
    """processor_config (LMMs-Engine's tokenizer) -> data.tokenizer, a local folder."""
    where = "dataset_config.processor_config."
    for key, value in cfg.items():
        if key == "processor_name":
            if not Path(str(value)).expanduser().is_dir():
                raise InputError(
                    f"{where}{key}: {value!r} is not a local folder; unmask loads tokenizers "
                    "from local folders only, never from the hub: download it (e.g. "
                    f"`huggingface-cli download {value} --local-dir DIR`) and give that folder"
                )
            put(out, "data", "tokenizer", str(value))
        elif key == "processor_type":
            if value not in _TEXT_PROCESSORS:
                raise refused(
                    where + key, value,
                    "unmask trains text models and loads processor_name as a text tokenizer; "
                    "use processor_type: pure_text",
                )  # fmt: skip
        elif key == "extra_kwargs":
            if mapping(value, where + key):
                raise unsupported(where, f"{key}: {value}")
        else:
            raise unsupported(where, key, ("processor_name", "processor_type"))


def _trainer_args(cfg: dict, out: dict, no_effect: NoEffect) -> None:
    """HF TrainingArguments names onto unmask keys. The seed spellings become the keys they
    mean (use_muon -> optim.name, accelerator_config.split_batches -> train.split_batches),
    so a native key the user also wrote wins, as for every field."""
    for key, value in cfg.items():
        if key in _REFUSED and _REFUSED[key][0](value):
            raise refused(f"trainer_args.{key}", value, _REFUSED[key][1])
        if key in _TRAINER_ARGS:
            put(out, *_TRAINER_ARGS[key], value)
        elif key in _STRATEGIES:
            _strategy(key, value, out, no_effect)
        elif key in _NO_EFFECT:
            no_effect.add(f"trainer_args.{key}", _NO_EFFECT[key])
        elif key == "report_to":
            _report_to(value, out, no_effect)
        elif key == "use_muon":
            put(out, "optim", "name", "muon" if value else "adamw")
        elif key == "accelerator_config":
            for k, v in mapping(value, "trainer_args.accelerator_config").items():
                if k != "split_batches":
                    raise unsupported("trainer_args.accelerator_config.", k, ("split_batches",))
                put(out, "train", "split_batches", v)
        else:
            known = [*_TRAINER_ARGS, *_NO_EFFECT, *_SEED_SPELLINGS]
            raise unsupported("trainer_args.", key, known)
    if cfg.get("save_strategy") == "no":  # as in HF, wins over save_steps
        put(out, "train", "save_steps", 0)  # only the last step is saved (final/)


def _strategy(key: str, value: Any, out: dict, no_effect: NoEffect) -> None:
    if value not in _STRATEGIES[key]:
        raise refused(f"trainer_args.{key}", value, f"use one of {', '.join(_STRATEGIES[key])}")
    if not (key == "save_strategy" and value == "no"):  # mapped: see _trainer_args
        no_effect.add(f"trainer_args.{key}", _NO_EFFECT[key])


def _report_to(value: Any, out: dict, no_effect: NoEffect) -> None:
    """The loggers unmask has are kept; the others are listed with no effect."""
    names = [value] if isinstance(value, str) else list(value or [])
    kept = [name for name in names if name in _REPORTERS]
    other = [name for name in names if name not in (*_REPORTERS, "none")]
    put(out, "train", "report_to", kept)
    if other:
        no_effect.add(
            f"trainer_args.report_to: {', '.join(map(str, other))}",
            "unmask logs to output_dir/metrics.jsonl, and to tensorboard or wandb when named",
        )
