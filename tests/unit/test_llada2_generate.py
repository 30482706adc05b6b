"""LLaDA2.0's own decoding, reproduced: the masked decoder with block_origin request,
fill_rule llada2, block_steps, block_causal and eos_early_stop gives the tokens and the
forward count of a written-out copy of LLaDA2.0's `generate` on a tiny random llada2_moe
model, for prompts of any length, alone and batched."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.sampling import SamplingConfig, left_pad, sample

pytestmark = pytest.mark.usefixtures("one_thread")

V, MASK, PAD, EOS = 64, 63, 62, 10
MOE = dict(model_type="llada2_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, num_shared_experts=1)  # fmt: skip


class NoMaskProposals(nn.Module):
    """The model with the mask token never predicted (a trained model's head; unmask never
    proposes it), so the copy below reads the probabilities unmask reads."""

    def __init__(self, model: nn.Module, mask_id: int = MASK):
        super().__init__()
        self.model, self.mask_id = model, mask_id

    def forward(self, input_ids, **kwargs):
        logits = self.model(input_ids, **kwargs)
        return logits.index_fill(-1, torch.tensor([self.mask_id]), -torch.inf)


def spread_model() -> nn.Module:
    """Weights drawn from N(0, 0.2) and a head scaled by 5: unlike the default initial
    weights (whose argmax is one token everywhere) the proposals change with the context
    and their probabilities spread from about 0.3 to 0.95, so thresholds select some
    positions and not others; EOS (token 10) ends many answers inside the canvas."""
    base = tiny_model(0, vocab_size=V, **MOE).eval()
    with torch.no_grad():
        for name, param in base.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
        base.lm_head.weight.mul_(5.0)
    return NoMaskProposals(base).eval()


@pytest.fixture(scope="module")
def model():
    return spread_model()


# ------------------------------------------------------- the published decoder, written out


@torch.no_grad()
def llada2_generate(model, prompt: list[int], *, gen_length: int, block_length: int = 32,
                    steps: int = 32, threshold: float = 0.95, eos_early_stop: bool = False,
                    minimal_topk: int = 1, eos_id: int | None = EOS,
                    mask_id: int = MASK, temperature: float = 0.0,
                    hub_first_release: bool = False):  # fmt: skip
    """LLaDA2.0's `LLaDA2MoeModelLM.generate` (with its `_get_num_transfer_tokens` and
    `_sample_with_temperature_topk_topp`, no top_k / top_p), transcribed from the hub file
    modeling_llada2_moe.py as vendored by dllm (lingjiechen2/dllm,
    dllm/pipelines/llada2/models/modeling_llada2_moe.py at commit
    8e1d3d7bc4405e9549edbaad6b15a278ddf46d17): one prompt, blocks counted from its first
    token, block-diagonal causal attention over the blocks so far. hub_first_release: draw
    with torch.multinomial at temperature 0 too, as the first LLaDA2.0 hub file does
    (inclusionAI/LLaDA2.X issue 6). Returns (its return value as a list: the answer up to
    and with the first EOS, else gen_length tokens; forwards per decoded block)."""
    steps = min(steps, gen_length // minimal_topk)
    length = len(prompt)
    num_blocks = (length + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    block_of = torch.arange(total) // block_length
    attention = (block_of[None, :] <= block_of[:, None])[None, None]
    positions = torch.arange(total)[None]
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[0, :length] = torch.tensor(prompt)
    schedule = [block_length // steps + (i < block_length % steps) for i in range(steps)]
    forwards = []
    for block in range(length // block_length, num_blocks):
        end = (block + 1) * block_length
        cur = x[:, :end]  # a view: writes reach x
        forwards.append(0)
        for step in range(steps):
            active = cur[:, -block_length:] == mask_id
            if active.sum() == 0:
                break
            logits = model(cur, attention_mask=attention[:, :, :end, :end],
                           position_ids=positions[:, :end])  # fmt: skip
            forwards[-1] += 1
            active_logits = logits[:, -block_length:]
            if temperature == 0.0 and not hub_first_release:  # the argmax (dllm's copy)
                probs = torch.softmax(active_logits, dim=-1)
                x0 = probs.argmax(-1)
            else:  # torch.multinomial (the first hub file: at temperature 0 too, untempered)
                if temperature not in (0.0, 1.0):
                    active_logits = active_logits / temperature
                probs = torch.softmax(active_logits.reshape(-1, active_logits.shape[-1]), -1)
                x0 = torch.multinomial(probs, num_samples=1).view(1, -1)
                probs = probs.view(1, block_length, -1)
            x0_p = probs.gather(-1, x0[..., None]).squeeze(-1)
            quota = schedule[step]
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            confidence = torch.where(active, x0_p, -torch.inf)
            high = confidence[0] > threshold
            if int(high.sum()) >= quota:
                transfer[0] = high
            else:
                _, idx = torch.topk(confidence[0], k=min(quota, int(active.sum())))
                transfer[0, idx] = True
            if transfer.any():
                cur[:, -block_length:][transfer] = x0[transfer]
            if eos_early_stop and (x0[transfer] == eos_id).any():
                found = (cur[0] == eos_id).nonzero(as_tuple=True)[0]
                if len(found) > 0:
                    eos_pos = int(found[0])
                    if bool((cur[0, length:eos_pos] != mask_id).all()):
                        return x[0, length : eos_pos + 1].tolist(), forwards
        if eos_id is not None and bool((x[0, length:end] == eos_id).any()):
            break
    answer = x[0, length : length + gen_length]
    if eos_id is None:
        return answer.tolist(), forwards
    found = (answer == eos_id).nonzero(as_tuple=True)[0]
    first = int(found[0]) if len(found) else gen_length
    return answer[: first + 1].tolist(), forwards


def released_folder(path, seed: int = 1):
    """A tiny llada2_moe folder as LLaDA2.0 releases it (config.json in its names, no
    unmask tag, mask_token_id given) with the char tokenizer; weights N(0, 0.2), a head
    scaled by 5 and its EOS row swapped with the row of a frequent proposal ('s'), so
    answers end after a few dozen tokens. Returns path."""
    import json

    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    built = tiny_model(seed, vocab_size=len(tokenizer), **MOE).eval()
    eos, frequent = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("s")
    with torch.no_grad():
        for name, param in built.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
        built.lm_head.weight.mul_(5.0)
        head = built.lm_head.weight
        head[[eos, frequent]] = head[[frequent, eos]]
    built.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    del config["unmask"]
    config["mask_token_id"] = tokenizer.mask_token_id
    (path / "config.json").write_text(json.dumps(config))
    return path


def official_text(sm, prompt: str, **arguments) -> str:
    """LLaDA2.0's generate (written out) on a folder's prompt, its answer as text before
    EOS (the mask token never proposed, as unmask never proposes it)."""
    ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    model = NoMaskProposals(sm.model, sm.mask_id)
    answer, _ = llada2_generate(model, ids, eos_id=sm.eos_id, mask_id=sm.mask_id, **arguments)
    assert len(answer) < 200  # ends well before the canvas: the tests stay fast
    tokens = answer[:-1] if answer and answer[-1] == sm.eos_id else answer
    return sm.tokenizer.decode(tokens, skip_special_tokens=True)


# ----------------------------------------------------------------------------- unmask


def llada2_config(gen_length, block_length=32, steps=32, threshold=0.95, eos_early_stop=False,
                  minimal_topk=1) -> SamplingConfig:  # fmt: skip
    """The unmask options that are LLaDA2's generate with these arguments."""
    return SamplingConfig(gen_length=gen_length, block_length=block_length, block_steps=steps,
                          threshold=threshold, fill_rule="llada2", block_origin="request",
                          block_causal=True, growing_canvas=True,
                          eos_early_stop=eos_early_stop, minimal_topk=minimal_topk)  # fmt: skip


