"""gen_length: auto (sampling/autolength.py): the canvas grows by a block while P(EOS) at its
tail is low, and a row that fills its canvas without EOS decodes another block; with no
growth the tokens are those of a fixed canvas of one block."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.errors import InputError
from unmask.sampling import SamplingConfig, autolength, sample
from unmask.sampling.autolength import eos_confidence

MASK, EOS, A, V = 5, 2, 9, 16


class EndsAt(nn.Module):
    """Logits by absolute input position: token A before position `end`, EOS from it on."""

    def __init__(self, end: int):
        super().__init__()
        self.end = end

    def forward(self, ids, **_):
        batch, length = ids.shape
        logits = torch.zeros(batch, length, V)
        at_end = torch.arange(length) >= self.end
        logits[:, :, A] = torch.where(at_end, 0.0, 4.0)
        logits[:, :, EOS] = torch.where(at_end, 4.0, 0.0)
        return logits


def _tiny():
    return tiny_model(vocab_size=V, initializer_range=0.2).eval()


def _auto(**options) -> SamplingConfig:
    return SamplingConfig(**{"gen_length": "auto", "block_length": 4, "gen_length_max": 16,
                             **options})  # fmt: skip


def test_no_growth_gives_the_fixed_canvas_tokens_token_for_token():
    model, prompt = _tiny(), torch.randint(6, V, (3, 5), generator=torch.Generator().manual_seed(1))
    fixed = sample(model, prompt, SamplingConfig(gen_length=4, block_length=4, steps=4),
                   mask_id=MASK, eos_id=EOS)  # fmt: skip
    capped = sample(model, prompt, _auto(gen_length_max=4), mask_id=MASK, eos_id=EOS)
    assert torch.equal(capped.sequences, fixed.sequences)
    assert capped.nfe == fixed.nfe + 1  # one P(EOS) read, then the same decode


def test_the_canvas_grows_while_eos_confidence_is_low():
    prompt = torch.full((2, 3), 7)
    out = sample(EndsAt(end=3 + 9), prompt, _auto(), mask_id=MASK, eos_id=EOS)
    # P(EOS) at the tail is low for canvases of 4 and 8 (last positions 6, 10), high at 12
    assert out.answers.shape[1] == 12
    assert out.answers[0].tolist() == [A] * 9 + [EOS] * 3
    assert out.tokens == 18
    # 3 length reads + 12 one-token steps (one fixed canvas of 12, blocks of 4)
    assert out.nfe == 3 + 12


def test_eos_confidence_reads_the_last_position():
    prompt = torch.full((1, 3), 7)
    low = eos_confidence(EndsAt(end=12), prompt, torch.ones_like(prompt, dtype=torch.bool), 4,
                         _auto(), MASK, EOS)  # fmt: skip
    high = eos_confidence(EndsAt(end=6), prompt, torch.ones_like(prompt, dtype=torch.bool), 4,
                          _auto(), MASK, EOS)  # fmt: skip
    e4 = torch.tensor(4.0).exp().item()
    assert low.item() == pytest.approx(1 / (e4 + V - 1))
    assert high.item() == pytest.approx(e4 / (e4 + V - 1))


def test_threshold_zero_never_grows_the_first_read(monkeypatch):
    reads = []
    real = autolength.eos_confidence

    def spy(model, prompt, valid, gen, *rest):
        reads.append(gen)
        return real(model, prompt, valid, gen, *rest)

    monkeypatch.setattr(autolength, "eos_confidence", spy)
    out = sample(EndsAt(end=3 + 9), torch.full((1, 3), 7), _auto(auto_eos_threshold=0.0),
                 mask_id=MASK, eos_id=EOS)  # fmt: skip
    assert reads == [4]
    # the row filled its 4 positions without EOS, so it decoded more blocks until one held EOS
    assert out.answers[0].tolist() == [A] * 9 + [EOS] * 3


def test_a_row_without_eos_stops_at_the_cap():
    out = sample(EndsAt(end=100), torch.full((1, 3), 7), _auto(), mask_id=MASK, eos_id=EOS)
    assert out.answers[0].tolist() == [A] * 16


def test_rows_grow_on_their_own():
    class PerRow(nn.Module):  # prompt 7 7 7 ends after 2 answer tokens, 8 8 8 after 6
        def forward(self, ids, **_):
            short = EndsAt(3 + 2)(ids)
            return torch.where((ids[:, :1] == 7)[:, :, None], short, EndsAt(3 + 6)(ids))

    prompt = torch.tensor([[7, 7, 7], [8, 8, 8]])
    out = sample(PerRow(), prompt, _auto(), mask_id=MASK, eos_id=EOS)
    assert out.answers.tolist() == [[A, A, EOS, EOS, EOS, EOS, EOS, EOS],
                                    [A] * 6 + [EOS, EOS]]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(gen_length_max=2), "gen_length_max (2) is smaller than one block (block_length 4)"),
        (dict(gen_length_max=10), "gen_length_max (10) must be a multiple of block_length (4)"),
        (dict(gen_length_max=None), "gen_length auto needs block_length"),
    ],
)
def test_bad_caps_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingConfig(gen_length="auto", block_length=4, **options)


def test_a_cap_past_the_models_positions_is_refused():
    model = EndsAt(end=3)
    model.config = type("C", (), {"max_position_embeddings": 12})()
    with pytest.raises(InputError, match="gen_length_max=16 after a prompt of 3 tokens exceeds"):
        sample(model, torch.full((1, 3), 7), _auto(), mask_id=MASK, eos_id=EOS)


def test_the_generate_command_takes_gen_length_auto(tmp_path, capsys):
    from conftest import save_tiny_model

    from unmask.cli import main

    folder = save_tiny_model(tmp_path / "model")
    flags = ["--gen-length", "auto", "--gen-length-max", "8", "--block-length", "4"]
    assert main(["generate", "--model", str(folder), "--prompt", "rep 2x1=", *flags]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("rep 2x1=") and 0 < len(line) - len("rep 2x1=") <= 8
