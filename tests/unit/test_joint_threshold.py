"""Decoder `joint_threshold` (unmask/sampling/editing.py): LLaDA2.1's token-editing decoder
(M2T fills + T2T edits), token- and forward-count-equal to a written-out copy of SGLang's
`JointThreshold` on a tiny random llada2_moe model, batch invariant, its options checked in
one line, and reachable from `unmask generate`, `unmask eval`, the lm-eval adapter and
`unmask serve`."""

import asyncio
import io
import json

import httpx
import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.checkpoint import load_for_sampling
from unmask.cli import build_parser, main
from unmask.errors import InputError
from unmask.sampling import SamplingConfig, left_pad, sample
from unmask.sampling.config import resolve_sampling
from unmask.sampling.editing import joint_threshold_settings
from unmask.sampling.show import UNDERLINE, TerminalAnimation
from unmask.sampling.texts import before_eos, generate_texts

pytestmark = pytest.mark.usefixtures("one_thread")

V, MASK, PAD = 64, 63, 62
MOE = dict(model_type="llada2_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, num_shared_experts=1)  # fmt: skip
#: a random model's probabilities are near uniform (1/V): a scaled head spreads them from
#: about 0.3 to 0.9, so thresholds select and argmaxes change with the context (edits)
HEAD_SCALE = 30.0


class NoMaskProposals(nn.Module):
    """The model with the mask token's logit at -inf, as a trained model never predicts it
    (unmask never proposes it; SGLang's argmax could): the copy below then reads the same
    probabilities unmask reads."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, **kwargs):
        logits = self.model(input_ids, **kwargs)
        return logits.index_fill(-1, torch.tensor([MASK]), float("-inf"))


@pytest.fixture(scope="module")
def model():
    base = tiny_model(0, vocab_size=V, **MOE).eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(HEAD_SCALE)
    return NoMaskProposals(base).eval()


# ------------------------------------------------------- the published decoder, written out


@torch.no_grad()
def sglang_joint_threshold(model, prompts, gen_length, block_size, threshold=0.5,
                           edit_threshold=0.0, max_post_edit_steps=16, penalty_lambda=0.0,
                           num_to_transfer=1, block_causal=False, prefill=None):  # fmt: skip
    """SGLang's JointThreshold.run, transcribed from sgl-project/sglang
    python/sglang/srt/dllm/algorithm/joint_threshold.py at commit
    cabd4543152087d411785114ef0b2d8db7bfd80e: one run per block of unmask's canvas
    (left-padded prompts, then gen_length masks in blocks of block_size), every row's block
    in one forward of the whole canvas. The M2T floor is the official generate's
    (inclusionAI LLaDA2.1 modeling_llada2_moe.py `generate`: fewer than num_to_transfer
    masks above the threshold -> the top num_to_transfer); num_to_transfer=1 is SGLang's
    top-1, a list is a per-step schedule (the i-th step with masks of a row takes entry i,
    the last one after). prefill (B, G): answer tokens set before decoding (-1: a mask), which SGLang's
    prompt mask then keeps. Returns (answers (B, G), forwards, fills, edits)."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    total = width + gen_length
    x = torch.full((batch, total), MASK, dtype=torch.long)
    valid = torch.ones((batch, total), dtype=torch.bool)
    for i, p in enumerate(prompts):
        x[i, : width - len(p)] = PAD
        valid[i, : width - len(p)] = False
        x[i, width - len(p) : width] = torch.tensor(p)
    if prefill is not None:
        x[:, width:] = torch.where(prefill >= 0, prefill, MASK)
    kwargs, allowed = {}, None
    if not bool(valid.all()):  # padding: positions from each row's first token, kept apart
        kwargs["position_ids"] = (valid.long().cumsum(1) - 1).clamp_min(0)
        allowed = valid[:, :, None] == valid[:, None, :]
    if block_causal:  # a position sees its block and the ones before (prompt cut from its end)
        block_of = torch.div(torch.arange(total) - width, block_size, rounding_mode="floor")
        causal = (block_of[None, :] <= block_of[:, None])[None]
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        kwargs["attention_mask"] = allowed[:, None]
    forwards = fills = edits = 0
    for block_start in range(width, total, block_size):
        input_ids = x[:, block_start : block_start + block_size]  # a view: writes reach x
        prompt_masks = [input_ids[i] != MASK for i in range(batch)]
        post_edit_steps = [0] * batch
        denoise_steps = [0] * batch
        finished = [False] * batch
        any_changed_in_last_step = False
        for _ in range(block_size + max_post_edit_steps):
            if all(finished):
                break
            full_logits = model(x, **kwargs)[:, block_start : block_start + block_size].clone()
            forwards += 1
            any_changed_in_last_step = False
            for i in range(batch):
                if finished[i]:
                    continue
                curr_input_ids, curr_logits = input_ids[i], full_logits[i]
                curr_prompt_mask = prompt_masks[i]
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
                    quota = num_to_transfer
                    if isinstance(quota, list):
                        quota = quota[min(denoise_steps[i], len(quota) - 1)]
                    denoise_steps[i] += 1
                    if int(mask_transfer_index.sum()) < quota:
                        k = min(quota, int(mask_index.sum()))
                        _, select_index = torch.topk(confidence, k=k)
                        mask_transfer_index[select_index] = True
                else:
                    post_edit_steps[i] += 1
                    if post_edit_steps[i] > max_post_edit_steps:
                        finished[i] = True
                        continue
                edit_mask = ~mask_index & ~curr_prompt_mask
                edit_transfer_index = (p > edit_threshold) & (curr_input_ids != xt) & edit_mask
                transfer_index = mask_transfer_index | edit_transfer_index
                if not transfer_index.any():
                    finished[i] = True
                    continue
                curr_input_ids[transfer_index] = xt[transfer_index]
                fills += int(mask_transfer_index.sum())
                edits += int(edit_transfer_index.sum())
                any_changed_in_last_step = True
        if any_changed_in_last_step:  # SGLang's forward that keeps the final block's K/V
            model(x, **kwargs)
            forwards += 1
    return x[:, width:], forwards, fills, edits


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, PAD, (n,), generator=g).tolist() for n in lengths]


