"""Decoder `entropy_bound` (unmask/sampling/entropy_bound.py): DiffusionGemma's sampler,
against transformers 5.24's own `DiffusionGemmaForBlockDiffusion.generate` on a tiny random
model (`decisive_diffusion_gemma`: both layer types, dense MLP and experts, soft-capping).

What is compared, and how the draws are aligned: transformers draws from torch's global
generator, unmask's rows each from their own, seeded seed + row (`row_seeds`), in the same
order for one prompt; so transformers' `generate` after torch.manual_seed(S + r) is the
reference for row r. Compared: the answer tokens (transformers pads after EOS, unmask
writes EOS there, and unmask cuts the last canvas to gen_length: both mapped), the
decoder forwards of every canvas (the stopping decisions), over 22 prompts of 1 to 32
tokens, each alone and all in one left-padded batch, at three settings (transformers'
defaults but for fewer steps; a cold schedule where canvases stop by confidence alone;
one where they stop stable and confident), and a gen_length that is not whole canvases.
Logits are not bit-equal (unmask's own kernels, within 1e-5 of transformers'): a draw
that falls within that of a boundary would differ, and none does here. transformers'
batched `generate` counts a padded row's positions from the padded start (unmask: from the
row's first token) and draws across rows: it is compared where the draws do not matter
(one canvas, temperatures near 0, so every draw is the argmax) with the first canvas given.

Also: the schedule, the acceptance and the stopping rule by hand and against transformers'
classes; batch invariance; the options in one line each; implied for a diffusion_gemma
model and refused decoders both ways."""

import json

import pytest
import torch
from conftest import save_tiny_diffusion_gemma, save_tiny_model
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from unmask.checkpoint import load_for_sampling
from unmask.errors import InputError
from unmask.sampling import SamplingConfig, left_pad, sample
from unmask.sampling.config import resolve_sampling
from unmask.sampling.decoders import DECODERS, WholeDecoder, implied, register_decoder
from unmask.sampling.entropy_bound import (
    EntropyBound,
    StableAndConfident,
    entropy_bound_accept,
    entropy_bound_settings,
    row_seeds,
    schedule_temperature,
    token_entropy,
)
from unmask.sampling.generation_file import saved_sampling
from unmask.serve.engine import Engine, Job

pytestmark = pytest.mark.usefixtures("one_thread")

EOS, PAD, CANVAS = 1, 0, 8
PROMPTS = ["add 12+7=", "a", "rev 90417=", "sort 31=", "hello world", "xy", "copy abc=",
           "count 5=", "9", "the cat sat on the", "12345678901234", "b+c", "mul 3*4=", "q",
           "long prompt here with many chars", "zz", "max 3 9 1=", "min 4 2=", "dup ab=", "ok",
           "rev 1=", "sum 1 2 3 4 5 6 7 8 9 10 11 12"]  # fmt: skip
#: unmask option -> transformers generate keyword
THEIRS = {"max_denoising_steps": "max_denoising_steps", "temperature_start": "t_max",
          "temperature_end": "t_min", "stability_threshold": "stability_threshold",
          "confidence_threshold": "confidence_threshold"}  # fmt: skip
SETTINGS = {
    # transformers' defaults (bound 0.1, T 0.8 -> 0.4, stability 1, confidence 0.005)
    "defaults": dict(max_denoising_steps=8),
    # cold and confident: canvases stop by confidence alone, at different steps
    "confident": dict(max_denoising_steps=8, temperature_start=0.2, temperature_end=0.05,
                      entropy_bound=0.5, stability_threshold=0, confidence_threshold=0.2),
    # stable and confident: the argmax must repeat
    "stable": dict(max_denoising_steps=8, temperature_start=0.3, temperature_end=0.1,
                   confidence_threshold=0.3),
}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers' model, its folder with the char tokenizer)."""
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "model")


@pytest.fixture(scope="module")
def sm(saved):
    return load_for_sampling(saved[1], device="cpu")


