"""Equal confidences are broken as the reference samplers break them (issue 26, item 1).

LLaDA, Dream and Fast-dLLM pick positions with torch.topk over the whole canvas row (-inf
outside what may be chosen); torch orders equal values by a partial-sort / nth_element pass
that depends on the row's length and contents, so a topk over the block alone, or with
another k, picks other positions among ties. Oracles: the references' own topk calls on
their own tensor layout (selection functions), and their decoding loops written out (LLaDA,
Fast-dLLM, Dream) on models whose logits tie exactly (`sample`, token for token).
"""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.sampling import SamplingConfig, left_pad, sample
from unmask.sampling.generate import canvas_blocks
from unmask.sampling.schedules import dream_transfer_count
from unmask.sampling.transfer import (
    select_carried_threshold,
    select_factor,
    select_threshold,
    select_top_k,
)

pytestmark = pytest.mark.usefixtures("one_thread")

V, MASK_ID, EOS, PAD, EOT = 19, 18, 17, 16, 15
INF = float("-inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------- the selection functions


def tied_canvas(seed: int, batch: int, prompt: int, block: int, blocks_before: int, after: int):
    """A canvas as the references see it mid-decoding: x (B, L) with the prompt (padding
    or tokens alike: no masks) and finished blocks, the current block [start, end) partly
    masked, masks after it; x0_p (B, L) float64 confidences from {0, 0.25, 0.5, 0.75} (0: LLaDA's EOS
    proposals under confidence_eos_eot_inf), so most rows have ties."""
    g = gen(seed)
    start = prompt + blocks_before * block
    end = start + block
    x = torch.randint(0, EOS, (batch, end + after), generator=g)
    x[:, start:] = MASK_ID
    x[:, start:end][torch.rand(batch, block, generator=g) < 0.25] = 3  # committed earlier
    x0_p = torch.randint(0, 4, x.shape, generator=g).double() / 4
    return x, x0_p, start, end


SHAPES = [  # (batch, prompt width, block, blocks before, positions after the block)
    (3, 5, 4, 0, 8), (4, 9, 8, 1, 16), (2, 3, 12, 2, 0), (5, 20, 16, 0, 32), (3, 7, 16, 3, 16),
]  # fmt: skip


def block_confidence(x, x0_p, start, end):
    """unmask's input: the block's confidences (B, Lb), -inf where not masked."""
    return torch.where(x[:, start:end] == MASK_ID, x0_p[:, start:end], INF)


def llada_confidence(x, x0_p, end):
    """LLaDA's `confidence`: x0_p with -inf after the block, then -inf where not masked."""
    x0_p = x0_p.clone()
    x0_p[:, end:] = INF
    return torch.where(x == MASK_ID, x0_p, INF)


def as_block(positions, start, end, width):
    """Canvas positions (a list of index tensors, one per row) as bool (B, Lb)."""
    out = torch.zeros(len(positions), width, dtype=torch.bool)
    for row, idx in enumerate(positions):
        out[row, idx] = True
    assert not out[:, :start].any() and not out[:, end:].any()
    return out[:, start:end]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(6))