def unmask_run(model, prompts, eos_id=None, **options):
    ids, attention = left_pad(prompts, PAD)
    config = SamplingConfig(decoder="joint_threshold", **options)
    return sample(model, ids, config, mask_id=MASK, eos_id=eos_id,
                  attention_mask=None if bool(attention.all()) else attention)  # fmt: skip


def prefill_hook(prefill: torch.Tensor):
    """A tokens hook that sets answer tokens before the first step (Dream's infilling):
    prefill (B, G), -1 where the canvas keeps its mask."""

    def hook(step, x, logits):
        if step is None:
            x = x.clone()
            answer = x[:, x.shape[1] - prefill.shape[1] :]
            answer[prefill >= 0] = prefill[prefill >= 0]
        return x

    return hook


ONE, THREE = [6], [5, 9, 2]  # prompt lengths: one row; three rows, left-padded
# (prompt lengths, gen_length, block_length, steps (None: one a step), threshold,
#  edit_threshold, max_post_edit_steps, penalty_lambda, block_causal)
CASES = [
    (ONE, 8, 8, None, 0.5, 0.0, 16, 0.0, False),
    (ONE, 8, 8, None, 0.7, 0.5, 16, 0.0, False),
    (ONE, 16, 8, None, 0.5, 0.0, 0, 0.0, False),
    (ONE, 16, 4, None, 0.9, 0.0, 3, 0.0, False),
    (ONE, 16, 8, None, 0.3, 0.3, 1, 0.0, False),
    (ONE, 16, 8, None, 0.5, 0.0, 16, 3.0, False),
    (ONE, 16, 8, None, 0.7, 0.5, 16, 3.0, False),
    (ONE, 8, 4, None, 1.0, 0.0, 2, 0.0, False),
    (ONE, 8, 8, None, 0.0, 0.0, 4, 0.0, False),
    (ONE, 16, 16, None, 0.6, 0.8, 16, 0.0, False),
    (ONE, 16, 8, 4, 0.8, 0.0, 2, 0.0, False),
    (ONE, 16, 8, 8, 0.95, 0.4, 5, 1.0, False),
    (ONE, 12, 4, None, 0.5, 0.0, 16, 0.0, True),
    (ONE, 16, 8, None, 0.7, 0.5, 16, 0.0, True),
    (ONE, 16, 8, None, 0.5, 0.0, 3, 3.0, True),
    (ONE, 16, 4, 8, 0.9, 0.2, 1, 0.0, True),
    (THREE, 8, 8, None, 0.5, 0.0, 16, 0.0, False),
    (THREE, 8, 8, None, 0.7, 0.5, 16, 0.0, False),
    (THREE, 16, 8, None, 0.5, 0.0, 0, 0.0, False),
    (THREE, 16, 4, None, 0.9, 0.0, 3, 0.0, False),
    (THREE, 16, 8, None, 0.3, 0.3, 2, 0.0, False),
    (THREE, 16, 8, None, 0.5, 0.0, 16, 3.0, False),
    (THREE, 16, 8, None, 0.7, 0.5, 16, 2.0, False),
    (THREE, 8, 4, None, 1.0, 0.0, 1, 0.0, False),
    (THREE, 16, 16, None, 0.6, 0.1, 16, 0.0, False),
    (THREE, 16, 8, 4, 0.8, 0.0, 4, 0.0, False),
    (THREE, 16, 8, 8, 0.95, 0.6, 6, 1.5, False),
    (THREE, 12, 4, None, 0.5, 0.0, 16, 0.0, True),
    (THREE, 16, 8, None, 0.7, 0.5, 16, 0.0, True),
    (THREE, 16, 8, None, 0.5, 0.0, 2, 3.0, True),
    (THREE, 16, 4, 8, 0.9, 0.0, 1, 0.0, True),
    (THREE, 16, 8, 4, 0.4, 0.0, 16, 0.5, True),
    (ONE, 16, 8, 6, 0.8, 0.0, 2, 0.0, False),  # quotas 3, 3, 2
    (THREE, 20, 10, 8, 0.9, 0.2, 3, 1.0, True),  # quotas 3, 3, 2, 2
]  # fmt: skip