def encode(sm, prompt: str) -> list[int]:
    return sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def transformers_keywords(options: dict) -> dict:
    kwargs = {THEIRS[k]: v for k, v in options.items() if k in THEIRS}
    if "entropy_bound" in options:
        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=options["entropy_bound"])
    return kwargs


@torch.no_grad()
def transformers_alone(hf, ids: list[int], seed: int, gen_length: int, options: dict):
    """transformers' generate for one prompt after torch.manual_seed(seed) -> (answer as
    unmask writes it: gen_length tokens, EOS after the first EOS; the decoder forwards of
    each canvas)."""
    calls: list[int] = []
    forward = hf.forward

    def counted(*args, **kwargs):
        calls.append(int(kwargs["decoder_position_ids"][0, 0]))  # the canvas's first position
        return forward(*args, **kwargs)

    hf.forward = counted
    try:
        torch.manual_seed(seed)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=gen_length, eos_token_id=EOS,
                          pad_token_id=PAD, **transformers_keywords(options))  # fmt: skip
    finally:
        hf.forward = forward
    answer = out.sequences[0, len(ids) :].tolist()[:gen_length]
    if EOS in answer:
        answer = answer[: answer.index(EOS) + 1]
    answer += [EOS] * (gen_length - len(answer))
    per_canvas = [calls.count(first) for first in sorted(set(calls))]
    return answer, per_canvas


class CanvasSteps:
    """Counts unmask's decoder forwards per canvas and row (wraps model.decode)."""

    def __init__(self, model):
        self.model, self.decode = model, model.decode
        self.counts: dict[int, int] = {}  # a canvas's first position -> forwards

    def __enter__(self):
        def counted(canvas, cache, *args, position_ids, **kwargs):
            for first in position_ids[:, 0].tolist():
                self.counts[first] = self.counts.get(first, 0) + 1
            return self.decode(canvas, cache, *args, position_ids=position_ids, **kwargs)

        self.model.decode = counted
        return self

    def __exit__(self, *exc):
        del self.model.decode


def unmask_run(sm, prompts: list[list[int]], seed: int, gen_length: int, options: dict):
    ids, valid = left_pad(prompts, PAD)
    config = SamplingConfig(gen_length=gen_length, uniform_canvas=True, **options)
    return sample(sm.model, ids, config, mask_id=sm.mask_id, eos_id=EOS, pad_id=PAD,
                  attention_mask=None if bool(valid.all()) else valid,
                  generator=torch.Generator().manual_seed(seed))  # fmt: skip


# ---------------------------------------------------------------- the parts, by hand


def test_the_temperature_schedule_is_transformers_linear_one():
    got = [float(schedule_temperature(n, 4, 0.8, 0.4)) for n in (4, 3, 2, 1)]
    assert got == pytest.approx([0.8, 0.7, 0.6, 0.5], abs=1e-7)  # never t_min itself
    processor = LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, max_denoising_steps=4)
    scores = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    for n in (4, 3, 2, 1):
        theirs = processor(None, scores, torch.tensor(n, dtype=torch.int32))
        assert torch.equal(scores / schedule_temperature(n, 4, 0.8, 0.4), theirs)


def test_entropy_bound_acceptance_by_hand():
    # sorted 0.05 0.2 0.5: sums before each 0, 0.05, 0.25 -> the 0.5 one is left out
    assert entropy_bound_accept(torch.tensor([0.5, 0.2, 0.05]), 0.1).tolist() == [False, True,
                                                                                   True]  # fmt: skip
    # the largest is taken when the others sum to within the bound: 0.01 + 0.02 + 0.05 <= 0.1
    assert entropy_bound_accept(torch.tensor([0.05, 0.3, 0.01, 0.02]), 0.1).all()
    # the lowest always, even above the bound
    assert entropy_bound_accept(torch.tensor([[3.0, 2.0, 4.0]]), 0.1).tolist() == [[False, True,
                                                                                    False]]  # fmt: skip
    assert entropy_bound_accept(torch.tensor([[3.0, 2.0, 4.0]]), 5.0).tolist() == [[True, True,
                                                                                    True]]  # fmt: skip


