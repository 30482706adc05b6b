"""`train.float8`: the decoder's linear layers trained in float8 through torchao.

torchao's Float8Linear runs a linear layer's three GEMMs (forward, input gradient, weight
gradient) in float8 with dynamic tensorwise scales (e4m3 for inputs and weights, e5m2 for
gradients), accumulating in float32 on the tensor cores of GPUs of compute capability 8.9
and newer (L4, H100, H200, B200); torchtitan measured +28% tokens/s on Llama 3.1 8B
(6,667 -> 8,532 per H100). What stays in bf16: the LM head (its logits feed a softmax
over a vocabulary: unmask's fused loss keeps them in float32), the embedding, the MoE
router and expert stacks (stacked weights, not nn.Linear), and any layer whose dimensions
are not multiples of 16 (float8 GEMMs need them).
"""

from __future__ import annotations

import torch
from torch import nn

from unmask.errors import InputError

#: float8 tensor cores: compute capability 8.9 (Ada) and newer
FLOAT8_CAPABILITY = (8, 9)


def check_float8_request(float8: bool, bf16: bool) -> None:
    """The float8 check that needs no device (train/setup.py `plan_parallel` runs it, so
    `unmask plan` refuses it in the trainer's line)."""
    if float8 and not bf16:
        raise InputError("train.float8: true trains the linear layers in float8 beside a bf16 "
                         "model; set train.bf16: true as well")  # fmt: skip


def check_float8(float8: bool, bf16: bool, device: torch.device) -> None:
    """One clear line for a float8 request that cannot run; nothing when it can (or when
    none was made)."""
    if not float8:
        return
    check_float8_request(float8, bf16)
    if device.type != "cuda":
        raise InputError(f"train.float8: true needs a CUDA GPU with float8 tensor cores (compute "
                         f"capability 8.9 or newer: H100, H200, L4); training device here: "
                         f"{device.type}; set train.float8: false")  # fmt: skip
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise InputError(f"train.float8: true needs compute capability 8.9 or newer (H100, H200, "
                         f"L4); {name} is {capability[0]}.{capability[1]}; set train.float8: "
                         "false")  # fmt: skip
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise InputError("train.float8: true needs torchao; pip install 'unmask[float8]'") from None


def float8_eligible(module: nn.Module, name: str) -> bool:
    """A linear layer of a decoder block whose both dimensions are multiples of 16."""
    return (isinstance(module, nn.Linear) and ".layers." in f".{name}"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)  # fmt: skip


def convert_to_float8(model: nn.Module) -> int:
    """Swap the eligible linear layers for torchao's Float8Linear (before compile and
    FSDP2, as torchtitan orders it); returns how many."""
    from torchao.float8 import convert_to_float8_training

    converted = [name for name, module in model.named_modules() if float8_eligible(module, name)]
    convert_to_float8_training(model, module_filter_fn=float8_eligible)
    return len(converted)