def _options(gen, block, steps, threshold, edit, post, penalty, causal) -> dict:
    return dict(gen_length=gen, block_length=block, steps=steps, threshold=threshold,
                edit_threshold=edit, max_post_edit_steps=post, penalty_lambda=penalty,
                block_causal=causal)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_tokens_and_forwards_equal_sglangs_joint_threshold(model, case):
    lengths, gen, block, steps, threshold, edit, post, penalty, causal = case
    prompts = prompts_of(len(lengths) * 100 + gen + block, lengths)
    per_block = block if steps is None else steps // (gen // block)
    quota = [block // per_block + (i < block % per_block) for i in range(per_block)]
    answers, forwards, fills, edits = sglang_joint_threshold(
        model, prompts, gen, block, threshold, edit, post, penalty, quota, causal)  # fmt: skip
    out = unmask_run(model, prompts, **_options(gen, block, steps, threshold, edit, post,
                                                penalty, causal))  # fmt: skip
    assert out.answers.tolist() == answers.tolist()
    assert out.nfe == forwards
    assert (out.decoded, out.edits) == (fills, edits)
    assert out.decoded == len(lengths) * gen  # every mask filled once
    assert out.row_forwards == len(lengths) * forwards


@pytest.mark.parametrize("lengths, block, causal", [(ONE, 8, False), (THREE, 4, True)])
def test_tokens_set_before_decoding_are_never_edited(model, lengths, block, causal):
    """Answer positions filled before a block starts (a tokens hook's infilling) are kept,
    as SGLang keeps a block's prompt positions: never edited, even at edit_threshold 0."""
    prompts = prompts_of(11, lengths)
    g = torch.Generator().manual_seed(5)
    prefill = torch.randint(0, PAD, (len(lengths), 16), generator=g)
    prefill[torch.rand(prefill.shape, generator=g) < 0.7] = -1
    answers, forwards, fills, edits = sglang_joint_threshold(
        model, prompts, 16, block, 0.6, 0.0, 4, 0.0, block_causal=causal, prefill=prefill
    )
    out = unmask_run(model, prompts, gen_length=16, block_length=block, threshold=0.6,
                     edit_threshold=0.0, max_post_edit_steps=4, block_causal=causal,
                     tokens_hook=prefill_hook(prefill))  # fmt: skip
    assert out.answers.tolist() == answers.tolist()
    assert (out.nfe, out.decoded, out.edits) == (forwards, fills, edits) and edits > 0
    kept = prefill >= 0
    assert torch.equal(out.answers[kept], prefill[kept])


def test_fills_and_edits_really_happen_in_the_cases(model):
    """The cases are not vacuous: parallel fills (fewer forwards than masks) and edits."""
    edited, parallel = 0, 0
    for lengths, gen, block, steps, threshold, edit, post, penalty, causal in CASES:
        prompts = prompts_of(len(lengths) * 100 + gen + block, lengths)
        out = unmask_run(model, prompts, **_options(gen, block, steps, threshold, edit, post,
                                                    penalty, causal))  # fmt: skip
        edited += out.edits > 0
        parallel += out.steps < gen  # some step filled more than one mask
    assert edited >= 15 and parallel >= 10, (edited, parallel)


def test_edit_threshold_zero_edits_wherever_the_argmax_differs(model):
    """edit_threshold 0 (speedy) edits more than a high one, and a block with edits alone
    runs its whole budget here: M + E + 1 forwards a block."""
    prompts = prompts_of(7, [6])
    low = unmask_run(model, prompts, gen_length=8, block_length=8, edit_threshold=0.0,
                     max_post_edit_steps=3)  # fmt: skip
    high = unmask_run(model, prompts, gen_length=8, block_length=8, edit_threshold=0.99,
                      max_post_edit_steps=3)  # fmt: skip
    assert low.edits > high.edits
    assert low.nfe == low.steps + 1 <= 8 + 3 + 1


# ----------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize(
    "options",
    [
        dict(gen_length=16, block_length=8),
        dict(gen_length=16, block_length=8, joint_preset="quality", penalty_lambda=3.0),
        dict(gen_length=16, block_length=4, block_causal=True, max_post_edit_steps=2),
        dict(gen_length=16, block_length=8, threshold=0.9, edit_threshold=0.3, steps=8),
        dict(gen_length=16, block_length=4, eos_id=27, cache="prefix", block_causal=True),
        dict(gen_length=16, block_length=4, eos_id=1, cfg_scale=0.5, max_post_edit_steps=1),
    ],
)
def test_a_rows_tokens_do_not_depend_on_the_other_rows(model, options):
    prompts = prompts_of(3, [5, 9, 2, 7])
    together = unmask_run(model, prompts, **options)
    for row, prompt in enumerate(prompts):
        alone = unmask_run(model, [prompt], **options)
        assert together.answers[row].tolist() == alone.answers[0].tolist(), row
    if "eos_id" in options:  # a row that ended early left the batch (it stops at EOS)
        assert (together.answers[:, :12] == options["eos_id"]).any()