def test_quota_equals_lladas_topk_over_the_canvas_row(shape, seed):
    x, x0_p, start, end = tied_canvas(seed, *shape)
    masks = (x[:, start:end] == MASK_ID).sum(1)
    k = (masks.double() * torch.rand(len(masks), generator=gen(seed)) + 0.5).long()
    k = torch.minimum(k.clamp_min(1), masks)  # a quota per row, as LLaDA's per-block split
    confidence = llada_confidence(x, x0_p, end)
    # LLaDA: `for j ...: _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j, i])`
    ref = [torch.topk(confidence[j], k=int(k[j])).indices for j in range(len(k))]
    ref = as_block(ref, start, end, x.shape[1])
    ours = select_top_k(block_confidence(x, x0_p, start, end), k, offset=start,
                        width=x.shape[1])  # fmt: skip
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(6))
def test_quota_equals_dreams_topk_over_the_canvas(shape, seed):
    # Dream: full_confidence (B, L) -inf but at masks, `torch.topk(full_confidence, k)` with
    # one k for the batch (its canvas is one block: the masks after it count too)
    x, x0_p, start, _ = tied_canvas(seed, *shape)
    full_confidence = torch.where(x == MASK_ID, x0_p, INF)
    k = int((x == MASK_ID).sum(1).min()) // 2 + 1
    ref = as_block(list(torch.topk(full_confidence, k).indices), start, x.shape[1], x.shape[1])
    ours = select_top_k(full_confidence[:, start:], torch.full((x.shape[0],), k),
                        offset=start, width=x.shape[1])  # fmt: skip
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threshold", [0.6, 0.9])
@pytest.mark.parametrize("seed", range(4))
def test_threshold_equals_fast_dllms_topk_over_the_canvas_row(shape, threshold, seed):
    x, x0_p, start, end = tied_canvas(seed, *shape)
    confidence = llada_confidence(x, x0_p, end)
    # Fast-dLLM get_transfer_index: k = the row's mask count; select_index[0] always, the
    # rest of the ranking only at confidence >= threshold
    ref = []
    for j in range(x.shape[0]):
        n = int((confidence[j] > INF).sum())
        values, select_index = torch.topk(confidence[j], k=n)
        ref.append(torch.cat([select_index[:1], select_index[1:][values[1:] >= threshold]]))
    ref = as_block(ref, start, end, x.shape[1])
    ours = select_threshold(block_confidence(x, x0_p, start, end), threshold, offset=start,
                            width=x.shape[1])  # fmt: skip
    assert torch.equal(ours, ref)


