"""What the trainer builds before its first step, in order: the device, the tokenizer
(with the mask and EOS tokens the objective needs) and the model (vocabulary, 4-bit base,
activation checkpointing, compiled blocks, LoRA, FSDP2)."""

import copy

import torch

from unmask.config import RunConfig
from unmask.data import adopt_mask_token, build_tokenizer, ensure_special_tokens
from unmask.errors import InputError
from unmask.models import build_model, decoder_layers, folder_mask_token_id, max_positions
from unmask.models.lora import apply_lora, lora_targets
from unmask.models.quant import quantize_4bit
from unmask.parallel.fsdp import apply_fsdp, compile_blocks
from unmask.parallel.mesh import fsdp_mesh
from unmask.parallel.tensor import apply_tensor_parallel


def check_model_fits(cfg: RunConfig) -> None:
    """Before anything is built: a pretrained folder reads (config.json, whole weight files)
    and rows fit the model's positions."""
    positions = max_positions(cfg.model)
    length = cfg.data.packing_length
    if length > positions:
        fix = ("(the limit of model.pretrained's config.json)" if cfg.model.pretrained
               else "or raise model.max_position_embeddings")  # fmt: skip
        raise InputError(
            f"data.packing_length ({length}) is above the model's max_position_embeddings "
            f"({positions}); lower data.packing_length {fix}"
        )


def prepare_tokenizer(cfg: RunConfig):
    """(tokenizer, the tokenizer as loaded, number of tokens added). The one as loaded is
    what token stores were made with; a LLaDA / Dream folder's mask id is adopted; a mask
    or EOS token is added when missing (refused under LoRA: the embeddings are frozen)."""
    tokenizer = build_tokenizer(cfg.data)
    as_loaded = copy.deepcopy(tokenizer)
    if cfg.model.pretrained is not None:
        folder_mask = folder_mask_token_id(cfg.model.pretrained)
        if folder_mask is not None:
            adopt_mask_token(tokenizer, folder_mask, f"model.pretrained {cfg.model.pretrained!r}")
    added = ensure_special_tokens(tokenizer)
    if added and cfg.model.lora:
        raise InputError(
            "the tokenizer has no mask (or EOS) token and one cannot be added under "
            "model.lora: true (the embeddings are frozen); use a tokenizer that has one"
        )
    return tokenizer, as_loaded, added


def checkpointing_choice(t) -> bool | int:
    """The model's activation checkpointing flag: False (none), True (every layer) or n
    (every n-th layer, selective); train.activation_checkpointing wins over the older
    train.gradient_checkpointing boolean."""
    choice = t.activation_checkpointing
    if choice is None:
        return t.gradient_checkpointing
    if choice == "selective":
        return t.activation_checkpointing_every
    return choice == "full"


def build_train_model(cfg: RunConfig, tokenizer, added_tokens: int, device: torch.device,
                      mesh) -> torch.nn.Module:  # fmt: skip
    """The model on its device, in torchtitan's order: vocabulary resize, 4-bit base, tensor
    parallelism over the mesh's tp dim, activation checkpointing, per-block compile, LoRA,
    then FSDP2 over its dp_shard_cp dims (mesh None: one process)."""
    t = cfg.train
    model = build_model(cfg.model)
    if added_tokens or model.config.vocab_size < len(tokenizer):
        model.resize_token_embeddings(max(len(tokenizer), model.config.vocab_size))
    if cfg.model.load_in_4bit:  # QLoRA: frozen NF4 base, quantized onto the device
        compute = torch.bfloat16 if t.bf16 else torch.float32
        quantize_4bit(model, lora_targets(cfg.model, model), device, compute)
    if mesh is not None and mesh["tp"].size() > 1:
        model.to(device)
        apply_tensor_parallel(model, mesh["tp"])
    model.gradient_checkpointing = checkpointing_choice(t)
    if t.torch_compile:
        compile_blocks(decoder_layers(model))
    if cfg.model.lora:  # peft wrapper: base frozen, LoRA factors train (AdamW)
        model = apply_lora(model, cfg.model)
    model.to(device)
    if mesh is not None:
        apply_fsdp(model, fsdp_mesh(mesh), decoder_layers(model), bf16=t.bf16,
                   reshard_after_forward=t.reshard_after_forward)  # fmt: skip
    return model
