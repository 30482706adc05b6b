"""Transformer Lab's "Diffusion LLM Trainer" plugin fields (flat keys at the top of a file).

Every field the plugin documents is mapped onto an unmask key or refused with the reason:
training_method, train_device, gpu_ids, batch_size, gradient_accumulation_steps,
max_length, dtype, load_in_4bit, lora, lora_r, lora_alpha, lora_dropout,
(lora_target_modules), learning_rate, learning_rate_schedule, warmup_ratio,
num_train_epochs, train_steps, logging_steps, eval_steps, save_steps, mask_prompt_loss,
perbatch_cutoff, resp_cutoff_ratio, loss_weight_type, adaptor_name, log_to_wandb.
"""

from unmask.config.compat.tree import mapping, put
from unmask.errors import InputError

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

_DIRECT = {
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
    *_DIRECT,
    "training_method",
    "train_device",
    "gpu_ids",
    "dtype",
    "train_steps",
    "log_to_wandb",
)
_DTYPES = {"bfloat16": True, "bf16": True, "float32": False, "fp32": False, "auto": False}


def from_transformer_lab(tree: dict, out: dict) -> None:
    """Translate the plugin fields of `tree` into `out`."""
    for key in TL_KEYS:
        if key not in tree:
            continue
        value = tree[key]
        if key in _DIRECT:
            if key == "learning_rate_schedule" and isinstance(value, str):
                value = value.replace("-", "_")  # the plugin writes constant-with-warmup
            put(out, *_DIRECT[key], value)
            if key == "adaptor_name":
                put(out, "train", "run_name", value)
        elif key == "train_device":
            if value not in ("cuda", "cpu"):
                raise InputError(
                    f"train_device: {value!r} is not supported: unmask trains on CUDA GPUs or "
                    "the CPU (no TPU / XLA backend); use cuda or cpu"
                )
            put(out, "train", "device", value)
        elif key == "gpu_ids":
            if str(value).strip() not in ("auto", ""):
                raise InputError(
                    f"gpu_ids: {value!r} is not supported: unmask uses one process per visible "
                    "GPU (torchrun) and picks none itself; use gpu_ids: auto and choose GPUs "
                    "with CUDA_VISIBLE_DEVICES"
                )
        elif key == "dtype":
            if value not in _DTYPES:
                raise InputError(
                    f"dtype: {value!r} is not supported: unmask's only mixed precision is "
                    "bfloat16; use bfloat16 or float32"
                )
            put(out, "train", "bf16", _DTYPES[value])
        elif key == "train_steps":
            if value and int(value) > 0:
                put(out, "train", "max_steps", int(value))
        elif key == "log_to_wandb":
            if value:
                put(out, "train", "report_to", ["wandb"])
        elif key == "training_method":
            _training_method(value, tree, out)


def _training_method(method: str, tree: dict, out: dict) -> None:
    if method not in TRAINING_METHODS:
        raise InputError(
            f"training_method: {method!r} is not supported; use one of "
            f"{', '.join(TRAINING_METHODS)}"
        )
    for section, key, value in TRAINING_METHODS[method]:
        native = mapping(tree.get(section), section)
        if key in native or key in out.get(section, {}):
            continue
        if section == "model" and native.get("pretrained"):
            continue  # the folder's config.json names its family
        if key == "loss_weight" and "objective" in native:
            continue
        put(out, section, key, value)