def fast_dllm_factor_count(values: list[float], factor: float) -> int:
    """Fast-dLLM get_transfer_index_dynamic's count from one row's sorted confidences: ranks
    accepted while values[i] >= 1 - factor / (i + 2), the first always. Fast-dLLM also
    accepts its last rank when only that one fails (`top_i == len(threshs) - 1`); unmask's
    documented rule does not, and that is no matter of ties, so it is left out here."""
    threshs = [1 - factor / (n + 1) for n in range(1, len(values) + 1)]
    threshs[0] = -1
    for top_i in range(len(threshs)):
        if values[top_i] < threshs[top_i]:
            return max(top_i, 1)
    return len(threshs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("factor", [1.0, 1.2])
@pytest.mark.parametrize("seed", range(4))
def test_factor_equals_fast_dllms_topk_over_the_canvas_row(shape, factor, seed):
    x, x0_p, start, end = tied_canvas(seed, *shape)
    x0_p = 0.55 + 0.3 * x0_p  # 0.55 .. 0.775: the factor rule stops among equal values
    x0_p[:, start + 1 :: 3] = 0.1  # and a few low ones end every ranking well before its end
    confidence = llada_confidence(x, x0_p, end)
    ref = []
    for j in range(x.shape[0]):
        masked = x[j] == MASK_ID
        masked[end:] = False
        ordered = torch.sort(confidence[j][masked], descending=True)[0].tolist()
        ref.append(torch.topk(confidence[j], k=fast_dllm_factor_count(ordered, factor)).indices)
    ref = as_block(ref, start, end, x.shape[1])
    ours = select_factor(block_confidence(x, x0_p, start, end), factor, offset=start,
                         width=x.shape[1])  # fmt: skip
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("seed", range(4))
def test_carried_threshold_equals_dreams_topk_over_the_canvas(shape, threshold, seed):
    x, x0_p, start, end = tied_canvas(seed, *shape)
    confidence = llada_confidence(x, x0_p, end)
    quota = (x[:, start:end] == MASK_ID).sum(1) // 2 + 1
    ref = []
    for j in range(x.shape[0]):  # Dream: topk(full_confidence (1, L), current_transfer_tokens)
        values, select_index = torch.topk(confidence[j : j + 1], int(quota[j]))
        keep = [select_index[0, 0]] + [
            select_index[0, r] for r in range(1, int(quota[j])) if values[0, r] >= threshold
        ]
        ref.append(torch.stack(keep))
    ref = as_block(ref, start, end, x.shape[1])
    ours, carried = select_carried_threshold(block_confidence(x, x0_p, start, end), quota,
                                             threshold, offset=start, width=x.shape[1])  # fmt: skip
    assert torch.equal(ours, ref)
    assert torch.equal(carried, quota - ref.sum(1))


def test_sub_block_threshold_takes_the_first_of_equal_tops_as_fast_dllm_v2():
    # v2: `x1_p.argmax(dim=-1)` over the sub-block: the first of equal maxima
    conf = torch.tensor([[INF, 0.5, 0.2, 0.5, 0.5], [0.3, INF, 0.3, 0.3, 0.1]]).double()
    ours = select_threshold(conf, 0.9, offset=7, width=40, first_max=True)
    assert ours.tolist() == [[False, True, False, False, False],
                             [True, False, False, False, False]]  # fmt: skip


def test_torch_cpu_topk_ranks_each_row_of_a_batch_as_that_row_alone():
    # what lets rows sharing a k be ranked in one call, and Dream's (B, L) call equal
    # LLaDA's per-row one: the tie order of a row does not depend on the other rows, nor on
    # the dtype while the same values tie
    x = torch.randint(0, 3, (6, 300), generator=gen(7)).double()
    x[torch.rand(x.shape, generator=gen(8)) < 0.3] = INF
    for k in (1, 2, 4, 9, 150, 299):
        batched = x.topk(k).indices
        for row in range(6):
            assert torch.equal(batched[row], x[row].topk(k).indices)
            assert torch.equal(batched[row], x[row].float().topk(k).indices)


def test_untied_rows_take_the_batched_path_and_equal_a_sort():
    # distinct values: any ranking gives the same set, whatever the canvas row
    conf = torch.rand(6, 16, generator=gen(3), dtype=torch.float64)
    conf[conf < 0.2] = INF
    k = torch.tensor([1, 3, 5, 2, 0, 4])
    expected = torch.zeros_like(conf, dtype=torch.bool)
    for row, kr in enumerate(k.tolist()):
        expected[row, conf[row].argsort(descending=True)[:kr]] = True
    assert torch.equal(select_top_k(conf, k, offset=11, width=60), expected)
    assert torch.equal(select_top_k(conf, k), expected)


# ------------------------------------------------------------- through `sample`


class NeighbourModel(nn.Module):
    """Logits from a position's own token and its two neighbours' tokens, by fixed tables of
    small integers: no position term, so positions with equal neighbourhoods get bit-equal
    logits and confidences (many ties), and what is committed changes the neighbours'
    proposals (so which of the tied positions goes first shows in the tokens). `boost` is
    added to the EOS and end-of-turn logits of every position."""

    def __init__(self, seed: int = 0, boost: float = 0.0):
        super().__init__()
        g = gen(seed)
        self.own, self.left, self.right = (
            torch.randint(-2, 3, (V, V), generator=g).float() for _ in range(3)
        )
        self.own[:, [EOS, EOT]] += boost

    def forward(self, input_ids, **kwargs):
        onehot = nn.functional.one_hot(input_ids, V).float()
        edge = torch.zeros_like(onehot[:, :1])
        left = torch.cat([edge, onehot[:, :-1]], 1)
        right = torch.cat([onehot[:, 1:], edge], 1)
        return onehot @ self.own + left @ self.left + right @ self.right


def llada_pick(confidence, quota, masks):
    """LLaDA: the row's quota by `torch.topk(confidence[j], k=num_transfer_tokens[j, i])`."""
    return torch.topk(confidence, k=quota).indices


def fast_dllm_threshold(threshold):
    def pick(confidence, quota, masks):  # get_transfer_index with a threshold
        values, select_index = torch.topk(confidence, k=masks)
        return torch.cat([select_index[:1], select_index[1:][values[1:] >= threshold]])

    return pick


def fast_dllm_factor(factor):
    def pick(confidence, quota, masks):  # get_transfer_index_dynamic
        ordered = torch.sort(confidence[confidence > INF], descending=True)[0].tolist()
        return torch.topk(confidence, k=fast_dllm_factor_count(ordered, factor)).indices

    return pick


@torch.no_grad()
def reference_decode(model, prompt, gen_length, block_length, steps, pick, *, quota=True,
                     temperature=0.0, generator=None, unconfident=(), eos_id=None,
                     model_kwargs=None):  # fmt: skip
    """LLaDA's `generate` (quota=True: steps / num_blocks steps a block) or Fast-dLLM's
    (quota=False: steps until the block has no mask), batched, written out: each step the
    logits of the whole canvas, x0 by Gumbel-argmax, x0_p = softmax(logits with the
    `unconfident` ids at -inf)[x0], x0_p[:, end:] = -inf, confidence = where(mask, x0_p,
    -inf), then per row `pick(confidence[j], quota, masks)`: the reference's topk on the
    whole canvas row. Where unmask documents a difference this follows unmask: the mask
    token is never proposed, the Gumbel noise is drawn for the block of the rows still
    decoding, from `generator` (log form), EOS and EoT both score 0 at every temperature, a
    row stops after a block holding EOS. Returns the canvas, the forward count and the
    values of the ties the reference decided (a position left out with the confidence of
    one it took)."""
    batch, p = prompt.shape
    x = torch.cat([prompt, torch.full((batch, gen_length), MASK_ID)], 1)
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    rows, nfe, ties = torch.arange(batch), 0, []
    for block in range(num_blocks):
        start, end = p + block * block_length, p + (block + 1) * block_length
        masks = (x[rows, start:end] == MASK_ID).sum(1).tolist()
        quotas = [[n // per_block + (i < n % per_block) for i in range(per_block)] for n in masks]
        i = 0
        while (x[rows, start:end] == MASK_ID).any() and (not quota or i < per_block):
            logits = model(x[rows], **(model_kwargs or {}))
            nfe += 1
            proposal = logits[:, start:end].clone()
            proposal[..., MASK_ID] = INF
            if temperature > 0:
                u = torch.rand(proposal.shape, generator=generator, dtype=torch.float64)
                u = u.clamp_min(torch.finfo(torch.float64).tiny)
                proposal = proposal.double() - temperature * torch.log(-torch.log(u))
            x0 = proposal.argmax(-1)
            scored = logits.clone()
            scored[..., list(unconfident)] = INF
            probs = torch.softmax(scored[:, start:end].double(), -1)
            x0_p = torch.full(x[rows].shape, 0.5, dtype=torch.float64)  # not masked: unread
            x0_p[:, start:end] = probs.gather(-1, x0[..., None]).squeeze(-1)
            x0_p[:, end:] = INF
            confidence = torch.where(x[rows] == MASK_ID, x0_p, INF)
            for j, row in enumerate(rows.tolist()):
                masked = int((x[row, start:end] == MASK_ID).sum())
                if masked == 0:
                    continue
                chosen = pick(confidence[j], quotas[j][i] if quota else None, masked)
                x[row, chosen] = x0[j, chosen - start]
                ties += decided_ties(confidence[j], chosen)
            i += 1
        if eos_id is not None and block < num_blocks - 1:
            rows = rows[~(x[rows, p:end] == eos_id).any(1)]
            if rows.numel() == 0:
                break
    return x, nfe, ties


def decided_ties(confidence: torch.Tensor, chosen: torch.Tensor) -> list[float]:
    """The confidences shared by a position taken and an allowed position left out."""
    left_out = torch.isfinite(confidence)
    left_out[chosen] = False
    return sorted(set(confidence[chosen].tolist()) & set(confidence[left_out].tolist()))


PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14], [2, 4, 6]]


def padded(rows=PROMPTS):
    return left_pad(rows, pad_id=PAD)


LLADA_CASES = [  # (gen_length, block_length, steps, temperature)
    (16, 4, 8, 0.0), (16, 8, 8, 0.0), (24, 12, 8, 0.0), (16, 16, 4, 0.0),
    (16, 4, 8, 0.7), (16, 8, 4, 0.7), (32, 16, 8, 0.7), (16, 4, 8, 1.0), (16, 16, 8, 1.0),
]  # fmt: skip


@pytest.mark.parametrize("gen_length,block_length,steps,temperature", LLADA_CASES)
def test_llada_quota_on_tied_confidences_equals_llada(gen_length, block_length, steps,
                                                      temperature):  # fmt: skip
    model = NeighbourModel(seed=1)
    ids, attention_mask = padded()
    kw = dict(gen_length=gen_length, block_length=block_length, steps=steps,
              temperature=temperature)  # fmt: skip
    out = sample(model, ids, SamplingConfig(**kw), mask_id=MASK_ID, generator=gen(4),
                 attention_mask=attention_mask)  # fmt: skip
    ref, nfe, ties = reference_decode(model, ids, gen_length, block_length, steps, llada_pick,
                                temperature=temperature, generator=gen(4))  # fmt: skip
    assert torch.equal(out.sequences, ref) and out.nfe == nfe
    assert ties  # the reference decided ties


@pytest.mark.parametrize("gen_length,block_length,steps,temperature", LLADA_CASES)
def test_confidence_eos_eot_inf_ties_equal_llada(gen_length, block_length, steps,
                                                 temperature):  # fmt: skip
    # several EOS / EoT proposals a block, all at confidence 0: the quota picks among them
    model = NeighbourModel(seed=1, boost=4.0)
    ids, attention_mask = padded()
    config = SamplingConfig(gen_length=gen_length, block_length=block_length, steps=steps,
                            temperature=temperature, confidence_eos_eot_inf=True,
                            history=True)  # fmt: skip
    out = sample(model, ids, config, mask_id=MASK_ID, eos_id=EOS, eot_id=EOT,
                 attention_mask=attention_mask, generator=gen(5))  # fmt: skip
    ref, nfe, ties = reference_decode(model, ids, gen_length, block_length, steps, llada_pick,
                                temperature=temperature, generator=gen(5),
                                unconfident=(EOS, EOT), eos_id=EOS)  # fmt: skip
    assert torch.equal(out.history[-1], ref) and out.nfe == nfe  # the canvas before EOS fill
    assert 0.0 in ties  # the reference chose among end proposals


@pytest.mark.parametrize("rule", ["threshold", "factor"])
@pytest.mark.parametrize("gen_length,block_length", [(16, 4), (16, 8), (24, 12), (16, 16)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_fast_dllm_rules_on_tied_confidences_equal_fast_dllm(rule, gen_length, block_length,
                                                             temperature):  # fmt: skip
    model = NeighbourModel(seed=4)
    ids, attention_mask = padded()
    value = 0.9 if rule == "threshold" else 1.0
    pick = fast_dllm_threshold(value) if rule == "threshold" else fast_dllm_factor(value)
    config = SamplingConfig(gen_length=gen_length, block_length=block_length,
                            temperature=temperature, **{rule: value})  # fmt: skip
    out = sample(model, ids, config, mask_id=MASK_ID, attention_mask=attention_mask,
                 generator=gen(6))  # fmt: skip
    ref, nfe, ties = reference_decode(model, ids, gen_length, block_length, gen_length, pick,
                                quota=False, temperature=temperature, generator=gen(6))  # fmt: skip
    assert torch.equal(out.sequences, ref) and out.nfe == nfe
    assert ties


def block_causal_tiny():
    return tiny_model(vocab_size=V, initializer_range=0.2).eval()


class EndBoost(nn.Module):
    """model with +boost on the EOS and EoT logits (keyword arguments passed through)."""

    def __init__(self, model, boost):
        super().__init__()
        self.model, self.boost = model, boost

    def forward(self, input_ids, **kwargs):
        logits = self.model(input_ids, **kwargs).clone()
        logits[..., [EOS, EOT]] += self.boost
        return logits


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("threshold", [None, 0.9])
def test_cached_decoding_ranks_ties_over_the_canvas_row_too(cache, threshold):
    # block-causal caches are exact, so every cache mode meets the same tied confidences
    # (EOS / EoT proposals at 0); each ranks them over the whole canvas row, as LLaDA and
    # Fast-dLLM without a cache do
    model = EndBoost(block_causal_tiny(), boost=3.0)
    prompt, gen_length, block_length = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), 16, 4
    blocks = canvas_blocks(prompt.shape[1], gen_length, block_length)
    allowed = (blocks[None, :] <= blocks[:, None])[None, None]
    pick = llada_pick if threshold is None else fast_dllm_threshold(threshold)
    ref, nfe, ties = reference_decode(model, prompt, gen_length, block_length, 8, pick,
                                quota=threshold is None, unconfident=(EOS, EOT), eos_id=EOS,
                                model_kwargs=dict(attention_mask=allowed))  # fmt: skip
    config = SamplingConfig(gen_length=gen_length, block_length=block_length, steps=8,
                            threshold=threshold, block_causal=True, cache=cache,
                            confidence_eos_eot_inf=True, history=True)  # fmt: skip
    out = sample(model, prompt, config, mask_id=MASK_ID, eos_id=EOS, eot_id=EOT)
    assert torch.equal(out.history[-1], ref) and out.nfe == nfe
    assert 0.0 in ties


@torch.no_grad()
def dream_decode(model, prompt, gen_length, steps, alg):
    """Dream's `_sample` (temperature 0, one block, the logit shift), batched, written out:
    full_confidence (B, L) -inf but at the masks, `torch.topk(full_confidence, k)` with one
    k for the batch (the count as unmask's `dream` schedule computes it; all rows hold as
    many masks). The mask token is never proposed (unmask). Returns the canvas and the ties
    decided (`decided_ties`)."""
    x = torch.cat([prompt, torch.full((prompt.shape[0], gen_length), MASK_ID)], 1)
    ties = []
    for i in range(steps):
        mask_index = x == MASK_ID
        logits = model(x).double()
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
        logits[..., MASK_ID] = INF
        probs = torch.softmax(logits[mask_index], -1)
        confidence, x0 = probs.max(-1)
        if alg == "topk_margin":
            top2 = torch.sort(probs, -1, descending=True)[0]
            confidence = top2[:, 0] - top2[:, 1]
        k = int(dream_transfer_count(mask_index.sum(1), i, steps)[0])
        full_confidence = torch.full(x.shape, INF, dtype=torch.float64)
        full_confidence[mask_index] = confidence
        if k > 0:
            _, transfer_index = torch.topk(full_confidence, k)
            x_ = torch.full_like(x, MASK_ID)
            x_[mask_index] = x0
            row_indices = torch.arange(x.shape[0])[:, None].expand_as(transfer_index)
            x[row_indices, transfer_index] = x_[row_indices, transfer_index]
            for row in range(x.shape[0]):
                ties += decided_ties(full_confidence[row], transfer_index[row])
    return x, ties


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin"])
@pytest.mark.parametrize("gen_length,steps", [(8, 4), (12, 6), (16, 8), (16, 16)])
def test_dream_quota_on_tied_confidences_equals_dream(alg, gen_length, steps):
    model = NeighbourModel(seed=4)
    prompt = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [3, 3, 3, 3, 3]])
    config = SamplingConfig(gen_length=gen_length, steps=steps, remasking=alg,
                            schedule="dream", shift_logits=True)  # fmt: skip
    out = sample(model, prompt, config, mask_id=MASK_ID)
    ref, ties = dream_decode(model, prompt, gen_length, steps, alg)
    assert torch.equal(out.sequences, ref) and ties