@pytest.mark.parametrize("bound", [0.1, 1.0, 6.0])
def test_acceptance_and_renoising_match_transformers_sampler(bound):
    g = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(3, 16, 40, generator=g)
    current = torch.randint(0, 40, (3, 16), generator=g)
    drawn = torch.randint(0, 40, (3, 16), generator=g)
    sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), 16, 40, 8)
    theirs = sampler.accept_canvas(current, drawn, logits, 8)
    accepted = entropy_bound_accept(token_entropy(logits), bound)
    assert torch.equal(accepted, sampler.accepted_token_mask)
    assert torch.equal(torch.where(accepted, drawn, current), theirs)
    assert 0 < int(accepted.sum()) < accepted.numel() or bound == 6.0


def test_stable_and_confident_by_hand():
    low = torch.full((1, 3), 0.001)  # mean entropy below 0.005
    high = torch.full((1, 3), 0.01)
    stop = StableAndConfident(rows=1, canvas_length=3, stability=1, confidence=0.005)
    rows = torch.tensor([0])
    a, b = torch.tensor([[4, 5, 6]]), torch.tensor([[4, 5, 7]])
    assert not stop(rows, a, low)  # nothing before: not stable
    assert stop(rows, a, low)  # the same argmax, confident
    assert not stop(rows, b, low)  # changed
    assert not stop(rows, b, high)  # stable, not confident
    two = StableAndConfident(rows=1, canvas_length=3, stability=2, confidence=0.005)
    assert [bool(two(rows, a, low)) for _ in range(3)] == [False, False, True]
    never = StableAndConfident(rows=1, canvas_length=3, stability=0, confidence=0.005)
    assert never(rows, a, low) and not never(rows, b, high)  # stability 0: always stable


@pytest.mark.parametrize("stability", [0, 1, 2])
def test_stopping_matches_transformers_criteria(stability):
    """A random walk of argmax canvases (often repeating) and entropies around the
    threshold: the rows stopping at every step equal transformers' criteria's."""
    g = torch.Generator().manual_seed(stability)
    theirs = StableAndConfidentStoppingCriteria(stability, 0.5)
    ours = StableAndConfident(4, 5, stability, 0.5)
    argmax = torch.randint(0, 3, (4, 5), generator=g)
    stops = 0
    for _ in range(30):
        change = torch.rand(4, 1, generator=g) < 0.4
        argmax = torch.where(change, torch.randint(0, 3, (4, 5), generator=g), argmax)
        logits = torch.randn(4, 5, 7, generator=g) * (6 * torch.rand(4, 1, 1, generator=g))
        expected = theirs(argmax, logits)
        got = ours(torch.arange(4), argmax, token_entropy(logits))
        assert torch.equal(got, expected)
        stops += int(got.sum())
    assert 0 < stops < 120


def test_row_seeds():
    assert row_seeds(torch.Generator().manual_seed(7), 3) == [7, 8, 9]  # unused: its seed
    shared = torch.Generator().manual_seed(7)
    assert row_seeds(shared, 2) + row_seeds(shared, 3) == [7, 8, 9, 10, 11]  # rows counted on
    torch.rand(1, generator=shared)  # drawn from by something else: a new base, drawn
    drawn = row_seeds(shared, 2)
    assert drawn[0] not in range(7, 12) and drawn[1] == drawn[0] + 1
    used = torch.Generator().manual_seed(7)
    torch.rand(1, generator=used)
    assert row_seeds(used, 1) != [7]
    assert row_seeds(torch.Generator().manual_seed(2**64 - 1), 2) == [2**64 - 1, 0]
    torch.manual_seed(3)
    one = row_seeds(None, 2)
    torch.manual_seed(3)
    assert row_seeds(None, 2) == one  # torch's global generator


