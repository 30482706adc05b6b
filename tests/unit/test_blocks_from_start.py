"""Fast-dLLM v2's form: unmask's `blocks_from_start` sampler against a reference loop
written here from the published behaviour of NVlabs/Fast-dLLM v2's `batch_sample`
(v2/generation_functions.py, use_block_cache off, greedy):

- num_blocks = max_new_tokens // block + P // block; blocks are counted from position 0;
- a prompt longer than a block: its whole blocks are read by one forward first, and when
  P is a multiple of the block that forward's last logits give the next token (argmax);
- each answer block starts as the tokens so far up to the block end, masks after them;
  while its sub-blocks (left to right) hold masks: one forward of the block over the
  earlier blocks' keys, logits shifted within the block (cat(l[:, :1], l[:, :-1])),
  greedy token and its softmax probability on masked positions (-inf elsewhere), commit
  probability > threshold plus the argmax position; a committed stop token ends the row;
- a block without masks: if every row has ended, stop; else one forward of the block
  (its keys kept) whose last logits' argmax is appended (the next block's first token).

The reference's forward of a block over the earlier blocks' cached keys is computed here
uncached (the rows up to the block's end under the staircase mask), which equals the
cached one (tests/unit/test_adaptation.py::test_block_causal_with_a_kv_cache_equals...).
"""

import pytest
import torch
from conftest import tiny_model

from unmask.diffusion.adaptation import block_causal_mask
from unmask.sampling import SamplingConfig
from unmask.sampling.generate import sample

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = 127


def v2_batch_sample(model, input_ids, block, max_new, small, threshold, stop_token):
    """(tokens, forward calls) of the reference loop (rows of one prompt length)."""
    forwards = 0

    def block_forward(x):  # logits of the last block of x over everything before it
        nonlocal forwards
        forwards += 1
        blocks = torch.arange(x.shape[1]) // block
        return model(x, attention_mask=block_causal_mask(blocks))[:, -block:]

    x = input_ids.clone()
    prompt = x.shape[1]
    num_blocks = max_new // block + prompt // block
    if prompt > block:
        forwards += 1
        cut = prompt // block * block
        logits = model(x[:, :cut], attention_mask=block_causal_mask(torch.arange(cut) // block))
        if prompt % block == 0:
            x = torch.cat([x, logits[:, -1:].argmax(-1)], dim=1)
    finished = torch.zeros(x.shape[0], dtype=torch.bool)
    for index in range(prompt // block, num_blocks):
        if finished.all():
            break
        fill = (index + 1) * block - x.shape[1]
        x = torch.cat([x, torch.full((x.shape[0], fill), MASK)], dim=1)
        while True:
            if not (x[:, -block:] == MASK).any():
                if finished.all():
                    break
                x = torch.cat([x, block_forward(x)[:, -1:].argmax(-1)], dim=1)
                break
            for sub in range(0, block, small):
                lo, hi = x.shape[1] - block + sub, x.shape[1] - block + sub + small
                while (x[:, lo:hi] == MASK).any():
                    logits = block_forward(x)
                    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)[:, sub : sub + small]
                    probs = torch.softmax(logits.double(), -1)
                    x1 = probs.argmax(-1)
                    p = probs.gather(-1, x1[..., None]).squeeze(-1)
                    masked = x[:, lo:hi] == MASK
                    p = torch.where(masked, p, -torch.inf)
                    commit = p > threshold
                    commit[torch.arange(x.shape[0]), p.argmax(-1)] = True
                    commit &= masked
                    x[:, lo:hi] = torch.where(commit, x1, x[:, lo:hi])
                    finished |= ((x1 == stop_token) & commit).any(-1)
    return x, forwards


@pytest.fixture(scope="module")
def model():
    return tiny_model(3, initializer_range=0.3).float().eval()


def _ours(model, ids, gen, block, small, threshold, eos=None):
    config = SamplingConfig(block_causal=True, shift_logits=True, blocks_from_start=True,
                            block_length=block, sub_block_length=small, threshold=threshold,
                            gen_length=gen)  # fmt: skip
    return sample(model, ids, config, mask_id=MASK, eos_id=eos)


@pytest.mark.parametrize(
    "prompt,block,small,max_new",
    [(5, 4, 2, 12), (3, 4, 2, 8), (8, 4, 4, 8), (10, 8, 4, 16)],
    ids=["tail-in-first-block", "prompt-inside-block-0", "prompt-on-boundary", "long-blocks"],
)
def test_tokens_and_forward_calls_equal_v2s_batch_sample(model, prompt, block, small, max_new):
    ids = torch.randint(3, 120, (2, prompt), generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        reference, ref_forwards = v2_batch_sample(model, ids, block, max_new, small, 0.04, -1)
    end = (max_new // block + prompt // block) * block
    out = _ours(model, ids, end - prompt, block, small, 0.04)
    assert torch.equal(out.sequences, reference[:, :end])
    # v2 also reads the last finished block once more, for a token past its canvas
    assert reference.shape[1] == end + 1
    assert out.nfe == ref_forwards - 1
    assert out.nfe < end - prompt  # parallel decoding took fewer forwards than tokens


def test_a_stop_token_ends_the_row_as_in_v2(model):
    ids = torch.randint(3, 120, (1, 6), generator=torch.Generator().manual_seed(11))
    free = _ours(model, ids, 18, 4, 2, 0.2)
    stop = int(free.sequences[0, 9])  # a token committed in the second answer block
    first = (free.sequences[0, 6:] == stop).nonzero()[0].item() + 6
    with torch.no_grad():
        reference, ref_forwards = v2_batch_sample(model, ids, 4, 20, 2, 0.2, stop)
    out = _ours(model, ids, 18, 4, 2, 0.2, eos=stop)
    assert torch.equal(out.sequences[0, : first + 1], reference[0, : first + 1])
    assert (out.sequences[0, first:] == stop).all()  # after the first stop: the stop token
    assert out.nfe == ref_forwards  # both stop after the block that holds it
    assert out.nfe < free.nfe


def test_blocks_from_start_needs_v2s_form():
    with pytest.raises(ValueError, match="needs block_causal and shift_logits"):
        SamplingConfig(blocks_from_start=True, block_length=4, threshold=0.5)
    with pytest.raises(ValueError, match="cannot use the logit shift"):
        SamplingConfig(block_causal=True, shift_logits=True, block_length=4)