@torch.no_grad()
def dream_confidence_threshold(model, prompt, gen_length, steps, threshold):
    """Dream's `confidence_threshold` (Fast-dLLM's Dream code; batch 1, temperature 0, the
    logit shift), written out with its own call `torch.topk(full_confidence (1, L), n)`.
    Returns the canvas and the ties decided."""
    x = torch.cat([prompt, torch.full((1, gen_length), MASK_ID)], 1)
    per_step, left, i, ties = gen_length // steps, 0, 0, []
    while (x == MASK_ID).any():
        mask_index = x == MASK_ID
        logits = model(x).double()
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
        logits[..., MASK_ID] = INF
        confidence, x0 = torch.softmax(logits[mask_index], -1).max(-1)
        full_confidence = torch.full(x.shape, INF, dtype=torch.float64)
        full_confidence[mask_index] = confidence
        n = min((per_step if i < steps else 0) + left, int(mask_index.sum()))
        selected_confidence, select_index = torch.topk(full_confidence, n)
        take = [select_index[0, 0]] + [
            select_index[0, r] for r in range(1, n) if selected_confidence[0, r] >= threshold
        ]
        left = n - len(take)
        x_ = torch.full_like(x, MASK_ID)
        x_[mask_index] = x0
        for pos in take:
            x[0, pos] = x_[0, pos]
        ties += decided_ties(full_confidence[0], torch.stack(take))
        i += 1
    return x, ties


@pytest.mark.parametrize("threshold,steps", [(0.9, 4), (0.5, 2), (0.99, 8), (0.0, 4)])
def test_dream_confidence_threshold_on_tied_confidences_equals_dream(threshold, steps):
    model = NeighbourModel(seed=5)
    config = SamplingConfig(gen_length=16, steps=steps, remasking="confidence_threshold",
                            threshold=threshold, shift_logits=True)  # fmt: skip
    decided = []
    for prompt in ([[1, 2, 3, 4]], [[5, 5, 5]], [[9, 1, 9, 1, 9]]):
        prompt = torch.tensor(prompt)
        out = sample(model, prompt, config, mask_id=MASK_ID)
        ref, ties = dream_confidence_threshold(model, prompt, 16, steps, threshold)
        assert torch.equal(out.sequences, ref), prompt
        decided += ties
    assert decided
