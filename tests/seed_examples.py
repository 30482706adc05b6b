"""Config files that mirror the key sets of LMMs-Engine's real DLLM example configs, with
small values, and the local dataset and tokenizer folders they point at.

The examples are the three YAMLs of examples/diffusion_language_model/ in LMMs-Engine 0.1.4
and the repository's earlier examples/dllm_train_example.yaml. Only their key sets are
mirrored here (which keys, in which section, in which layout); the values are small ones
for a CPU, hub names are replaced by local folders, report_to names a logger installed
here (the files name wandb) and output_dir a temporary folder.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

NO_EFFECT_PREFIX = "unmask: seed config keys accepted with no effect (what unmask does instead): "

# One small value for every training argument the examples use.
TRAINER_ARGS = {
    "per_device_train_batch_size": 4,
    "use_muon": True,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1.0e-8,
    "learning_rate": 1.0e-3,
    "weight_decay": 0.01,
    "gradient_accumulation_steps": 2,
    "gradient_checkpointing": True,
    "max_steps": 3,
    "save_steps": 2,
    "save_total_limit": 1,
    "warmup_steps": 1,
    "report_to": "tensorboard",
    "run_name": "seed-example",
    "eval_strategy": "no",
    "logging_steps": 1,
    "seed": 42,
    "dataloader_num_workers": 0,
    "bf16": True,
    "fp16": False,
    "max_grad_norm": 1.0,
    "accelerator_config": {"split_batches": True},
    "lr_scheduler_type": "cosine",
    "use_liger_kernel": False,
    "use_rmpad": True,
    "include_num_input_tokens_seen": True,
    "dataloader_drop_last": True,
    "sp_ulysses_degree": 1,
    "fsdp2": True,
    "deepspeed": "ds_config/default_config.json",
}

_MUON_ARGS = (
    "per_device_train_batch_size", "use_muon", "adam_beta1", "adam_beta2", "adam_epsilon",
    "learning_rate", "weight_decay", "gradient_accumulation_steps", "gradient_checkpointing",
    "max_steps", "save_steps", "save_total_limit", "warmup_steps", "report_to", "output_dir",
    "run_name", "eval_strategy", "logging_steps", "seed", "dataloader_num_workers", "bf16",
    "fp16", "max_grad_norm", "lr_scheduler_type", "use_liger_kernel",
    "include_num_input_tokens_seen", "dataloader_drop_last", "sp_ulysses_degree", "fsdp2",
)  # fmt: skip
_ADAM_ARGS = (
    "per_device_train_batch_size", "learning_rate", "weight_decay",
    "gradient_accumulation_steps", "gradient_checkpointing", "max_steps", "save_steps",
    "save_total_limit", "warmup_steps", "report_to", "output_dir", "run_name", "eval_strategy",
    "logging_steps", "seed", "dataloader_num_workers", "bf16", "fp16", "accelerator_config",
    "lr_scheduler_type", "use_liger_kernel", "use_rmpad", "include_num_input_tokens_seen",
    "dataloader_drop_last", "sp_ulysses_degree", "deepspeed",
)  # fmt: skip
_NO_EFFECT_MUON = (
    "model_config.load_from_config.config.use_cache",
    "trainer_args.eval_strategy",
    "trainer_args.fp16",
    "trainer_args.use_liger_kernel",
    "trainer_args.include_num_input_tokens_seen",
    "trainer_args.dataloader_drop_last",
    "trainer_args.sp_ulysses_degree",
)
_NO_EFFECT_ADAM = (*_NO_EFFECT_MUON, "trainer_args.use_rmpad", "trainer_args.deepspeed")


@dataclass(frozen=True)
class Example:
    """One real example's key set and the keys unmask lists as having no effect."""

    list_layout: bool  # `- type: trainer` + `config:` holding the training arguments flat
    dataset_keys: tuple[str, ...]  # dataset_config keys
    processor_type: str
    attn_implementation: bool  # model_config.attn_implementation present
    trainer_args: tuple[str, ...]
    no_effect: tuple[str, ...]


_TEXT_DATASET = ("dataset_type", "dataset_format", "dataset_path", "packing_length")
EXAMPLES = {
    "dllm_train_muon_single_gpu": Example(
        False, (*_TEXT_DATASET, "processor_config", "extra_kwargs"), "pure_text", False,
        _MUON_ARGS, _NO_EFFECT_MUON,
    ),
    "dllm_train_muon_multi_gpu_fsdp2": Example(
        True, (*_TEXT_DATASET, "processor_config", "extra_kwargs"), "pure_text", False,
        (*_MUON_ARGS, "accelerator_config"), _NO_EFFECT_MUON,
    ),
    "dllm_train_adam_multi_gpu_deepspeed": Example(
        False, (*_TEXT_DATASET, "processor_config"), "pure_text", True, _ADAM_ARGS,
        _NO_EFFECT_ADAM,
    ),
    "dllm_train_example": Example(
        True, (*_TEXT_DATASET, "processor_config"), "qwen3", True, _ADAM_ARGS, _NO_EFFECT_ADAM
    ),
}  # fmt: skip


def example_tree(name: str, data: Path, tokenizer: Path, output_dir: Path):
    """The YAML object of example `name` (a mapping, or a list of one section)."""
    ex = EXAMPLES[name]
    values = {
        "dataset_type": "fineweb_edu",
        "dataset_format": "hf_dataset",
        "dataset_path": str(data),
        "packing_length": 64,
        "processor_config": {"processor_name": str(tokenizer), "processor_type": ex.processor_type},
        "extra_kwargs": {"collator_type": "dllm"},
    }
    dataset = {key: values[key] for key in ex.dataset_keys}
    sizes = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "use_cache": False}  # fmt: skip
    model = {"attn_implementation": "sdpa"} if ex.attn_implementation else {}
    model["load_from_config"] = {"model_type": "qwen3_dllm", "config": sizes}
    args_values = {**TRAINER_ARGS, "output_dir": str(output_dir)}
    args = {key: args_values[key] for key in ex.trainer_args}
    head = {"trainer_type": "dllm_trainer", "dataset_config": dataset, "model_config": model}
    if ex.list_layout:
        return [{"type": "trainer", "config": {**head, **args}}]
    return {**head, "trainer_args": args}


def write_example(name: str, root: Path, change=None) -> Path:
    """Write example `name` under root with its local folders (docs/, tokenizer/; output
    run/); `change(tree)` may edit the tree first. Returns the file's path."""
    data, tokenizer = root / "docs", root / "tokenizer"
    if not data.exists():
        write_docs(data)
    if not tokenizer.exists():
        from unmask.data import build_char_tokenizer

        build_char_tokenizer().save_pretrained(str(tokenizer))
    tree = example_tree(name, data, tokenizer, root / "run")
    if change is not None:
        change(tree)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def write_docs(folder: Path, n: int = 200) -> Path:
    """A folder with one jsonl file of n short plain-text documents ({"text": ...})."""
    folder.mkdir(parents=True)
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    with open(folder / "part-0.jsonl", "w") as f:
        for i in range(n):
            text = " ".join(words[(i * 3 + j) % len(words)] for j in range(12))
            f.write(json.dumps({"text": text}) + "\n")
    return folder


def no_effect_keys(line: str) -> list[str]:
    """The keys the start-up line lists as accepted with no effect."""
    assert line.startswith(NO_EFFECT_PREFIX), line
    return [item.split(" (")[0] for item in line[len(NO_EFFECT_PREFIX) :].split("; ")]
