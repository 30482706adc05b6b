"""Model registry: family name -> builder, plus loading and saving HF folders.

`build_model(cfg)` is the one entry point the trainer uses: a fresh random model of
`cfg.model_type` (seed torch before calling), or the weights in `cfg.pretrained`.
"""

from collections.abc import Callable

from unmask.models.config import ModelConfig
from unmask.models.hf import config_from_hf, from_pretrained, hf_config_dict, save_pretrained
from unmask.models.hf_wrapped import build_encoder, is_encoder_folder, load_encoder
from unmask.models.transformer import DiffusionTransformer

MODEL_BUILDERS: dict[str, Callable[[ModelConfig], DiffusionTransformer]] = {
    "qwen3_dllm": DiffusionTransformer,
    "qwen2_dllm": DiffusionTransformer,
    "llama_dllm": DiffusionTransformer,
    "dream": DiffusionTransformer,
    "llada": DiffusionTransformer,
    "bert": build_encoder,
    "modernbert": build_encoder,
}


def build_model(cfg: ModelConfig) -> DiffusionTransformer:
    """Random-init model for cfg (call torch.manual_seed first), or load cfg.pretrained."""
    if cfg.pretrained is not None:
        if is_encoder_folder(cfg.pretrained):
            return load_encoder(cfg.pretrained)
        return from_pretrained(cfg.pretrained, attn_implementation=cfg.attn_implementation)
    return MODEL_BUILDERS[cfg.model_type](cfg)


__all__ = [
    "MODEL_BUILDERS",
    "DiffusionTransformer",
    "ModelConfig",
    "build_model",
    "config_from_hf",
    "from_pretrained",
    "hf_config_dict",
    "save_pretrained",
]
