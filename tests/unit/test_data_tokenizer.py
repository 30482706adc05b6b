"""Char tokenizer round trip, local folders, mask-token policy, errors."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from unmask.data import DataConfig, build_tokenizer, ensure_special_tokens, mask_token_id
from unmask.data.tokenizer import CHAR_ALPHABET
from unmask.errors import InputError

TEXT = "Hello,  World!\nrev 3917=7193\t{x: [1, 2]} ~`'\"\\"


def test_char_round_trip_is_exact():
    tok = build_tokenizer(DataConfig())
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)  # one token per character, no BOS/EOS
    assert tok.decode(ids) == TEXT
    assert tok.decode(tok.encode(CHAR_ALPHABET)) == CHAR_ALPHABET


def test_char_special_tokens():
    tok = build_tokenizer(DataConfig())
    assert (tok.pad_token_id, tok.eos_token_id, tok.mask_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(CHAR_ALPHABET)
    assert mask_token_id(tok) == 2
    assert ensure_special_tokens(tok) == 0
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]


def test_char_save_and_load(tmp_path):
    tok = build_tokenizer(DataConfig())
    tok.save_pretrained(tmp_path / "tok")
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    loaded = build_tokenizer(DataConfig(tokenizer=str(tmp_path / "tok")))
    for other in (auto, loaded):
        assert other.encode(TEXT) == tok.encode(TEXT)
        assert other.decode(other.encode(TEXT)) == TEXT
        assert other.mask_token_id == tok.mask_token_id
        assert other.eos_token_id == tok.eos_token_id
        assert other.pad_token_id == tok.pad_token_id


def _word_tokenizer(folder, eos: bool):
    """A WordLevel tokenizer trained here, without a mask token."""
    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "</s>"] if eos else ["[UNK]"]
    core.train_from_iterator(
        ["the cat sat", "the dog ran"], trainers.WordLevelTrainer(special_tokens=specials)
    )
    kwargs = {"eos_token": "</s>"} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", **kwargs).save_pretrained(
        folder
    )
    return str(folder)


def test_mask_token_added_when_missing(tmp_path):
    tok = build_tokenizer(DataConfig(tokenizer=_word_tokenizer(tmp_path / "w", eos=True)))
    before = len(tok)
    assert tok.mask_token is None
    assert ensure_special_tokens(tok) == 1
    assert len(tok) == before + 1
    assert mask_token_id(tok) == before  # appended at the end of the vocabulary
    assert tok.pad_token_id == tok.eos_token_id  # pad defaults to EOS
    assert ensure_special_tokens(tok) == 0  # idempotent


def test_eos_and_mask_added_when_missing(tmp_path):
    tok = build_tokenizer(DataConfig(tokenizer=_word_tokenizer(tmp_path / "w", eos=False)))
    before = len(tok)
    assert ensure_special_tokens(tok) == 2
    assert {tok.eos_token_id, tok.mask_token_id} == {before, before + 1}
    assert tok.pad_token_id == tok.eos_token_id
    assert tok.decode(tok.encode("the cat", add_special_tokens=False)) == "the cat"


def test_mask_token_id_error_when_missing(tmp_path):
    tok = build_tokenizer(DataConfig(tokenizer=_word_tokenizer(tmp_path / "w", eos=True)))
    with pytest.raises(InputError, match="ensure_special_tokens"):
        mask_token_id(tok)


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(InputError, match=r"data.tokenizer: folder .*nope.* does not exist"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope")))


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no tokenizer files") as err:
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "empty")))
    assert "\n" not in str(err.value)
