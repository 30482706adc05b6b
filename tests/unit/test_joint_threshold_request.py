"""Decoder `joint_threshold` with block_origin request: SGLang's JointThreshold with its
request layout (blocks counted from the request's first token, the prompt's tail sharing
the first decoded block with masks and never edited), token-, fill-, edit- and
forward-count-equal to a written-out copy on a tiny random llada2_moe model, for prompts
of any length, alone and batched."""

import pytest
import torch
from test_llada2_generate import prompts_of, spread_model
from torch import nn

from unmask.sampling import SamplingConfig, left_pad, sample

pytestmark = pytest.mark.usefixtures("one_thread")

V, MASK, PAD, EOS = 64, 63, 62, 10


@pytest.fixture(scope="module")
def model():
    """test_llada2_generate's: proposals that change with the context, probabilities
    spread from about 0.3 to 0.95 (fills by threshold, edits where an argmax changes)."""
    return spread_model()


class Request:
    """One request as SGLang lays it out (python/sglang/srt/dllm/mixin/req.py: the prompt's
    whole blocks are prefilled, then each decoded block is the next block_size tokens from
    the request's first token, the first holding the prompt's tail), on its own canvas of
    ceil((P + gen_length) / block_size) blocks; attention: the block and the ones before it
    (SGLang's K/V cache of the earlier blocks)."""

    def __init__(self, prompt: list[int], gen_length: int, block_size: int):
        self.length, self.block = len(prompt), block_size
        self.blocks = -(-(self.length + gen_length) // block_size) - self.length // block_size
        total = (self.length // block_size + self.blocks) * block_size
        self.x = torch.full((1, total), MASK, dtype=torch.long)
        self.x[0, : self.length] = torch.tensor(prompt)
        self.done = False

    def columns(self, k: int) -> tuple[int, int]:
        start = (self.length // self.block + k) * self.block
        return start, start + self.block

    def logits(self, model: nn.Module, k: int) -> torch.Tensor:
        start, end = self.columns(k)
        block_of = torch.arange(end) // self.block
        attention = (block_of[None, :] <= block_of[:, None])[None, None]
        out = model(self.x[:, :end], attention_mask=attention,
                    position_ids=torch.arange(end)[None])  # fmt: skip
        return out[0, start:end].clone()


@torch.no_grad()
def sglang_joint_threshold(model, prompts, gen_length, block_size, threshold=0.5,
                           edit_threshold=0.0, max_post_edit_steps=16, penalty_lambda=0.0,
                           eos_id=None):  # fmt: skip
    """SGLang's JointThreshold.run (sgl-project/sglang
    python/sglang/srt/dllm/algorithm/joint_threshold.py at commit
    cabd4543152087d411785114ef0b2d8db7bfd80e), written out for a batch of requests laid out
    as dllm/mixin/req.py lays them out (`Request`): the k-th decoded block of every request
    still running is run together (one forward of the batch per iteration, each request
    over its own canvas); a request ends after a block that holds EOS or at its last block.
    Returns (answers (gen_length tokens each, EOS after the first), forwards, fills, edits)."""
    requests = [Request(p, gen_length, block_size) for p in prompts]
    forwards = fills = edits = 0
    for k in range(max(r.blocks for r in requests)):
        batch = [r for r in requests if not r.done and k < r.blocks]
        if not batch:
            break
        blocks = [r.x[0, slice(*r.columns(k))] for r in batch]  # views: writes reach r.x
        prompt_masks = [b != MASK for b in blocks]
        post_edit_steps = [0] * len(batch)
        finished = [False] * len(batch)
        any_changed_in_last_step = False
        for _ in range(block_size + max_post_edit_steps):
            if all(finished):
                break
            all_logits = [r.logits(model, k) for r in batch]
            forwards += 1
            any_changed_in_last_step = False
            for i in range(len(batch)):
                if finished[i]:
                    continue
                curr_input_ids, curr_logits = blocks[i], all_logits[i]
                if penalty_lambda > 0:
                    prev_ids = curr_input_ids[:-1]
                    curr_logits[1:, :].scatter_(1, prev_ids.unsqueeze(-1), -penalty_lambda,
                                                reduce="add")  # fmt: skip
                xt = torch.argmax(curr_logits, dim=-1)
                p = torch.gather(torch.softmax(curr_logits, dim=-1), -1, xt[:, None]).squeeze(-1)
                mask_index = curr_input_ids == MASK
                mask_transfer_index = torch.zeros_like(mask_index)
                if mask_index.any():
                    confidence = torch.where(mask_index, p, float("-inf"))
                    mask_transfer_index = confidence > threshold
                    if not mask_transfer_index.any():
                        _, select_index = torch.topk(confidence, k=1)
                        mask_transfer_index[select_index] = True
                else:
                    post_edit_steps[i] += 1
                    if post_edit_steps[i] > max_post_edit_steps:
                        finished[i] = True
                        continue
                edit_mask = ~mask_index & ~prompt_masks[i]
                edit_transfer_index = (p > edit_threshold) & (curr_input_ids != xt) & edit_mask
                transfer_index = mask_transfer_index | edit_transfer_index
                if not transfer_index.any():
                    finished[i] = True
                    continue
                curr_input_ids[transfer_index] = xt[transfer_index]
                fills += int(mask_transfer_index.sum())
                edits += int(edit_transfer_index.sum())
                any_changed_in_last_step = True
        if any_changed_in_last_step:  # the forward that keeps the final block's K/V
            forwards += 1
        for r in batch:
            end = r.columns(k)[1]
            r.done = eos_id is not None and bool((r.x[0, r.length : end] == eos_id).any())
    answers = []
    for r in requests:
        answer = r.x[0, r.length : r.length + gen_length].tolist()
        if eos_id is not None and eos_id in answer:
            first = answer.index(eos_id)
            answer = answer[: first + 1] + [eos_id] * (gen_length - first - 1)
        answers.append(answer)
    return answers, forwards, fills, edits


def unmask_run(model, prompts, eos_id=None, **options):
    ids, attention = left_pad(prompts, PAD)
    config = SamplingConfig(decoder="joint_threshold", block_origin="request",
                            block_causal=True, **options)  # fmt: skip
    return sample(model, ids, config, mask_id=MASK, eos_id=eos_id,
                  attention_mask=None if bool(attention.all()) else attention)  # fmt: skip


ONE, TWO, THREE = [6], [13, 4], [5, 9, 2]
# (prompt lengths, gen_length, block_size, threshold, edit_threshold, max_post_edit_steps,
#  penalty_lambda, EOS given)
CASES = [
    (ONE, 8, 8, 0.5, 0.0, 16, 0.0, False),
    (ONE, 8, 4, 0.7, 0.5, 16, 0.0, False),
    (ONE, 16, 8, 0.5, 0.0, 0, 0.0, False),
    (ONE, 16, 4, 0.9, 0.0, 3, 0.0, False),
    (ONE, 16, 8, 0.3, 0.3, 1, 0.0, False),
    (ONE, 16, 8, 0.5, 0.0, 16, 3.0, False),  # the penalty reads the prompt's tail
    (ONE, 16, 8, 0.7, 0.5, 16, 3.0, True),
    (ONE, 8, 4, 1.0, 0.0, 2, 0.0, False),
    (ONE, 8, 8, 0.0, 0.0, 4, 0.0, True),
    (ONE, 40, 32, 0.6, 0.8, 16, 0.0, False),
    (ONE, 40, 32, 0.95, 0.4, 5, 1.0, True),
    ([37], 20, 32, 0.5, 0.0, 16, 0.0, False),  # a prompt longer than a block
    ([8], 16, 8, 0.5, 0.0, 16, 0.0, False),  # a prompt of one whole block
    ([3], 13, 4, 0.7, 0.5, 16, 2.0, True),
    (TWO, 16, 8, 0.5, 0.0, 16, 0.0, False),
    (TWO, 16, 8, 0.7, 0.5, 16, 0.0, True),
    (TWO, 20, 4, 0.9, 0.0, 3, 0.0, False),
    (TWO, 12, 8, 0.3, 0.3, 2, 3.0, True),
    (TWO, 40, 32, 0.5, 0.0, 16, 0.0, True),
    (THREE, 8, 8, 0.5, 0.0, 16, 0.0, False),
    (THREE, 8, 8, 0.7, 0.5, 16, 0.0, True),
    (THREE, 16, 8, 0.5, 0.0, 0, 0.0, False),
    (THREE, 16, 4, 0.9, 0.0, 3, 0.0, True),
    (THREE, 16, 8, 0.3, 0.3, 2, 0.0, False),
    (THREE, 16, 8, 0.5, 0.0, 16, 3.0, True),
    (THREE, 16, 8, 0.7, 0.5, 16, 2.0, False),
    (THREE, 8, 4, 1.0, 0.0, 1, 0.0, False),
    (THREE, 16, 32, 0.6, 0.1, 16, 0.0, True),
    (THREE, 30, 32, 0.95, 0.6, 6, 1.5, False),
    ([5, 9, 2, 16], 12, 4, 0.5, 0.0, 16, 0.0, True),
    ([33, 1], 24, 8, 0.8, 0.2, 3, 1.0, True),
    ([7], 24, 8, 0.4, 0.0, 16, 0.5, True),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_tokens_and_forwards_equal_sglangs_joint_threshold(model, case):
    lengths, gen, block, threshold, edit, post, penalty, eos = case
    eos_id = EOS if eos else None
    prompts = prompts_of(len(lengths) * 100 + gen + block, lengths)
    answers, forwards, fills, edits = sglang_joint_threshold(
        model, prompts, gen, block, threshold, edit, post, penalty, eos_id)  # fmt: skip
    out = unmask_run(model, prompts, eos_id, gen_length=gen, block_length=block,
                     threshold=threshold, edit_threshold=edit, max_post_edit_steps=post,
                     penalty_lambda=penalty)  # fmt: skip
    assert out.answers.tolist() == answers
    assert out.nfe == forwards
    assert (out.decoded, out.edits) == (fills, edits)


def test_the_cases_fill_edit_and_end(model):
    """The cases edit, and end answers at EOS inside the canvas."""
    edited = ended = 0
    for lengths, gen, block, threshold, edit, post, penalty, eos in CASES:
        prompts = prompts_of(len(lengths) * 100 + gen + block, lengths)
        answers, _, _, edits = sglang_joint_threshold(model, prompts, gen, block, threshold,
                                                      edit, post, penalty, EOS if eos else None)  # fmt: skip
        edited += edits > 0
        ended += sum(a[-1] == EOS and a.index(EOS) < gen - 1 for a in answers)
    assert edited >= 8
    assert ended >= 8


@pytest.mark.parametrize("edit_scope", [None, "all"])
def test_the_prompts_tail_is_never_edited(model, edit_scope):
    """Even at edit_threshold 0 (an edit wherever the argmax differs) every prompt token,
    the tail in the first decoded block too, stays as given on the canvas the model reads
    at every step."""
    prompts = prompts_of(5, [5, 9, 2])
    ids, attention = left_pad(prompts, PAD)
    seen = []

    def hook(step, x, logits):
        seen.append(x.clone())
        return logits

    config = SamplingConfig(decoder="joint_threshold", block_origin="request", block_causal=True,
                            gen_length=16, block_length=8, threshold=0.3, edit_threshold=0.0,
                            edit_scope=edit_scope, logits_hook=hook)  # fmt: skip
    out = sample(model, ids, config, mask_id=MASK, attention_mask=attention)
    assert out.edits > 0 and len(seen) == out.nfe
    for x in seen:
        for row, prompt in zip(x.tolist(), prompts):  # each prompt where it was laid out
            left = 8 - len(prompt) // 8 * 8  # the longest whole-block prefix is 8 tokens
            assert row[left : left + len(prompt)] == prompt


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("edit_scope", [None, "all"])
def test_caches_are_exact_on_the_request_grid(model, cache, edit_scope):
    """Block-causal on the request's grid: both caches give no cache's tokens, fills, edits
    and forwards (edit_scope all too: its earlier blocks are fed, never read stale)."""
    prompts = prompts_of(7, [5, 13, 2])
    options = dict(gen_length=20, block_length=8, threshold=0.6, edit_threshold=0.2,
                   max_post_edit_steps=3, penalty_lambda=1.0, edit_scope=edit_scope)  # fmt: skip
    plain = unmask_run(model, prompts, EOS, **options)
    cached = unmask_run(model, prompts, EOS, cache=cache, **options)
    assert cached.answers.tolist() == plain.answers.tolist()
    assert (cached.nfe, cached.decoded, cached.edits) == (plain.nfe, plain.decoded, plain.edits)