# -------------------------------------------------------- equal to transformers' generate


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_prompt_alone_equals_transformers_generate(saved, sm, setting):
    """Tokens and per-canvas decoder forwards, prompt by prompt (seed 100 + i)."""
    hf, _ = saved
    options = SETTINGS[setting]
    ended, stopped = 0, 0
    for i, prompt in enumerate(PROMPTS):
        ids = encode(sm, prompt)
        expected, per_canvas = transformers_alone(hf, ids, 100 + i, 16, options)
        with CanvasSteps(sm.model) as steps:
            out = unmask_run(sm, [ids], 100 + i, 16, options)
        assert out.answers[0].tolist() == expected, (setting, prompt)
        assert [steps.counts[k] for k in sorted(steps.counts)] == per_canvas, (setting, prompt)
        assert out.nfe == out.steps == out.row_forwards == sum(per_canvas)
        ended += EOS in expected[:8]  # the first canvas held EOS: one canvas
        stopped += any(n < options["max_denoising_steps"] for n in per_canvas)
    # what the comparison saw: at the defaults (hot) rows ending at EOS after one canvas and
    # no early stop (never confident); colder, canvases stopping early
    if setting == "defaults":
        assert ended >= 3 and stopped == 0, (ended, stopped)
    else:
        assert stopped >= 15, stopped


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_batch_equals_transformers_generate_row_by_row(saved, sm, setting):
    """All 22 prompts (1 to 32 tokens) left-padded in one batch, seed 200: row r equals
    transformers alone after torch.manual_seed(200 + r), tokens and forwards (rows that
    stopped leave the decoder's batch)."""
    hf, _ = saved
    options = SETTINGS[setting]
    prompts = [encode(sm, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) >= 10
    out = unmask_run(sm, prompts, 200, 16, options)
    total = 0
    for row, ids in enumerate(prompts):
        expected, per_canvas = transformers_alone(hf, ids, 200 + row, 16, options)
        assert out.answers[row].tolist() == expected, (setting, row)
        total += sum(per_canvas)
    assert out.row_forwards == total  # each row's forwards are its own
    assert out.nfe < total  # rows decoded together


def test_a_length_that_is_not_whole_canvases(saved, sm):
    """gen_length 12 over canvases of 8: transformers returns both canvases (16 tokens),
    unmask their first 12."""
    hf, _ = saved
    options = SETTINGS["confident"]
    for i, prompt in enumerate(PROMPTS[:6]):
        ids = encode(sm, prompt)
        expected, _ = transformers_alone(hf, ids, 300 + i, 12, options)
        out = unmask_run(sm, [ids], 300 + i, 12, options)
        assert out.answers.shape == (1, 12) and out.answers[0].tolist() == expected[:12]


def test_transformers_batched_generate_with_left_padding(saved, sm):
    """transformers' own batch (left padding, its attention mask, positions from the padded
    start) where draws do not decide: one canvas, temperatures near 0 (every draw is the
    argmax, every token accepted), the first canvas given as unmask's rows draw it."""
    hf, _ = saved
    options = dict(max_denoising_steps=6, temperature_start=2e-5, temperature_end=1e-5)
    prompts = [encode(sm, p) for p in PROMPTS[:8]]
    out = unmask_run(sm, prompts, 400, CANVAS, options)
    ids, valid = left_pad(prompts, PAD)
    first = torch.cat([torch.randint(0, 128, (1, CANVAS),
                                     generator=torch.Generator().manual_seed(400 + r))
                       for r in range(len(prompts))])  # fmt: skip
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=valid, decoder_input_ids=first,
                             max_new_tokens=CANVAS, eos_token_id=EOS, pad_token_id=PAD,
                             **transformers_keywords(options)).sequences[:, ids.shape[1] :]  # fmt: skip
    theirs = torch.where((theirs == PAD) & (out.answers == EOS), EOS, theirs)  # pad after EOS
    assert torch.equal(out.answers, theirs)


# ------------------------------------------------------------------ rows, outputs, refusals