def test_presets_and_explicit_options():
    speedy = joint_threshold_settings(resolve_sampling({"decoder": "joint_threshold"}))
    assert speedy == {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16,
                      "penalty_lambda": 0.0}  # SGLang's defaults  # fmt: skip
    quality = resolve_sampling({"decoder": "joint_threshold", "joint_preset": "quality"})
    assert joint_threshold_settings(quality)["threshold"] == 0.7
    assert joint_threshold_settings(quality)["edit_threshold"] == 0.5
    given = resolve_sampling({"decoder": "joint_threshold", "joint_preset": "quality",
                              "threshold": 0.9, "max_post_edit_steps": 2})  # fmt: skip
    assert joint_threshold_settings(given) == {"threshold": 0.9, "edit_threshold": 0.5,
                                               "max_post_edit_steps": 2,
                                               "penalty_lambda": 0.0}  # fmt: skip


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(edit_threshold=1.5), "bad value for sampling option 'edit_threshold': must be <= 1"),
        (dict(edit_threshold=-0.1), "'edit_threshold': must be >= 0"),
        (dict(max_post_edit_steps=-1), "'max_post_edit_steps': must be >= 0"),
        (dict(penalty_lambda=-3.0), "'penalty_lambda': must be >= 0"),
        (dict(joint_preset="fast"), "unknown joint_preset 'fast'; expected one of "
                                     "['speedy', 'quality']"),
        (dict(threshold=1.2), "decoder joint_threshold: threshold is a probability"),
        (dict(remasking="entropy"), "decoder joint_threshold takes no remasking"),
        (dict(factor=1.0), "decoder joint_threshold takes no factor"),
        (dict(sub_block_length=2, threshold=0.5), "takes no sub_block_length"),
        (dict(confidence_eos_eot_inf=True), "takes no confidence_eos_eot_inf"),
        (dict(decoder="masked", edit_threshold=0.5),
         "edit_threshold is an option of decoder joint_threshold (the decoder here is 'masked')"),
        (dict(decoder=None, joint_preset="quality"), "joint_preset is an option of decoder "
                                                     "joint_threshold"),
    ],
)  # fmt: skip
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(InputError) as err:
        resolve_sampling({"decoder": "joint_threshold", **options})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_eval_takes_the_flags():
    parser = build_parser()
    ns = parser.parse_args(["eval", "--model", "m", "--tasks", "t", "--decoder",
                            "joint_threshold", "--joint-preset", "quality", "--edit-threshold",
                            "0.2", "--max-post-edit-steps", "4", "--penalty-lambda", "3"])  # fmt: skip
    given = (ns.joint_preset, ns.edit_threshold, ns.max_post_edit_steps, ns.penalty_lambda)
    assert given == ("quality", 0.2, 4, 3.0)
    assert ns.preset is None  # eval's own --preset (base / instruct) is another flag


