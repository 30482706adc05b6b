"""Tokenizers: the built-in character tokenizer, local HF folders, and the mask-token policy.

Policy (docs/diffusion.md): use the tokenizer's mask token; when it has none, add one and let the
caller resize the model's embeddings (`ensure_special_tokens` returns how many were added).
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from unmask.data.config import DataConfig
from unmask.errors import InputError

PAD, EOS, MASK, UNK = "<pad>", "<eos>", "<mask>", "<unk>"
CHAR_SPECIAL_TOKENS = (PAD, EOS, MASK, UNK)
# Printable ASCII without the rarely wanted vertical whitespace (\r, \x0b, \x0c).
CHAR_ALPHABET = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
)


def build_tokenizer(cfg: DataConfig) -> PreTrainedTokenizerFast:
    """The run's tokenizer: "char" or a local folder. Special tokens are not added here."""
    if cfg.tokenizer == "char":
        return build_char_tokenizer()
    return load_local_tokenizer(cfg.tokenizer)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of `CHAR_ALPHABET`; ids 0..3 are <pad> <eos> <mask> <unk>.

    The Fuse decoder joins tokens with nothing between them, so decode(encode(s)) == s for
    any string over the alphabet (other characters become <unk>).
    """
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIAL_TOKENS)}
    for ch in CHAR_ALPHABET:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece, whitespace and newlines included.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(CHAR_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )


def load_local_tokenizer(
    path: str, setting: str = "data.tokenizer", fix: str | None = None
) -> PreTrainedTokenizerFast:
    """A tokenizer saved in a local folder; never remote code, never the network. `setting`
    names where the path came from in error messages (a config key or a CLI flag); `fix`
    replaces the advice when the folder holds no tokenizer files."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        char = '"char" or ' if setting in ("data.tokenizer", "--tokenizer") else ""
        raise InputError(
            f"{setting}: folder {path!r} does not exist; use {char}a local folder holding "
            "tokenizer.json / tokenizer_config.json"
        )
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise InputError(
            f"{setting}: folder {path!r} holds no tokenizer files "
            f"(expected one of {', '.join(_TOKENIZER_FILES)}); "
            + (fix or "save one there with tokenizer.save_pretrained(folder)")
        )
    try:
        tok = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers and tokenizers raise many types for a bad file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if not isinstance(exc, OSError | ValueError) or not first:
            first = f"{type(exc).__name__} {first}".strip()
        advice = fix or "save a tokenizer there with tokenizer.save_pretrained(folder)"
        raise InputError(f"{setting}: cannot load {path!r}: {first}; {advice}") from exc
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise InputError(
            f"{setting}: {path!r} loads as a slow tokenizer ({type(tok).__name__}); "
            "save it with a tokenizer.json (a fast tokenizer)"
        )
    return tok


def adopt_mask_token(tokenizer: PreTrainedTokenizerFast, token_id: int, source: str) -> None:
    """Make `token_id` (the mask id a model folder names, `unmask.models.folder_mask_token_id`)
    the tokenizer's mask token: the model was trained with that id, so it wins over whatever
    the tokenizer says. `source` names the folder in the error message."""
    if tokenizer.mask_token_id == token_id:
        return
    if not 0 <= token_id < len(tokenizer):
        raise InputError(
            f"{source}: mask_token_id {token_id} is outside the tokenizer's {len(tokenizer)} "
            "tokens; use the tokenizer saved with that model (data.tokenizer)"
        )
    tokenizer.mask_token = tokenizer.convert_ids_to_tokens(token_id)


def ensure_special_tokens(tokenizer: PreTrainedTokenizerFast) -> int:
    """Give the tokenizer a mask and an EOS token (pad defaults to EOS); return #tokens added.

    When the result is > 0 the caller must resize the model's embeddings to len(tokenizer)
    (mean init) before training: a token is never added without resizing.
    """
    before = len(tokenizer)
    if tokenizer.eos_token is None:
        tokenizer.add_special_tokens({"eos_token": EOS})
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": MASK})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return len(tokenizer) - before


def mask_token_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The id the forward process writes into masked positions."""
    if tokenizer.mask_token_id is None:
        raise InputError(
            "the tokenizer has no mask token; call unmask.data.ensure_special_tokens(tokenizer) "
            "and resize the model's embeddings"
        )
    return int(tokenizer.mask_token_id)