def test_a_rows_tokens_do_not_depend_on_the_other_rows(sm):
    options = SETTINGS["stable"]
    prompts = [encode(sm, p) for p in PROMPTS[:5]]
    together = unmask_run(sm, prompts, 9, 16, options)
    for row, ids in enumerate(prompts):
        alone = unmask_run(sm, [ids], 9 + row, 16, options)
        assert together.answers[row].tolist() == alone.answers[0].tolist(), row
    others = unmask_run(sm, [prompts[0], encode(sm, "other rows"), encode(sm, "z")], 9, 16,
                        options)  # fmt: skip
    assert others.answers[0].tolist() == together.answers[0].tolist()


def test_output_counts_and_history(sm):
    ids = [encode(sm, p) for p in PROMPTS[:3]]
    padded, valid = left_pad(ids, PAD)
    config = SamplingConfig(gen_length=16, uniform_canvas=True, history=True,
                            **SETTINGS["confident"])  # fmt: skip
    seen = []
    out = sample(sm.model, padded, config, mask_id=sm.mask_id, eos_id=EOS, pad_id=PAD,
                 attention_mask=valid, generator=torch.Generator().manual_seed(5),
                 on_step=seen.append)  # fmt: skip
    answers = out.answers.tolist()
    before = [a.index(EOS) if EOS in a else 16 for a in answers]
    assert out.tokens == sum(before)
    assert out.decoded == sum(min(n + 1, 16) for n in before)  # with the EOS, as transformers
    width = padded.shape[1]
    assert len(out.history) == len(seen) == out.steps
    assert out.history[0].shape == (3, width + 16)
    assert torch.equal(out.history[-1][:, :width], padded)
    for row, answer in enumerate(answers):  # after the first EOS, EOS
        assert all(t == EOS for t in answer[before[row] :])


def test_implied_for_a_diffusion_gemma_folder_and_model(saved, sm, tmp_path):
    assert saved_sampling(saved[1]) == {"uniform_canvas": True}
    assert implied(resolve_sampling(sm.saved)) == "entropy_bound"
    assert entropy_bound_settings(resolve_sampling(sm.saved)) == {
        "entropy_bound": 0.1, "max_denoising_steps": 48, "temperature_start": 0.8,
        "temperature_end": 0.4, "stability_threshold": 1, "confidence_threshold": 0.005,
    }  # transformers' defaults  # fmt: skip
    # a plain SamplingConfig: sample sees the model and decodes it with entropy_bound
    ids = torch.tensor([encode(sm, "add 1+2=")])
    plain = sample(sm.model, ids, SamplingConfig(gen_length=8), mask_id=sm.mask_id,
                   eos_id=EOS, generator=torch.Generator().manual_seed(1))  # fmt: skip
    marked = sample(sm.model, ids, SamplingConfig(gen_length=8, uniform_canvas=True),
                    mask_id=sm.mask_id, eos_id=EOS, generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert torch.equal(plain.sequences, marked.sequences) and plain.nfe == marked.nfe
    # transformers' generation settings in the folder's generation_config.json are its own
    folder = tmp_path / "with-generation-config"
    folder.mkdir()
    (folder / "config.json").write_text((saved[1] / "config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({
        "max_new_tokens": 64, "max_denoising_steps": 20, "t_max": 0.9, "t_min": 0.3,
        "stability_threshold": 2, "confidence_threshold": None,
        "sampler_config": {"entropy_bound": 0.25, "_cls_name": "EntropyBoundSamplerConfig"},
    }))  # fmt: skip
    assert saved_sampling(folder) == {"gen_length": 64, "max_denoising_steps": 20,
                                      "temperature_start": 0.9, "temperature_end": 0.3,
                                      "stability_threshold": 2, "entropy_bound": 0.25,
                                      "uniform_canvas": True}  # fmt: skip


