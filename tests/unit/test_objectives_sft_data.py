"""SFT data: chat `messages` and prompt/response rows, chat templates, and the prompt/answer
border kept per row through packing and padding."""

import json

import pytest

from unmask.data import DataConfig, build_char_tokenizer, build_datasets, load_records
from unmask.data.packing import tokenize_records
from unmask.errors import InputError

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _rows(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
            ]
        },
        {"prompt": "hi", "response": "yo"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _split(tokenizer, example):
    n = example.maskable.index(True)
    return tokenizer.decode(example.ids[:n]), tokenizer.decode(example.ids[n:])


def test_chat_template_formats_messages_and_pairs(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    records = load_records(_rows(tmp_path))
    assert records[0]["messages"][-1] == {"role": "assistant", "content": "4"}
    chat, pair = tokenize_records(records, tok, tok.eos_token_id)
    assert _split(tok, chat) == ("<system>be brief\n<user>2+2?\n<assistant>", "4\n<eos>")
    assert _split(tok, pair) == ("<user>hi\n<assistant>", "yo\n<eos>")
    # the prompt is never maskable, everything after the border is
    assert chat.maskable == [False] * 39 + [True] * 3
    # chat_template: false leaves prompt/response pairs as they are
    _, raw = tokenize_records(records, tok, tok.eos_token_id, chat_template=False)
    assert _split(tok, raw) == ("hi", "yo<eos>")


def test_messages_without_a_template_use_role_lines(tmp_path):
    tok = build_char_tokenizer()
    chat, pair = tokenize_records(load_records(_rows(tmp_path)), tok, tok.eos_token_id)
    assert _split(tok, chat) == ("system: be brief\nuser: 2+2?\nassistant: ", "4<eos>")
    assert _split(tok, pair) == ("hi", "yo<eos>")


@pytest.mark.parametrize("packing", [True, False])
def test_border_survives_packing_and_padding(tmp_path, packing):
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    cfg = DataConfig(dataset=str(_rows(tmp_path)), packing=packing, packing_length=64, eval_split=0)
    train = build_datasets(cfg, tok).train
    ids, maskable = train.tensors["input_ids"], train.tensors["maskable"]
    text = tok.decode(ids[maskable].tolist())
    assert "4\n<eos>" in text and "yo\n<eos>" in text
    assert "<user>" not in text and "2+2?" not in text  # prompts never maskable


def test_bad_messages_are_one_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(InputError, match="last message must be the assistant's answer"):
        load_records(path)
    path.write_text(json.dumps({"messages": [{"content": "q"}]}) + "\n")
    with pytest.raises(InputError, match="every message needs 'role' and 'content'"):
        load_records(path)
