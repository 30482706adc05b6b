"""The ar objective (next-token loss under a causal mask) and its left-to-right sampler,
against hand-computed cross-entropy and transformers' own greedy `generate`."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import PARITY_SIZES, perturb_norms, tiny_model

from unmask.diffusion import DiffusionConfig, build_objective
from unmask.diffusion.autoregressive import causal_attention_mask, next_token_targets
from unmask.models import from_pretrained
from unmask.sampling import SamplingConfig
from unmask.sampling.generate import left_pad, sample

pytestmark = pytest.mark.usefixtures("one_thread")


def test_targets_are_the_next_maskable_token_of_the_same_document():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    maskable = torch.tensor([[False, True, True, False, True, True]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    targets = next_token_targets({"input_ids": ids, "maskable": maskable, "doc_ids": doc_ids})
    # output 2 would predict 8, which starts document 1 (and is a prompt token): no target
    assert targets.tolist() == [[6, 7, -100, 9, 10, -100]]


def test_ar_loss_is_the_shifted_cross_entropy_of_a_causal_model():
    model = tiny_model(0).float()
    objective = build_objective(DiffusionConfig(objective="ar"), mask_id=127)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 120, (2, 10), generator=g)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[0, :4] = False  # a prompt: its tokens are read, not predicted
    loss_sum, count = objective(model, {"input_ids": ids, "maskable": maskable})

    with torch.no_grad():
        logits = model(ids, attention_mask=causal_attention_mask(10))
    expected, n = 0.0, 0
    for row in range(2):
        for i in range(9):
            if maskable[row, i + 1]:
                expected += F.cross_entropy(logits[row, i], ids[row, i + 1]).item()
                n += 1
    assert count.item() == n == 9 + 6  # row 0: outputs 3..8 predict its answer
    assert loss_sum.item() == pytest.approx(expected, rel=1e-5)
    assert objective.count({"input_ids": ids, "maskable": maskable}).item() == n


def test_ar_loss_does_not_see_the_future():
    """Changing the last token changes no loss term but the one predicting it."""
    model = tiny_model(1).float()
    objective = build_objective(DiffusionConfig(objective="ar"), mask_id=127)
    ids = torch.randint(0, 120, (1, 8), generator=torch.Generator().manual_seed(0))
    upto = ids.clone()
    upto[0, -1] = (ids[0, -1] + 1) % 120
    cut = {"input_ids": ids, "maskable": torch.tensor([[True] * 7 + [False]])}
    cut_changed = {**cut, "input_ids": upto}
    a = objective(model, cut)[0].item()
    b = objective(model, cut_changed)[0].item()
    assert a == pytest.approx(b, abs=1e-6)


def _hf_qwen3(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**PARITY_SIZES, head_dim=16, rope_theta=1e4,
                                   tie_word_embeddings=False)  # fmt: skip
    return perturb_norms(transformers.Qwen3ForCausalLM(cfg))


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_equals_transformers_generate(tmp_path, padded):
    hf = _hf_qwen3()
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (7,), generator=g).tolist()]
    prompts.append(torch.randint(0, 97, (4 if padded else 7,), generator=g).tolist())
    ids, valid = left_pad(prompts, pad_id=0)
    config = SamplingConfig(autoregressive=True, gen_length=12)
    out = sample(ours, ids, config, mask_id=96, attention_mask=valid)

    reference = hf.generate(ids, attention_mask=valid.long(), max_new_tokens=12,
                            do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(out.sequences, reference)
    assert out.nfe == 12 and out.decoded == 24  # one prompt forward, then one per token


def test_kv_cached_logits_equal_a_full_causal_forward(tmp_path):
    """Each step's logits (through the cache) equal the full causal forward's at that
    position: the cache is exact, not an approximation."""
    hf = _hf_qwen3(1)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    seen = []
    out = sample(ours, ids, SamplingConfig(autoregressive=True, gen_length=5), mask_id=96,
                 on_step=seen.append)  # fmt: skip
    assert len(seen) == 5
    with torch.no_grad():
        full = ours(out.sequences, attention_mask=causal_attention_mask(11))
    assert torch.equal(full[0, 5:10].argmax(-1), out.sequences[0, 6:11])
    with torch.no_grad():
        hf_logits = hf(out.sequences).logits
    assert (full - hf_logits).abs().max().item() < 1e-5


def test_eos_stops_rows_and_fills_the_rest():
    model = tiny_model(2).float().eval()
    ids = torch.randint(0, 120, (3, 4), generator=torch.Generator().manual_seed(4))
    config = SamplingConfig(autoregressive=True, gen_length=8)
    free = sample(model, ids, config, mask_id=127)
    eos = int(free.sequences[0, 6])  # row 0 chooses this at its third answer token
    out = sample(model, ids, config, mask_id=127, eos_id=eos)
    row = out.sequences[0, 4:].tolist()
    assert row[:3] == free.sequences[0, 4:7].tolist() and row[3:] == [eos] * 5


def test_sampled_tokens_follow_top_k():
    model = tiny_model(3).float().eval()
    ids = torch.randint(0, 120, (2, 5), generator=torch.Generator().manual_seed(6))
    config = SamplingConfig(autoregressive=True, gen_length=1, temperature=1.0, top_k=1)
    greedy = sample(model, ids, config.updated(temperature=0.0, top_k=0), mask_id=127)
    drawn = sample(model, ids, config, mask_id=127, generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn.sequences, greedy.sequences)  # top-1 of a draw is the argmax


def test_autoregressive_refuses_masked_decoding_options():
    with pytest.raises(ValueError, match="block_causal does not apply"):
        SamplingConfig(autoregressive=True, block_causal=True)
    with pytest.raises(ValueError, match="give gen_length N"):
        SamplingConfig(autoregressive=True, gen_length="auto", block_length=4,
                       gen_length_max=8)  # fmt: skip
