"""Open a saved model for sampling: any folder unmask writes (a checkpoint-N of one process
or many, a LoRA adapter, final/, an exported folder, a run output_dir) -> weights on a
device, tokenizer, special ids and the folder's sampling options (generation_config.json)."""

from pathlib import Path

import torch

from unmask.checkpoint.layout import resolve_model_folder
from unmask.checkpoint.saved import inspect_saved, load_saved_model
from unmask.data.tokenizer import load_local_tokenizer
from unmask.device import resolve_device
from unmask.errors import InputError
from unmask.models import folder_mask_token_id
from unmask.sampling.generation_file import saved_sampling
from unmask.sampling.texts import SamplingModel


def load_for_sampling(
    model_path: str | Path,
    tokenizer_path: str | Path | None = None,
    device: str = "auto",
    mask_id: int | None = None,
    dtype: torch.dtype | None = None,
    base: str | Path | None = None,
) -> SamplingModel:
    """The model at model_path in eval mode on `device`, with its tokenizer (or the one at
    tokenizer_path). The mask id: `mask_id`, else the folder's (`folder_mask_token_id`:
    config.json's, or its family's released id; an adapter's base folder's), else the
    tokenizer's; a uniform-canvas model (DiffusionGemma) needs none, and where the tokenizer
    has none its pad id stands for the positions not generated yet. `base`: the base model
    folder of an unmerged LoRA adapter, in place of the one it records."""
    folder = resolve_model_folder(model_path)
    saved = inspect_saved(folder, base)  # a broken config.json or a missing base, named first
    if tokenizer_path:
        tokenizer = load_local_tokenizer(str(tokenizer_path), "tokenizer")
    else:
        fix = "pass --tokenizer FOLDER (lm-eval: tokenizer=FOLDER in model_args)"
        tokenizer = load_local_tokenizer(str(folder), "model folder", fix)
    if mask_id is None and saved.config_folder is not None:
        mask_id = folder_mask_token_id(saved.config_folder)
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    sampling = saved_sampling(folder)
    if mask_id is None and sampling.get("uniform_canvas"):  # no [MASK]: a placeholder
        mask_id = pad_id
    if mask_id is None:
        raise InputError("the tokenizer has no mask token; pass --mask-id")
    device = resolve_device(device)  # auto: cuda when visible
    model = load_saved_model(saved, dtype).to(device).eval()
    vocab = model.config.vocab_size
    if len(tokenizer) > vocab:  # its top ids would index past the embedding
        raise InputError(
            f"the tokenizer has {len(tokenizer)} tokens, more than the {vocab} of the model in "
            f"{str(folder)!r}; pass the tokenizer the model was trained with (--tokenizer)"
        )
    if not 0 <= mask_id < vocab:
        raise InputError(
            f"mask token id {mask_id} is outside the vocabulary of the model in "
            f"{str(folder)!r} ({vocab} tokens); pass --mask-id"
        )
    return SamplingModel(model, tokenizer, mask_id, eos_id, pad_id, device, sampling,
                         folder=folder)  # fmt: skip
