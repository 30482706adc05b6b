"""Encoder masked-LMs from transformers (BERT, ModernBERT) behind the native model's call.

`MaskedLMEncoder(input_ids, doc_ids=, position_ids=, targets=, vocab_chunk=)` returns logits
or per-token cross-entropy exactly like `DiffusionTransformer`, so the `bert` (mdlm) objective
and the trainer treat both alike. The wrapper registers the transformers model's children
under their own names, so its state dict (and checkpoints) use the HF keys unchanged.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from unmask.diffusion.loss import IGNORE_INDEX
from unmask.errors import InputError
from unmask.models.config import ModelConfig
from unmask.models.families import FAMILIES, family_for_hf_type
from unmask.models.hf import read_config


def _hf_config(cfg: ModelConfig):
    import transformers  # at call time: importing transformers costs seconds of start-up

    family = FAMILIES[cfg.model_type]
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=0,
        **family.hf_extra,
    )
    if family.encoder_rope_key is not None:
        kwargs[family.encoder_rope_key] = cfg.rope_theta
    return transformers.AutoConfig.for_model(family.hf_model_type, **kwargs)


class MaskedLMEncoder(nn.Module):
    """A transformers `*ForMaskedLM` with full (per-document) attention; see module doc."""

    def __init__(self, hf_model: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self._hf = [hf_model]  # a list, so the model is not registered twice
        for name, child in hf_model.named_children():
            self.add_module(name, child)

    @property
    def hf_model(self) -> nn.Module:
        return self._hf[0]

    @property
    def gradient_checkpointing(self) -> bool:
        hf = self.hf_model
        flag = getattr(hf, "is_activation_checkpointing", None)  # transformers >= 5.x name
        return bool(flag if flag is not None else getattr(hf, "is_gradient_checkpointing", False))

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        if value:
            self.hf_model.gradient_checkpointing_enable()
        elif self.gradient_checkpointing:
            self.hf_model.gradient_checkpointing_disable()

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        vocab_chunk: int = 8192,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, L, V), or CE (B, L) float32 (0 where targets == -100)."""
        if attention_mask is not None:
            raise InputError(
                f"model_type {self.config.model_type} cannot take a custom attention mask "
                "(bd3lm needs a native decoder family)"
            )
        mask = None
        if doc_ids is not None and bool((doc_ids != doc_ids[:, :1]).any()):
            mask = (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]  # (B, 1, L, L)
        logits = self.hf_model(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids
        ).logits
        if targets is None:
            return logits
        ce = F.cross_entropy(
            logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
        )
        return ce

    @torch.no_grad()
    def resize_token_embeddings(self, new_size: int) -> None:
        """Grow the vocabulary; new rows = mean of the old rows (transformers' mean resizing)."""
        self.hf_model.resize_token_embeddings(new_size, mean_resizing=True)
        for name, child in self.hf_model.named_children():
            self.add_module(name, child)
        self.config = self.config.model_copy(update={"vocab_size": new_size})

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        return self.hf_model.num_parameters(exclude_embeddings=exclude_embeddings)

    def save_pretrained(self, folder: str) -> None:
        """A transformers folder (config.json + model.safetensors) loadable as it is."""
        self.hf_model.save_pretrained(str(folder))


def build_encoder(cfg: ModelConfig) -> MaskedLMEncoder:
    """A fresh masked-LM of cfg's encoder family (its registry `architecture`: BertForMaskedLM,
    ModernBertForMaskedLM) from the size fields of cfg."""
    import transformers  # at call time: importing transformers costs seconds of start-up

    hf_cfg = _hf_config(cfg)
    cls = getattr(transformers, FAMILIES[cfg.model_type].architecture)
    hf_cfg._attn_implementation = "sdpa"
    return MaskedLMEncoder(cls(hf_cfg), cfg)


def is_wrapped(model: ModelConfig) -> bool:
    """True when the model runs through transformers (a wrapped family such as bert, or a
    pretrained folder of a transformers encoder), not unmask's native decoder: what the
    parallel layouts that cut the decoder (cp, pp, ep) cannot serve."""
    return not FAMILIES[model.model_type].native or (
        model.pretrained is not None and is_encoder_folder(model.pretrained)
    )


def is_encoder_folder(folder: str | Path) -> bool:
    """True when folder's config.json names an encoder family's model_type."""
    if not (Path(folder) / "config.json").is_file():
        return False
    family = family_for_hf_type(read_config(Path(folder)).get("model_type"))
    return family is not None and not family.native


def load_encoder(folder: str | Path) -> MaskedLMEncoder:
    """A local BERT / ModernBERT masked-LM folder (no hub, no remote code)."""
    import transformers  # at call time: importing transformers costs seconds of start-up

    hf = transformers.AutoModelForMaskedLM.from_pretrained(
        str(folder), local_files_only=True, trust_remote_code=False, dtype=torch.float32
    )
    c = hf.config
    cfg = ModelConfig(
        model_type=family_for_hf_type(c.model_type).name,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        pretrained=str(folder),
    )
    return MaskedLMEncoder(hf, cfg)
