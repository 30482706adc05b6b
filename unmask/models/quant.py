"""QLoRA: the frozen base model's linear layers in 4-bit NF4 (bitsandbytes), LoRA on top.

`model.load_in_4bit: true` (with `model.lora: true`) replaces every linear layer that LoRA
targets in the decoder blocks by `bitsandbytes.nn.Linear4bit` (NF4, double quantization, the
QLoRA defaults) and quantizes it straight onto the training device, one layer at a time, so the
full-precision copy never has to fit there. Embeddings, norms and the LM head stay in full
precision (the masked-only loss reads the head's weight directly). peft then wraps the
quantized layers with trainable LoRA factors.

bitsandbytes' 4-bit kernels are a CUDA feature, so the run refuses to start anywhere else with
one line; the same code runs on CPU with bitsandbytes' CPU backend, which is how the tests
exercise it on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import re

import torch
from torch import nn

from unmask.errors import InputError
from unmask.models.config import ModelConfig
from unmask.models.families import FAMILIES

QUANT_TYPE = "nf4"
DOUBLE_QUANT = True


def cuda_ready(device: torch.device) -> bool:
    """True when 4-bit training can run here: a CUDA training device and bitsandbytes."""
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    return device.type == "cuda" and torch.cuda.is_available() and has_bnb


def check_4bit(cfg: ModelConfig, device: torch.device, world_size: int) -> None:
    """One clear line for every 4-bit request that cannot run; nothing when it can."""
    if not cfg.load_in_4bit:
        return
    if not cuda_ready(device):
        raise InputError(
            "model.load_in_4bit: true needs a CUDA GPU and the bitsandbytes package "
            f"(training device here: {device.type}); set load_in_4bit: false"
        )
    check_4bit_request(cfg, world_size)


def check_4bit_request(cfg: ModelConfig, world_size: int) -> None:
    """The 4-bit checks that need no device (train/setup.py `plan_parallel` runs them, so
    `unmask plan` refuses them in the trainer's line)."""
    if not cfg.load_in_4bit:
        return
    if not cfg.lora:
        raise InputError(
            "model.load_in_4bit: true trains LoRA adapters on a frozen 4-bit base; "
            "set model.lora: true"
        )
    if cfg.lora_merge:
        raise InputError(
            "model.lora_merge: true cannot merge into 4-bit weights; train with "
            "lora_merge: false and merge the saved adapter into the full-precision model"
        )
    if not FAMILIES[cfg.model_type].native:
        raise InputError(
            f"model.load_in_4bit: true is for the decoder families, not {cfg.model_type!r}; "
            "set load_in_4bit: false"
        )
    if world_size > 1:
        raise InputError(
            "model.load_in_4bit: true runs in one process (FSDP2 cannot shard 4-bit "
            "weights); launch one process or set load_in_4bit: false"
        )


def _targeted(name: str, targets: str | list[str] | tuple[str, ...]) -> bool:
    """peft's matching: a string is a regex over the full module name; a list entry matches
    the full name or its last dotted parts."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def quantize_4bit(
    model: nn.Module,
    targets: str | list[str] | tuple[str, ...],
    device: torch.device | str,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Replace the nn.Linear layers that targets name (as peft matches them) by quantized
    Linear4bit layers on device (in place); the LM head never. Returns how many."""
    import bitsandbytes as bnb  # optional extra (qlora): imported only when quantizing

    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear or name == "lm_head" or not _targeted(full, targets):
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=DOUBLE_QUANT,
                quant_type=QUANT_TYPE,
                device="meta",
            )
            weight = child.weight.detach().to(torch.float32)
            layer.weight = bnb.nn.Params4bit(
                weight,
                requires_grad=False,
                compress_statistics=DOUBLE_QUANT,
                quant_type=QUANT_TYPE,
            )
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach().clone(), requires_grad=False)
            setattr(parent, name, layer.to(device))  # .to() quantizes the weight
            replaced += 1
    if not replaced:
        raise InputError(
            f"model.load_in_4bit: none of {targets!r} is a linear layer of this model; "
            "set model.lora_target_modules to its linear layer names"
        )
    return replaced