def test_heldout_accuracy_decodes_it_with_its_own_seed(sm):
    """The trainer's held-out generation (eval.generate_accuracy) on DiffusionGemma:
    entropy_bound over each row's remaining length, rows seeded 0, 1, ... (one batch of one
    prompt length), torch's global generator untouched."""
    from types import SimpleNamespace

    from unmask.sampling.accuracy import decode_answer, heldout_accuracy

    examples = [("add 1+2=", "3"), ("rev 123=", "321"), ("sub 5-1=", "4")]
    settings = SimpleNamespace(max_examples=8, batch_size=8, steps_per_token=1.0,
                               sampling=SamplingConfig())  # fmt: skip
    state = torch.get_rng_state()
    accuracy, rows = heldout_accuracy(sm.model, sm.tokenizer, examples, settings, 20,
                                      torch.device("cpu"))  # fmt: skip
    assert torch.equal(torch.get_rng_state(), state)
    config = SamplingConfig(uniform_canvas=True, gen_length=12)
    for row, (prompt, answer) in enumerate(examples):
        ids = torch.tensor([encode(sm, prompt)])
        out = sample(sm.model, ids, config, mask_id=sm.mask_id, eos_id=EOS,
                     generator=torch.Generator().manual_seed(row))  # fmt: skip
        expected = decode_answer(sm.tokenizer, out.answers[0].tolist())
        assert rows[row] == (prompt, answer, expected)
    assert accuracy == sum(got == want for _, want, got in rows) / 3


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(decoder="masked"), "decoder 'masked' fills [MASK] tokens, and this model has none"),
        (dict(decoder="joint_threshold"), "decoder 'joint_threshold' fills [MASK] tokens"),
        (dict(block_length=4), "decoder entropy_bound takes no block_length"),
        (dict(temperature=0.7), "decoder entropy_bound takes no temperature (its temperature "
                                "follows temperature_start to temperature_end)"),
        (dict(steps=4), "decoder entropy_bound takes no steps"),
        (dict(cfg_scale=0.5), "decoder entropy_bound takes no cfg_scale"),
        (dict(gen_length="auto", block_length=4, gen_length_max=8),
         "decoder entropy_bound stops a row at the canvas holding EOS"),
        (dict(temperature_start=0.3, temperature_end=0.5), "temperature_start (0.3) must be "
                                                            "above temperature_end (0.5)"),
        (dict(temperature_end=0.8), "temperature_start (0.8) must be above temperature_end"),
        (dict(entropy_bound=0), "bad value for sampling option 'entropy_bound': must be > 0"),
        (dict(max_denoising_steps=0), "'max_denoising_steps': must be > 0"),
        (dict(stability_threshold=-1), "'stability_threshold': must be >= 0"),
        (dict(confidence_threshold=0.0), "'confidence_threshold': must be > 0"),
        (dict(uniform_canvas=False, decoder="masked", entropy_bound=0.2),
         "entropy_bound is an option of decoder entropy_bound (the decoder here is 'masked')"),
        (dict(uniform_canvas=False, max_denoising_steps=4), "max_denoising_steps is an option "
                                                            "of decoder entropy_bound"),
    ],
)  # fmt: skip
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(InputError) as err:
        resolve_sampling({"uniform_canvas": True, **options})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_decoders_are_refused_on_the_wrong_model(sm, tmp_path):
    ids = torch.tensor([encode(sm, "a")])
    with pytest.raises(InputError) as err:  # a masked decoder on DiffusionGemma
        sample(sm.model, ids, SamplingConfig(decoder="masked"), mask_id=sm.mask_id)
    assert "decoder 'masked' fills [MASK] tokens" in str(err.value)
    assert "\n" not in str(err.value)
    masked = load_for_sampling(save_tiny_model(tmp_path / "masked"), device="cpu")
    with pytest.raises(InputError) as err:  # entropy_bound on a masked-diffusion model
        sample(masked.model, ids, SamplingConfig(decoder="entropy_bound"),
               mask_id=masked.mask_id)  # fmt: skip
    assert str(err.value).startswith("decoder entropy_bound denoises the random-token canvases")
    assert "(qwen3_dllm) is not one" in str(err.value) and "\n" not in str(err.value)


