"""Models: the family registry, the native diffusion transformer, HF folders, LoRA and QLoRA.

`build_model(cfg)` is the one entry point the trainer uses: a fresh random model of
`cfg.model_type` (seed torch before calling), or the weights in `cfg.pretrained`.

Modules, bottom to top (each imports only those above it in this list):
shape (the declaration of a family's blocks), diffusion_gemma_layout (DiffusionGemma's folder
layout), moe_layout (the MoE folders' keys), layouts (each family's `FolderLayout`: config.json
and weights in and out), families (the registry), config (ModelConfig), attention, hf (config.json,
safetensors, saving), transformer (DiffusionTransformer), diffusion_gemma (DiffusionGemma),
hf_wrapped (transformers encoders), build (build_model, build_empty, from_pretrained), lora,
quant.
"""

import importlib

#: each public name and the module that defines it: imported when first asked for, so that
#: importing one module of the package (families.py for the CLI's flags) does not load the
#: model code (attention, the transformer, HF folders: a quarter second of `--help`)
_WHERE = {
    "KVCache": "attention",
    **dict.fromkeys(("MODEL_BUILDERS", "build_empty", "build_model", "from_pretrained",
                     "max_positions", "register_family", "resolve_model", "shape_of",
                     "unregister_family", "ResolvedModel"),
                    "build"),
    "ModelConfig": "config",
    **dict.fromkeys(("FAMILIES", "Family", "family_of_config", "samples_with_logit_shift"),
                    "families"),
    **dict.fromkeys(("config_from_hf", "folder_mask_token_id", "hf_config_dict",
                     "save_pretrained"), "hf"),
    **dict.fromkeys(("HF_DIRECT_KEYS", "FolderLayout"), "layouts"),
    **dict.fromkeys(("ModelShape", "TensorPlan", "decoder_layers"), "shape"),
    "DiffusionTransformer": "transformer",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'unmask.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"unmask.models.{_WHERE[name]}"), name)


__all__ = [
    "FAMILIES",
    "HF_DIRECT_KEYS",
    "MODEL_BUILDERS",
    "DiffusionTransformer",
    "Family",
    "FolderLayout",
    "KVCache",
    "ModelConfig",
    "ModelShape",
    "ResolvedModel",
    "TensorPlan",
    "build_empty",
    "build_model",
    "config_from_hf",
    "decoder_layers",
    "family_of_config",
    "folder_mask_token_id",
    "from_pretrained",
    "hf_config_dict",
    "max_positions",
    "register_family",
    "resolve_model",
    "samples_with_logit_shift",
    "save_pretrained",
    "shape_of",
    "unregister_family",
]
