"""QLoRA quantization: which linear layers become 4-bit (peft's matching), never the head."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.errors import InputError
from unmask.models.quant import quantize_4bit

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny():
    return tiny_model(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip


def quantized(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit))


@pytest.mark.parametrize(
    "targets, count",
    [
        (["q_proj", "down_proj"], 4),
        (["self_attn.q_proj"], 2),  # dotted suffix, as peft matches
        (r"model\.layers\.1\..*_proj", 7),  # a string: regex over full names
        (["lm_head", "o_proj"], 2),  # the LM head stays full precision
    ],
)
def test_targets_match_like_peft_and_never_the_head(targets, count):
    model = tiny()
    assert quantize_4bit(model, targets, "cpu", torch.float32) == count
    assert len(quantized(model)) == count
    assert type(model.lm_head) is nn.Linear


def test_no_matching_layer_is_one_clear_error():
    with pytest.raises(InputError, match="none of \\['qproj'\\] is a linear layer"):
        quantize_4bit(tiny(), ["qproj"], "cpu", torch.float32)