def test_an_on_step_that_asks_gets_each_shown_tokens_probability(sm):
    """The playground's hover (issue 55): an on_step with `wants_probability` receives, with
    each step's canvas, the probability of every shown (argmax) token under that step's
    tempered distribution, computed here from the model's own logits; the tokens are the
    ones a plain on_step sees."""
    ids = [encode(sm, "probability please")]
    config = SamplingConfig(gen_length=CANVAS, uniform_canvas=True, **SETTINGS["stable"])
    plain: list[torch.Tensor] = []
    sample(sm.model, torch.tensor(ids), config, mask_id=sm.mask_id, eos_id=EOS, pad_id=PAD,
           generator=torch.Generator().manual_seed(3), on_step=plain.append)  # fmt: skip
    logits: list[torch.Tensor] = []
    decode = sm.model.decode

    def recording(*args, **kwargs):
        out = decode(*args, **kwargs)
        logits.append(out.float())
        return out

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_step(canvas, probability=None):
        seen.append((canvas, probability.clone()))

    on_step.wants_probability = True
    sm.model.decode = recording
    try:
        sample(sm.model, torch.tensor(ids), config, mask_id=sm.mask_id, eos_id=EOS,
               pad_id=PAD, generator=torch.Generator().manual_seed(3), on_step=on_step)  # fmt: skip
    finally:
        del sm.model.decode
    assert all(torch.equal(c, p) for (c, _), p in zip(seen, plain, strict=True))
    steps = config.max_denoising_steps
    for index, ((_, probability), step_logits) in enumerate(zip(seen, logits, strict=True)):
        t = schedule_temperature(steps - index, steps, config.temperature_start,
                                 config.temperature_end, step_logits.device)  # fmt: skip
        expected = torch.softmax(step_logits / t, dim=-1).amax(-1)
        torch.testing.assert_close(probability, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- served by canvas: the decoder's own


class ToyCanvas(EntropyBound):
    """A decoder served by canvas with its own per-canvas step: every token "x"."""

    token = 0  # set by the test: the char tokenizer's "x"

    @classmethod
    def serve_canvas(cls, model, cache, positions, generators, config, out, show=None,
                     probability=None):  # fmt: skip
        out.nfe += 1
        return torch.full(positions.shape, cls.token, device=positions.device)


@pytest.fixture
def toy_canvas(sm):
    ToyCanvas.token = encode(sm, "x")[0]
    register_decoder("toy_canvas", ToyCanvas)
    yield "toy_canvas"
    DECODERS.pop("toy_canvas")  # the registry is process-wide: leave it as it was


def test_a_decoder_served_by_canvas_runs_its_own_step(sm, toy_canvas):
    """The engine's canvas calls run the running decoder's serve_canvas, not
    entropy_bound's; a row ending on a stop string leaves the batch with its K/V."""
    events = []
    config = SamplingConfig(decoder=toy_canvas, gen_length=2 * CANVAS)
    job = Job(encode(sm, "add 12+7="), config, emit=events.append)
    engine = Engine(sm, start=False)
    assert job.by_canvas
    engine.run_canvas([job])
    assert job.answer == [ToyCanvas.token] * CANVAS and job.block == 1
    assert job.state is not None  # goes on to its next canvas
    engine.run_canvas([job])
    assert job.block == -1 and job.state is None
    assert events[-1]["text"] == "x" * 2 * CANVAS and events[-1]["finish_reason"] == "length"
    events.clear()
    stopped = Job(encode(sm, "a"), config, emit=events.append, stops=("xx",))
    engine.run_canvas([stopped])
    assert stopped.block == -1 and stopped.state is None  # ended on the stop string
    assert events[-1]["text"] == "" and events[-1]["finish_reason"] == "stop"


def test_serves_by_canvas_without_serve_canvas_is_refused():
    class Flagged(WholeDecoder):
        serves_by_canvas = True

    with pytest.raises(ValueError, match="declares serves_by_canvas but no serve_canvas"):
        register_decoder("flagged", Flagged)
    assert "flagged" not in DECODERS