# ------------------------------------------------------- generate, show, lm-eval and serve


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llada2_moe model folder (scaled head, so it edits) with the char tokenizer."""
    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    built = tiny_model(1, vocab_size=max(128, len(tokenizer)), **MOE)
    with torch.no_grad():
        built.lm_head.weight.mul_(HEAD_SCALE)
    path = tmp_path_factory.mktemp("joint") / "model"
    built.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def sm(folder):
    return load_for_sampling(folder, device="cpu")


PROMPTS = ["rev 90417=", "a", "sort 31=", "add 12+7="]
FLAGS = ["--gen-length", "8", "--block-length", "4", "--decoder", "joint_threshold",
         "--edit-threshold", "0", "--max-post-edit-steps", "3", "--penalty-lambda", "1"]  # fmt: skip
OPTIONS = dict(gen_length=8, block_length=4, decoder="joint_threshold", edit_threshold=0.0,
               max_post_edit_steps=3, penalty_lambda=1.0)  # fmt: skip


def alone(sm, prompt: str, **options) -> tuple[str, object]:
    ids = torch.tensor([sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = sample(sm.model, ids, SamplingConfig(**options), mask_id=sm.mask_id, eos_id=sm.eos_id,
                 pad_id=sm.pad_id)  # fmt: skip
    return sm.tokenizer.decode(before_eos(out.answers[0].tolist(), sm.eos_id)), out


def test_unmask_generate_decodes_with_it(folder, sm, tmp_path, capsys):
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert main(["generate", "--model", str(folder), "--prompts", str(src), "--out", str(dst),
                 "--show", "--show-delay", "0", *FLAGS]) == 0  # fmt: skip
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    outs = [alone(sm, p, **OPTIONS) for p in PROMPTS]
    assert [r["completion"] for r in records] == [text for text, _ in outs]  # batch of 4
    edits = sum(out.edits for _, out in outs)
    assert edits > 0
    steps = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert steps[-1].endswith(f", {edits} so far)")  # --show counts the edits


def test_the_command_line_refuses_bad_values_in_one_line(folder, capsys):
    base = ["generate", "--model", str(folder), "--prompt", "a"]
    assert main([*base, "--decoder", "joint_threshold", "--joint-preset", "fast"]) == 2
    assert main([*base, "--edit-threshold", "0.5"]) == 2  # the decoder is masked
    assert main([*base, "--decoder", "joint_threshold", "--edit-threshold", "2"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 3, err
    assert "invalid choice: 'fast'" in err[0]
    assert "edit_threshold is an option of decoder joint_threshold" in err[1]
    assert "bad value for sampling option 'edit_threshold': must be <= 1 (got 2.0)" in err[2]


def test_show_counts_the_edits(sm):
    stream = io.StringIO()
    show = TerminalAnimation(sm.tokenizer, sm.mask_id, sm.pad_id, sm.eos_id, stream=stream)
    texts = generate_texts(sm, PROMPTS, SamplingConfig(**OPTIONS), 4, None, show)
    assert len(texts) == len(PROMPTS)
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("step ")]
    edits = [out.edits for _, out in (alone(sm, p, **OPTIONS) for p in PROMPTS)]
    assert lines[-1].endswith(" so far)") and f"{sum(edits)} so far" in lines[-1]
    assert "\x1b[" not in stream.getvalue()  # not a terminal: plain lines

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    show = TerminalAnimation(sm.tokenizer, sm.mask_id, sm.pad_id, sm.eos_id, stream=terminal,
                             delay=0.0)  # fmt: skip
    generate_texts(sm, PROMPTS, SamplingConfig(**OPTIONS), 4, None, show)
    assert UNDERLINE in terminal.getvalue()  # on a terminal the edited tokens are underlined


def test_lm_eval_model_args_take_it(folder):
    pytest.importorskip("lm_eval")
    from unmask.eval.harness import UnmaskLM

    lm = UnmaskLM.create_from_arg_string(
        f"pretrained={folder},decoder=joint_threshold,joint_preset=quality,penalty_lambda=3"
    )
    assert lm.options.decoder == "joint_threshold" and lm.options.joint_preset == "quality"
    assert lm.options.penalty_lambda == 3.0


def test_the_engine_batches_it_as_each_prompt_alone(sm):
    """The server's block calls, rows joining at different blocks of different answers,
    decode what `sample` decodes for each prompt alone."""
    from unmask.serve.engine import Engine, Job

    engine = Engine(sm, start=False)
    lengths = [8, 4, 12, 8]
    events = {i: [] for i in range(len(PROMPTS))}
    jobs = []
    for i, (prompt, length) in enumerate(zip(PROMPTS, lengths)):
        config = SamplingConfig(**{**OPTIONS, "gen_length": length})
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        jobs.append(Job(ids, config, emit=events[i].append))
    assert len({job.group for job in jobs}) == 1
    active, call, mixed = [], 0, False
    while call == 0 or active:
        active += [job for job, at in zip(jobs, [0, 0, 1, 2]) if at == call]
        mixed |= len({job.block for job in active}) > 1
        engine.run_block(active)
        active = [job for job in active if job.block >= 0]
        call += 1
    assert mixed
    for i, (prompt, length) in enumerate(zip(PROMPTS, lengths)):
        expected, _ = alone(sm, prompt, **{**OPTIONS, "gen_length": length})
        assert events[i][-1]["type"] == "done" and events[i][-1]["text"] == expected, i


def served_equals(sm, prompt: str, unmask: dict, expected: str, bad: tuple[str, str]) -> None:
    """A completions request to the server's app (in this process) with `unmask` options
    answers `expected`; the same request with option bad[0] set to bad[1] gets a 400 naming
    it."""
    from unmask.serve.app import Server, build_app
    from unmask.serve.engine import Engine

    engine = Engine(sm)
    app = build_app(Server(sm, engine, "tiny"))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "unmask": dict(unmask)}

    async def ask(payload):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.post("/v1/completions", json=payload, timeout=120)

    try:
        reply = asyncio.run(ask(body))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
        body["unmask"][bad[0]] = bad[1]
        refused = asyncio.run(ask(body))
        assert refused.status_code == 400 and f"unknown {bad[0]} '{bad[1]}'" in refused.text
    finally:
        engine.close()


def test_a_served_request_gives_generates_tokens(folder, sm, tmp_path):
    """A completions request to the server's app (in this process) with the options under
    "unmask" answers what `unmask generate` answers."""
    dst = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(folder), "--prompt", PROMPTS[0], "--out", str(dst),
                 *FLAGS]) == 0  # fmt: skip
    expected = json.loads(dst.read_text())["completion"]
    unmask = {"block_length": 4, "decoder": "joint_threshold", "edit_threshold": 0,
              "max_post_edit_steps": 3, "penalty_lambda": 1}  # fmt: skip
    served_equals(sm, PROMPTS[0], unmask, expected, ("joint_preset", "fast"))


# ------------------------------------ edit_scope all: the report's multi-block editing (MBE)


@torch.no_grad()
def multi_block_editing(model, prompts, gen_length, block_size, threshold, edit_threshold,
                        max_post_edit_steps, penalty_lambda, quotas, block_causal):  # fmt: skip
    """The joint threshold decoder with edits over every answer block so far, written from
    the definition (docs/sampling.md): a plain loop, one forward of the whole canvas a step,
    no cache, row by row. Each step of block k, for each row not done: proposals x0 and
    their probabilities p at the answer positions of blocks 0..k (the penalty lowers, at
    each position but a block's first, the logit of the token before it); the masks of
    block k above threshold are filled, at least the step's quota of the most probable
    (quotas[step], the last after); with no mask left in block k the step counts a post-edit
    step, and the row is done once it has more than max_post_edit_steps; every answer token
    of blocks 0..k (not a mask) whose x0 differs and p > edit_threshold is replaced; a step
    that changes nothing ends the row. Returns (answers (B, G), forwards, fills, edits)."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    total = width + gen_length
    x = torch.full((batch, total), MASK, dtype=torch.long)
    valid = torch.ones((batch, total), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        x[row, : width - len(prompt)] = PAD
        valid[row, : width - len(prompt)] = False
        x[row, width - len(prompt) : width] = torch.tensor(prompt)
    kwargs, allowed = {}, None
    if not bool(valid.all()):
        kwargs["position_ids"] = (valid.long().cumsum(1) - 1).clamp_min(0)
        allowed = valid[:, :, None] == valid[:, None, :]
    if block_causal:
        block_of = torch.div(torch.arange(total) - width, block_size, rounding_mode="floor")
        causal = (block_of[None, :] <= block_of[:, None])[None]
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        kwargs["attention_mask"] = allowed[:, None]
    forwards = fills = edits = 0
    for end in range(width + block_size, total + 1, block_size):
        begin = end - block_size  # the current block: [begin, end); edits reach [width, end)
        post = [0] * batch
        done = [False] * batch
        for step in range(block_size + max_post_edit_steps + 1):
            if all(done):
                break
            logits = model(x, **kwargs).double()
            forwards += 1
            for row in range(batch):
                if done[row]:
                    continue
                scores = logits[row, width:end].clone()  # (end - width, V)
                for j in range(width + 1, end):
                    if (j - width) % block_size:
                        scores[j - width, x[row, j - 1]] -= penalty_lambda
                probs = torch.softmax(scores, dim=-1)
                p, x0 = probs.max(dim=-1)
                masked = [j for j in range(begin, end) if x[row, j] == MASK]
                chosen = []
                if masked:
                    chosen = [j for j in masked if p[j - width] > threshold]
                    quota = min(quotas[min(step, len(quotas) - 1)], len(masked))
                    if len(chosen) < quota:
                        ranked = sorted(masked, key=lambda j: -float(p[j - width]))
                        chosen = sorted(set(chosen) | set(ranked[:quota]))
                else:
                    post[row] += 1
                    if post[row] > max_post_edit_steps:
                        done[row] = True
                        continue
                replaced = [j for j in range(width, end)
                            if x[row, j] != MASK and x0[j - width] != x[row, j]
                            and p[j - width] > edit_threshold]  # fmt: skip
                if not chosen and not replaced:
                    done[row] = True
                    continue
                for j in chosen + replaced:
                    x[row, j] = x0[j - width]
                fills += len(chosen)
                edits += len(replaced)
    return x[:, width:], forwards, fills, edits


# (prompt lengths, gen_length, block_length, steps, threshold, edit_threshold,
#  max_post_edit_steps, penalty_lambda, block_causal)
MBE_CASES = [
    (ONE, 16, 8, None, 0.5, 0.0, 16, 0.0, False),
    (ONE, 16, 4, None, 0.7, 0.5, 16, 0.0, False),
    (ONE, 12, 4, None, 0.5, 0.0, 3, 3.0, False),
    (ONE, 16, 4, 8, 0.9, 0.2, 2, 0.0, True),
    (ONE, 16, 8, None, 0.3, 0.3, 1, 1.0, True),
    (THREE, 16, 8, None, 0.5, 0.0, 16, 0.0, False),
    (THREE, 16, 4, None, 0.7, 0.5, 4, 2.0, False),
    (THREE, 12, 4, None, 0.5, 0.0, 16, 0.0, True),
    (THREE, 16, 8, 4, 0.8, 0.0, 3, 0.0, True),
    (THREE, 20, 10, 8, 0.9, 0.2, 3, 1.0, True),
]  # fmt: skip


def _quotas(gen, block, steps) -> list[int]:
    per_block = block if steps is None else steps // (gen // block)
    return [block // per_block + (i < block % per_block) for i in range(per_block)]


@pytest.mark.parametrize("case", MBE_CASES, ids=[f"mbe{i}" for i in range(len(MBE_CASES))])
def test_edit_scope_all_equals_the_definition_written_out(model, case):
    lengths, gen, block, steps, threshold, edit, post, penalty, causal = case
    prompts = prompts_of(len(lengths) * 100 + gen + block, lengths)
    answers, forwards, fills, edits = multi_block_editing(
        model, prompts, gen, block, threshold, edit, post, penalty, _quotas(gen, block, steps),
        causal)  # fmt: skip
    options = _options(gen, block, steps, threshold, edit, post, penalty, causal)
    out = unmask_run(model, prompts, edit_scope="all", **options)
    assert out.answers.tolist() == answers.tolist()
    assert (out.nfe, out.decoded, out.edits) == (forwards, fills, edits)
    assert out.decoded == len(lengths) * gen
    if causal:  # block-causal: the prompt's K/V do not depend on the answer, caches are exact
        for cache in ("prefix", "dual"):
            cached = unmask_run(model, prompts, edit_scope="all", cache=cache, **options)
            assert cached.answers.tolist() == answers.tolist(), cache
            assert (cached.nfe, cached.edits) == (forwards, edits), cache


def test_edit_scope_all_edits_earlier_blocks_in_the_cases(model):
    """The cases are not vacuous: scope all edits more than scope block in most of them
    (the edits of earlier blocks), and changes the answer in some."""
    more, differ = 0, 0
    for lengths, gen, block, steps, threshold, edit, post, penalty, causal in MBE_CASES:
        prompts = prompts_of(len(lengths) * 100 + gen + block, lengths)
        options = _options(gen, block, steps, threshold, edit, post, penalty, causal)
        within = unmask_run(model, prompts, **options)
        explicit = unmask_run(model, prompts, edit_scope="block", **options)
        assert explicit.answers.tolist() == within.answers.tolist()  # block is the default
        assert (explicit.nfe, explicit.edits) == (within.nfe, within.edits)
        across = unmask_run(model, prompts, edit_scope="all", **options)
        more += across.edits > within.edits
        differ += across.answers.tolist() != within.answers.tolist()
    assert more >= 6 and differ >= 3, (more, differ)


@pytest.mark.parametrize("case", CASES[:4] + CASES[16:20], ids=lambda c: f"{len(c[0])}x{c[1]}")
def test_edit_scope_all_on_one_block_is_sglangs(model, case):
    """With one block there is no earlier block: scope all decodes as SGLang does."""
    lengths, gen, block, steps, threshold, edit, post, penalty, causal = case
    prompts = prompts_of(len(lengths) * 100 + gen + block, lengths)
    answers, forwards, fills, edits = sglang_joint_threshold(
        model, prompts, gen, gen, threshold, edit, post, penalty, 1, causal)  # fmt: skip
    out = unmask_run(model, prompts, edit_scope="all", gen_length=gen, block_length=gen,
                     threshold=threshold, edit_threshold=edit, max_post_edit_steps=post,
                     penalty_lambda=penalty, block_causal=causal)  # fmt: skip
    assert out.answers.tolist() == answers.tolist()
    assert (out.nfe, out.decoded, out.edits) == (forwards, fills, edits)


class ForceOnceBlockOneStarts(nn.Module):
    """The model, but once the second answer block holds a token, the proposal at canvas
    column `column` (in the first block) is `token` with probability about 1: an edit only
    scope all can make."""

    def __init__(self, model: nn.Module, column: int, second_block: int, token: int):
        super().__init__()
        self.model, self.column, self.second, self.token = model, column, second_block, token

    def forward(self, input_ids, **kwargs):
        logits = self.model(input_ids, **kwargs)
        started = (input_ids[:, self.second : self.second + 4] != MASK).any(1)
        if started.any():
            logits = logits.clone()
            logits[started, self.column, self.token] = 100.0
        return logits


class Glyphs:
    """A tokenizer for TerminalAnimation: one letter a token id."""

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_an_earlier_blocks_token_is_edited_and_shown(model):
    prompts = prompts_of(21, [6])
    options = dict(gen_length=8, block_length=4, edit_threshold=0.5, max_post_edit_steps=2,
                   history=True)  # fmt: skip
    plain = unmask_run(model, prompts, edit_scope="all", **options)
    column = 6 + 1  # the second answer position, in the first block
    token = (plain.answers[0, 1].item() + 1) % PAD
    forced = ForceOnceBlockOneStarts(model, column, 6 + 4, token)
    within = unmask_run(forced, prompts, **options)
    assert within.answers[0, 1].item() == plain.answers[0, 1].item() != token  # never edited
    show = TerminalAnimation(Glyphs(), MASK, PAD, None, stream=io.StringIO())
    ids, _ = left_pad(prompts, PAD)
    config = SamplingConfig(decoder="joint_threshold", edit_scope="all", **options)
    across = sample(forced, ids, config, mask_id=MASK, on_step=show)
    assert across.answers[0, 1].item() == token  # edited while the second block decoded
    history = [canvas[0, column].item() for canvas in across.history]
    changed = [i for i in range(1, len(history)) if history[i] != history[i - 1]]
    assert history[changed[-1]] == token and history[changed[-1] - 1] != MASK
    first_block_done = next(i for i, c in enumerate(across.history) if (c[0, 6:10] != MASK).all())
    assert changed[-1] > first_block_done  # edited in a step of the second block
    assert show.edits == across.edits >= 1  # --show's count holds it
    lines = [line for line in show.stream.getvalue().splitlines() if line.startswith("step ")]
    assert lines[-1].endswith(f", {across.edits} so far)")
    assert f"step {changed[-1] + 1} (" in show.stream.getvalue()  # that step shows an edit


def test_edit_scope_options_and_flags():
    assert resolve_sampling({"decoder": "joint_threshold"}).edit_scope is None  # = block
    given = resolve_sampling({"decoder": "joint_threshold", "edit_scope": "all"})
    assert given.edit_scope == "all"
    for options, message in [
        (dict(edit_scope="window"), "unknown edit_scope 'window'; expected one of "
                                    "['block', 'all']"),
        (dict(decoder="masked", edit_scope="all"), "edit_scope is an option of decoder "
                                                   "joint_threshold"),
        (dict(edit_scope="all", tokens_hook=lambda step, x, logits: x),
         "edit_scope all takes no tokens_hook"),
    ]:  # fmt: skip
        with pytest.raises(InputError) as err:
            resolve_sampling({"decoder": "joint_threshold", **options})
        assert message in str(err.value) and "\n" not in str(err.value)
    ns = build_parser().parse_args(["generate", "--model", "m", "--prompt", "a", "--decoder",
                                    "joint_threshold", "--edit-scope", "all"])  # fmt: skip
    assert ns.edit_scope == "all"


def test_a_served_edit_scope_all_request_gives_generates_tokens(folder, sm, tmp_path):
    """edit_scope all over the server (decoded alone by `sample`, as its steps edit
    finished blocks) answers what `unmask generate --edit-scope all` answers."""
    from unmask.serve.engine import Job

    options = {**OPTIONS, "edit_scope": "all"}
    texts = {p: alone(sm, p, **options) for p in PROMPTS}
    within = {p: alone(sm, p, **OPTIONS)[0] for p in PROMPTS}
    assert any(texts[p][0] != within[p] for p in PROMPTS)  # the scope changes an answer here
    prompt = next(p for p in PROMPTS if texts[p][0] != within[p])
    dst = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(folder), "--prompt", prompt, "--out", str(dst),
                 *FLAGS, "--edit-scope", "all"]) == 0  # fmt: skip
    expected = json.loads(dst.read_text())["completion"]
    assert expected == texts[prompt][0]
    job = Job([1, 2], SamplingConfig(**options), emit=lambda event: None)
    assert job.auto and job.group[0] == "alone"
    unmask = {"block_length": 4, "decoder": "joint_threshold", "edit_threshold": 0,
              "max_post_edit_steps": 3, "penalty_lambda": 1, "edit_scope": "all"}  # fmt: skip
    served_equals(sm, prompt, unmask, expected, ("edit_scope", "window"))