def padded(answer: list[int], gen_length: int) -> list[int]:
    """LLaDA2's return value in unmask's form: EOS after the first EOS, to gen_length."""
    return answer + [EOS] * (gen_length - len(answer))


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts without EOS (LLaDA2's early stop would find an EOS in the prompt)."""
    g = torch.Generator().manual_seed(seed)
    draws = [torch.randint(0, PAD, (n,), generator=g) for n in lengths]
    return [torch.where(d == EOS, EOS + 1, d).tolist() for d in draws]


def unmask_run(model, prompts, config, eos_id=EOS):
    ids, attention = left_pad(prompts, PAD)
    return sample(model, ids, config, mask_id=MASK, eos_id=eos_id,
                  attention_mask=None if bool(attention.all()) else attention)  # fmt: skip


# (prompt length, gen_length, block_length, steps, threshold, eos_early_stop, EOS given:
#  LLaDA2 stops after a block holding EOS and returns the answer to its first EOS)
CASES = [
    (5, 16, 4, 4, 0.95, False, True),  # ends at EOS in the second block
    (5, 16, 4, 2, 0.5, False, False),
    (5, 16, 4, 8, 0.7, False, False),  # steps above the block
    (3, 20, 8, 8, 0.95, True, True),  # eos_early_stop saves a forward
    (3, 20, 8, 3, 0.6, False, True),  # quotas 3, 3, 2
    (3, 20, 8, 16, 0.4, True, True),
    (11, 13, 8, 4, 0.8, False, True),
    (13, 40, 32, 32, 0.95, False, True),  # LLaDA2's block and steps
    (13, 40, 32, 8, 0.9, True, True),
    (40, 30, 32, 5, 0.7, False, True),  # a prompt longer than a block
    (8, 16, 8, 8, 0.95, False, True),  # a prompt of one whole block
    (8, 16, 4, 1, 0.95, False, True),  # one step a block
    (1, 9, 4, 4, 1.0, False, True),  # no threshold ever cleared
    (6, 12, 4, 4, 0.0, True, True),  # every mask clears it
    (7, 24, 8, 4, 0.3, True, True),
    (5, 16, 4, 4, 0.95, False, False),  # without EOS: the whole canvas
    (5, 16, 4, 4, 0.95, True, True),
    (3, 20, 8, 3, 0.6, True, True),
    (3, 20, 8, 16, 0.4, False, True),
    (13, 40, 32, 32, 0.95, True, True),
    (13, 40, 32, 32, 0.95, False, False),
    (9, 24, 8, 2, 0.5, True, True),
    (9, 24, 8, 8, 0.8, False, True),
    (2, 30, 4, 6, 0.7, True, True),
    (2, 30, 4, 6, 0.7, False, False),
    (17, 16, 8, 4, 0.9, True, True),
    (4, 8, 4, 4, 0.95, True, True),  # a whole-block prompt, one answer block
    (21, 11, 32, 32, 0.95, True, True),  # the answer inside the prompt's block
    (21, 11, 32, 4, 0.5, False, False),
    (6, 10, 8, 20, 0.95, False, True),  # steps capped at gen_length
    (7, 24, 8, 4, 0.3, False, True),
    (1, 9, 4, 4, 1.0, True, True),
]  # fmt: skip


def eos_of(given: bool) -> int | None:
    return EOS if given else None


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_tokens_and_forwards_equal_llada2s_generate(model, case):
    length, gen, block, steps, threshold, early, eos = case
    prompt = prompts_of(length * 7 + gen, [length])[0]
    answer, forwards = llada2_generate(model, prompt, gen_length=gen, block_length=block,
                                       steps=steps, threshold=threshold, eos_early_stop=early,
                                       eos_id=eos_of(eos))  # fmt: skip
    config = llada2_config(gen, block, steps, threshold, early)
    out = unmask_run(model, [prompt], config, eos_id=eos_of(eos))
    assert out.answers[0].tolist() == padded(answer, gen)
    assert out.nfe == sum(forwards)


def test_the_cases_reach_what_they_test(model):
    """Answers that end at EOS inside the canvas, early stops that save forwards, steps that
    commit more than their quota and steps that commit fewer masks than are above it."""
    short = saved = parallel = 0
    for length, gen, block, steps, threshold, early, eos in CASES:
        prompt = prompts_of(length * 7 + gen, [length])[0]
        run = dict(gen_length=gen, block_length=block, steps=steps, threshold=threshold,
                   eos_id=eos_of(eos))  # fmt: skip
        answer, forwards = llada2_generate(model, prompt, eos_early_stop=early, **run)
        short += len(answer) < gen
        if early:
            saved += sum(forwards) < sum(llada2_generate(model, prompt, **run)[1])
        quota = -(-block // min(steps, gen))
        parallel += sum(forwards) < len(forwards) * block / quota
    assert short >= 8
    assert saved >= 2
    assert parallel >= 8


@pytest.mark.parametrize("lengths", [[5, 9, 2], [13, 3, 40], [8, 1]])
@pytest.mark.parametrize("early", [False, True])
def test_batched_rows_of_different_lengths_each_follow_their_grid(model, lengths, early):
    """Rows of different prompt lengths decoded together give each row's tokens alone, in
    as many forwards as the slowest row takes at each of its blocks."""
    gen, block, steps, threshold = 20, 8, 4, 0.8
    prompts = prompts_of(sum(lengths), lengths)
    alone = [llada2_generate(model, p, gen_length=gen, block_length=block, steps=steps,
                             threshold=threshold, eos_early_stop=early) for p in prompts]  # fmt: skip
    out = unmask_run(model, prompts, llada2_config(gen, block, steps, threshold, early))
    assert out.answers.tolist() == [padded(a, gen) for a, _ in alone]
    blocks = max(len(f) for _, f in alone)
    expected = sum(max(f[k] for _, f in alone if k < len(f)) for k in range(blocks))
    assert out.nfe == expected


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_caches_are_exact_on_the_request_grid(model, cache):
    """Block-causal attention on the request's grid: nothing before a block sees it, so both
    caches give the tokens and forwards of no cache, rows of different lengths batched."""
    prompts = prompts_of(11, [5, 9, 2, 16])
    config = llada2_config(20, 8, 4, 0.8).updated(growing_canvas=False)
    plain = unmask_run(model, prompts, config)
    cached = unmask_run(model, prompts, config.updated(cache=cache))
    assert cached.answers.tolist() == plain.answers.tolist()
    assert cached.nfe == plain.nfe


@pytest.mark.parametrize("decoder", [None, "joint_threshold"])
def test_guided_rows_decode_as_each_alone(model, decoder):
    """Classifier-free guidance on the request's grid (the prompt, its tail in the first
    block too, masked in the unconditional rows): a batch gives each row's tokens alone."""
    options = dict(gen_length=12, block_length=4, block_origin="request", block_causal=True,
                   cfg_scale=1.5, threshold=0.8)  # fmt: skip
    if decoder is None:
        options.update(fill_rule="llada2", block_steps=2)
    config = SamplingConfig(decoder=decoder, **options)
    prompts = prompts_of(4, [5, 9, 2])
    together = unmask_run(model, prompts, config, eos_id=None)
    for row, prompt in enumerate(prompts):
        alone = unmask_run(model, [prompt], config, eos_id=None)
        assert together.answers[row].tolist() == alone.answers[0].tolist()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(block_origin="request", steps=8), "give block_steps instead of steps"),
        (dict(block_origin="request", gen_length="auto", block_length=4, gen_length_max=8),
         "block_origin request needs a gen_length N"),
        (dict(block_origin="request", decoder="left_to_right"),
         "decoder 'left_to_right' does not decode by blocks"),
        (dict(block_origin="request", block_causal=True, shift_logits=True, block_length=4,
              threshold=0.9, blocks_from_start=True), "does not decode by blocks"),
        (dict(block_steps=4, uniform_canvas=True), "does not decode by blocks"),
        (dict(steps=8, block_steps=4), "not both"),
        (dict(fill_rule="llada2"), "give threshold"),
        (dict(fill_rule="llada2", threshold=0.9, remasking="entropy"), "leave remasking"),
        (dict(fill_rule="llada2", threshold=0.9, decoder="joint_threshold"),
         "fill_rule is an option of decoder masked"),
        (dict(eos_early_stop=True, decoder="joint_threshold"),
         "eos_early_stop is an option of decoder masked"),
        (dict(block_origin="start"), "unknown block_origin 'start'"),
        (dict(block_origin="request", shift_logits=True), "block_origin request has no logit"),
    ],
)  # fmt: skip
def test_bad_options_are_one_line_errors(options, message):
    from unmask.errors import InputError
    from unmask.sampling.config import resolve_sampling

    with pytest.raises(InputError, match=message) as err:
        resolve_sampling(options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("temperature", "hub", "eos", "seed"),
    [(0.0, True, True, 0), (0.0, True, False, 1), (1.0, False, True, 2), (0.7, False, True, 3),
     (1.5, False, False, 4), (0.7, False, False, 5)],
)  # fmt: skip
def test_multinomial_draws_are_llada2s_draws(model, temperature, hub, eos, seed):
    """multinomial_draws draws LLaDA2's tokens from the same seed: at temperature T > 0 as
    both LLaDA2 files draw, and at temperature 0 as the first LLaDA2.0 hub file draws
    (untempered multinomial, not the argmax)."""
    prompt = prompts_of(seed, [7])[0]
    arguments = dict(gen_length=20, block_length=8, steps=4, threshold=0.6)
    torch.manual_seed(seed)
    answer, forwards = llada2_generate(model, prompt, eos_id=eos_of(eos), temperature=temperature,
                                       hub_first_release=hub, **arguments)  # fmt: skip
    config = llada2_config(20, 8, 4, 0.6).updated(temperature=temperature,
                                                   multinomial_draws=True)  # fmt: skip
    torch.manual_seed(seed)
    out = unmask_run(model, [prompt], config, eos_id=eos_of(eos))
    assert out.answers[0].tolist() == padded(answer, 20)
    assert out.nfe == sum(forwards)
    greedy, _ = llada2_generate(model, prompt, eos_id=eos_of(eos), **arguments)
    assert answer != greedy  # the draws are not the argmax


@pytest.mark.parametrize(("gen", "steps", "minimal_topk"), [(12, 8, 3), (16, 32, 4), (9, 4, 9)])
def test_minimal_topk_caps_the_steps(model, gen, steps, minimal_topk):
    """LLaDA2's steps = min(steps, gen_length // minimal_topk), then quotas of the block."""
    prompt = prompts_of(gen + steps, [6])[0]
    answer, forwards = llada2_generate(model, prompt, gen_length=gen, block_length=8,
                                       steps=steps, threshold=0.9, minimal_topk=minimal_topk)  # fmt: skip
    config = llada2_config(gen, 8, steps, 0.9, minimal_topk=minimal_topk)
    out = unmask_run(model, [prompt], config)
    assert config.steps_per_block() == min(steps, gen // minimal_topk)
    assert out.answers[0].tolist() == padded(answer, gen)
    assert out.nfe == sum(forwards)
