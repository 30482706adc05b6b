"""A2D conversion checks on tiny random transformers-made Qwen3 and Llama causal folders,
and the adaptation pieces (annealed masks, the shift, the block schedule) against hand
values."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import PARITY_SIZES, perturb_norms, tiny_model

from unmask.diffusion import DiffusionConfig, build_objective
from unmask.diffusion.adaptation import (
    AdaptedModel,
    annealed_mask,
    block_causal_mask,
    is_causal_folder,
    open_fraction,
)
from unmask.diffusion.adaptation_config import AdaptationConfig, BlockSchedule
from unmask.diffusion.autoregressive import causal_attention_mask
from unmask.models import from_pretrained
from unmask.models.attention import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_causal(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**PARITY_SIZES, head_dim=16, rope_theta=1e4,
                                       tie_word_embeddings=False)  # fmt: skip
        return perturb_norms(transformers.Qwen3ForCausalLM(cfg))
    cfg = transformers.LlamaConfig(**PARITY_SIZES, rope_theta=1e4, tie_word_embeddings=False)
    return perturb_norms(transformers.LlamaForCausalLM(cfg))


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def converted(request, tmp_path_factory):
    """(transformers' causal model, unmask's model loaded from its folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = _hf_causal(request.param)
    hf.save_pretrained(folder)
    assert is_causal_folder(folder) is True
    return hf, from_pretrained(folder).float().eval()


def _ids(length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(seed))


def test_causal_mask_and_shift_give_the_ar_models_predictions(converted):
    """Step 0 of an adaptation with the shift: under a causal mask, the converted model's
    prediction for position i (read at output i - 1) is the AR model's next-token logits."""
    hf, ours = converted
    ids = _ids()
    with torch.no_grad():
        reference = hf(ids).logits  # (B, L, V): output j predicts token j + 1
        shifted = AdaptedModel(ours, causal_attention_mask(12), shift=True)(ids)
    assert (shifted[:, 1:] - reference[:, :-1]).abs().max().item() <= 1e-5
    # the bidirectional model is not the AR one (the check can fail)
    with torch.no_grad():
        full = AdaptedModel(ours, None, shift=True)(ids)
    assert (full[:, 1:] - reference[:, :-1]).abs().max().item() > 1e-3


def test_full_attention_lets_a_future_token_change_the_past(converted):
    _, ours = converted
    ids = _ids()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 97
    with torch.no_grad():
        moved = (ours(changed)[:, 0] - ours(ids)[:, 0]).abs().max().item()
        causal = causal_attention_mask(12)
        still = (ours(changed, attention_mask=causal)[:, 0]
                 - ours(ids, attention_mask=causal)[:, 0]).abs().max().item()  # fmt: skip
    assert moved > 1e-4
    assert still == 0.0


def test_block_causal_with_a_kv_cache_equals_the_uncached_forward(converted):
    """Staircase attention (blocks of 4 from the sequence start): feeding one block at a
    time over the cached keys of the finished blocks gives the logits of one uncached
    forward over the whole row."""
    _, ours = converted
    ids, block = _ids(12), 4
    blocks = torch.arange(12) // block
    with torch.no_grad():
        uncached = ours(ids, attention_mask=block_causal_mask(blocks))
        cache = KVCache(store=True)
        pieces = [ours(ids[:, :block], attention_mask=block_causal_mask(blocks[:block]),
                       kv_cache=cache)]  # fmt: skip
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
            cache.keys[layer] = torch.cat([k, k.new_zeros(*k.shape[:2], 8, k.shape[3])], 2)
            cache.values[layer] = torch.cat([v, v.new_zeros(*v.shape[:2], 8, v.shape[3])], 2)
        cache.store = False
        for start in (4, 8):
            cache.start = start
            mask = block_causal_mask(blocks)[:, :, start : start + block]
            positions = torch.arange(start, start + block).expand(2, block)
            pieces.append(ours(ids[:, start : start + block], position_ids=positions,
                               attention_mask=mask, kv_cache=cache))  # fmt: skip
    cached = torch.cat(pieces, dim=1)
    assert (cached - uncached).abs().max().item() <= 1e-5
    # and the staircase is not full attention: block 0 differs from a full forward's
    with torch.no_grad():
        full = ours(ids)
    assert (full[:, :4] - uncached[:, :4]).abs().max().item() > 1e-4


def test_block_causal_mask_by_hand():
    mask = block_causal_mask(torch.tensor([0, 0, 1, 1, 2]))[0, 0].int()
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0],
                             [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # fmt: skip


def test_annealed_mask_opens_from_causal_to_full():
    causal = causal_attention_mask(64)
    assert torch.equal(annealed_mask(64, 0.0, seed=1, step=0), causal)
    assert annealed_mask(64, 1.0, seed=1, step=9) is None  # full attention
    half = annealed_mask(64, 0.5, seed=1, step=5)
    future = ~causal[0, 0]
    share = half[0, 0][future].float().mean().item()
    assert 0.45 < share < 0.55 and bool(half[0, 0][~future].all())
    assert torch.equal(half, annealed_mask(64, 0.5, seed=1, step=5))  # a function of the step
    assert not torch.equal(half, annealed_mask(64, 0.5, seed=1, step=6))
    assert [open_fraction(s, 4) for s in (0, 1, 4, 9)] == [0.0, 0.25, 1.0, 1.0]


def test_block_schedule_warms_up_holds_the_row_and_decays():
    schedule = BlockSchedule(warmup=[1, 4], warmup_steps=3, stable_steps=2, decay=[8, 2],
                             decay_steps=2)  # fmt: skip
    sizes = [schedule.block_size(step, 16) for step in range(14)]
    assert sizes == [1, 1, 1, 4, 4, 4, 16, 16, 8, 8, 2, 2, 2, 2]
    assert schedule.length() == 10 and schedule.final_block == 2
    assert schedule.describe() == (
        "1 to step 3, 4 to step 6, the whole row to step 8, 8 to step 10, then 2"
    )  # the start-up line's words
    assert BlockSchedule(decay=[4]).describe() == "4"


def test_shifted_adaptation_loss_by_hand():
    """mdlm under adaptation.shift: masked token i is scored by the output at i - 1 (of the
    bidirectional model), weighted 1 / t; the document start is never masked."""
    model = tiny_model(0).float()
    cfg = DiffusionConfig(objective="mdlm", adaptation=AdaptationConfig(shift=True))
    objective = build_objective(cfg, mask_id=127)
    ids = torch.randint(0, 120, (1, 8), generator=torch.Generator().manual_seed(2))
    masked = torch.tensor([[False, True, False, True, True, False, False, True]])
    noisy = ids.masked_fill(masked, 127)
    t = torch.tensor([0.5])
    batch = {"input_ids": ids, "t": t, "noisy_input_ids": noisy, "masked": masked}
    loss_sum, count = objective(model, batch)
    with torch.no_grad():
        logits = model(noisy)
    expected = sum(F.cross_entropy(logits[0, i - 1], ids[0, i]).item() / 0.5
                   for i in (1, 3, 4, 7))  # fmt: skip
    assert loss_sum.item() == pytest.approx(expected, rel=1e-5)
    assert count.item() == 7  # the document start is not maskable under the shift
    # the drawn noise never masks position 0
    drawn = objective.with_noise({"input_ids": ids.expand(64, 8)}, torch.Generator().manual_seed(0))
    assert not bool(drawn["masked"][:, 0].any()) and bool(drawn["masked"][:, 1].any())


def test_annealed_objective_uses_the_steps_mask():
    """At step 0 of an anneal the adapted objective's loss is that of the causal model."""
    model = tiny_model(1).float()
    cfg = DiffusionConfig(objective="mdlm",
                          adaptation=AdaptationConfig(attention="anneal", anneal_steps=10))  # fmt: skip
    objective = build_objective(cfg, mask_id=127)
    ids = torch.randint(0, 120, (1, 8), generator=torch.Generator().manual_seed(3))
    masked = torch.tensor([[False, True, True, False, True, False, True, True]])
    noisy = ids.masked_fill(masked, 127)
    batch = {"input_ids": ids, "t": torch.tensor([1.0]), "noisy_input_ids": noisy,
             "masked": masked}  # fmt: skip
    objective.begin_step(0)
    with torch.no_grad():
        causal = model(noisy, attention_mask=causal_attention_mask(8))
        full = model(noisy)

    def by_hand(logits):
        return sum(F.cross_entropy(logits[0, i], ids[0, i]).item() for i in (1, 2, 4, 6, 7))

    assert objective(model, batch)[0].item() == pytest.approx(by_hand(causal), rel=1e-5)
    objective.begin_step(10)
    assert objective(model, batch)[0].item() == pytest.approx(by_hand(full), rel=1e-5)


def test_a_dlm_folder_is_not_causal(tmp_path):
    model = tiny_model(0)
    model.save_pretrained(str(tmp_path / "dlm"))
    assert is_causal_folder(tmp_path / "dlm") is False  # unmask's tag, no ar sampling
    (tmp_path / "dlm" / "generation_config.json").write_text(
        json.dumps({"unmask": {"autoregressive": True}})
    )
    assert is_causal_folder(tmp_path / "dlm") is True  # an ar run's folder
    assert is_causal_folder(tmp_path / "missing") is None
