"""`unmask generate` (jsonl in/out, batching, --show), `unmask eval --ppl` and
`unmask export` over a tiny model folder built in the test; the exported folder loads in
transformers with the same logits."""

import json
import re

import pytest
import torch
from conftest import save_tiny_model

from unmask.cli import main
from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
from unmask.models import from_pretrained
from unmask.sampling import SamplingConfig, left_pad, sample
from unmask.sampling.show import EOS_GLYPH, MASK_GLYPH, TerminalAnimation, render_row

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("ckpt") / "checkpoint-3", seed=0)


def expected_completions(folder, prompts, **kw):
    """The same generation through the Python API, one prompt at a time."""
    from unmask.data.tokenizer import load_local_tokenizer as load_tokenizer

    tok = load_tokenizer(folder)
    model = from_pretrained(folder).eval()
    out = []
    for p in prompts:
        ids, _ = left_pad([tok(p, add_special_tokens=False)["input_ids"]], 0)
        ans = sample(model, ids, SamplingConfig(**kw), mask_id=tok.mask_token_id,
                     eos_id=tok.eos_token_id)  # fmt: skip
        ans = ans.answers[0].tolist()
        ans = ans[: ans.index(tok.eos_token_id)] if tok.eos_token_id in ans else ans
        out.append(tok.decode(ans, skip_special_tokens=True))
    return out


def test_generate_jsonl_in_and_out(model_dir, tmp_path):
    prompts = ["rev 123=", "sort 4=", "add 12+7="]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    dst = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--prompts", str(src), "--out", str(dst),
            "--gen-length", "8", "--block-length", "4", "--threshold", "0.5", "--cache", "dual"]  # fmt: skip
    assert main(args) == 0
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts
    expected = expected_completions(model_dir, prompts, steps=8, gen_length=8, block_length=4,
                                    threshold=0.5, cache="dual")  # fmt: skip
    assert [r["completion"] for r in records] == expected
    assert all(r["nfe"] >= 1 and r["tokens"] <= 8 for r in records)


def test_generate_single_prompt_prints_text_and_show_animates(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", "rev 12=", "--gen-length",
                 "6", "--show", "--show-delay", "0"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    expected = expected_completions(model_dir, ["rev 12="], steps=6, gen_length=6)[0]
    assert captured.out == "rev 12=" + expected + "\n"
    frames = [line for line in captured.err.split("\n") if "rev 12=" in line]
    assert len(frames) == 6  # one frame per step
    assert frames[0].count(MASK_GLYPH) == 5 and MASK_GLYPH not in frames[-1]
    assert "step 6" in captured.err and "\x1b[" not in captured.err  # not a terminal: plain
    assert frames[-1].startswith("rev 12=" + expected)
    assert "tokens/s" in captured.err and "tokens per forward" in captured.err


def test_several_prompts_print_plain_lines_unless_jsonl_is_asked(model_dir, tmp_path, capsys):
    """The output's form follows the flags, not the number of prompts: several --prompt (or
    a --prompts file) print one plain line per prompt, in order, like one --prompt does;
    --jsonl prints the records."""
    prompts = ["rev 12=", "sort 31=", "add 1+2="]
    expected = expected_completions(model_dir, prompts, steps=6, gen_length=6)
    argv = ["generate", "--model", str(model_dir), "--gen-length", "6"]
    flags = [arg for p in prompts for arg in ("--prompt", p)]
    assert main([*argv, *flags]) == 0
    assert capsys.readouterr().out == "".join(p + e + "\n" for p, e in zip(prompts, expected))
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[1:]))
    assert main([*argv, "--prompt", prompts[0], "--prompts", str(src)]) == 0
    assert capsys.readouterr().out == "".join(p + e + "\n" for p, e in zip(prompts, expected))
    assert main([*argv, *flags, "--jsonl"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["completion"]) for r in records] == list(zip(prompts, expected))


def test_show_on_a_terminal_redraws_in_place():
    import io

    tok = build_char_tokenizer()
    ensure_special_tokens(tok)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    show = TerminalAnimation(tok, tok.mask_token_id, tok.eos_token_id, tok.eos_token_id,
                             stream=stream, delay=0)  # fmt: skip
    ids = tok("ab", add_special_tokens=False)["input_ids"]
    show(torch.tensor([ids + [tok.mask_token_id] * 2]))
    show(torch.tensor([ids + [tok.eos_token_id] * 2]))
    frames = stream.getvalue()
    assert frames.count("\x1b[2F") == 1 and ("ab" + EOS_GLYPH * 2) in frames


def test_render_row():
    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    ids = tok("ab", add_special_tokens=False)["input_ids"] + [tok.mask_token_id] * 2
    assert render_row(tok, ids, tok.mask_token_id, set()) == "ab" + MASK_GLYPH * 2


def test_generate_bad_prompts_file(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    assert main(["generate", "--model", str(model_dir), "--prompts", str(bad)]) == 2
    assert 'expected {"prompt": "..."}' in capsys.readouterr().err


def test_eval_ppl_prints_the_bound(model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("rev 123=321\n")
    assert main(["eval", "--model", str(model_dir), "--ppl", str(text), "--context", "1",
                 "--mc-num", "1"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    # stderr: the numbers, then what the bound is (ELBO, Monte Carlo rows, why it is large)
    numbers, meaning = captured.err.splitlines()[-2:]
    assert numbers == (
        f"unmask: {result['tokens']} scored tokens: NELBO {result['nelbo_per_token']:.4g} "
        f"nats/token, standard error 0; perplexity <= {result['ppl_upper_bound']:.4g}"
    )
    assert meaning.startswith(
        "unmask: perplexity <= exp(NELBO/token) is an upper bound: a diffusion LM has no exact "
        "likelihood, only the ELBO below it, here a Monte Carlo estimate from --mc-num 1 masked "
        "rows per chunk of <= 1 tokens. Every token is masked and scored, with no prompt: "
    )
    assert "an undertrained model" in meaning and meaning.endswith("with --pairs")
    # context 1: each token scored alone, masked -> the bound is exact: check it by hand
    from unmask.data.tokenizer import load_local_tokenizer as load_tokenizer

    tok, model = load_tokenizer(model_dir), from_pretrained(model_dir).eval()
    ids = tok("rev 123=321\n", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[tok.mask_token_id]]))[0, 0].double(), -1)
    nll = -sum(logp[i].item() for i in ids) / len(ids)
    assert result["tokens"] == len(ids)
    assert result["nelbo_per_token"] == pytest.approx(nll, abs=1e-5)


def test_export_loads_in_unmask_and_transformers_with_equal_logits(model_dir, tmp_path):
    import transformers

    out = tmp_path / "exported"
    assert main(["export", str(model_dir), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert (
        gen_cfg["mask_token_id"] is not None and gen_cfg["unmask"]["remasking"] == "low_confidence"
    )
    ours = from_pretrained(out).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    full = torch.ones(2, 1, 11, 11, dtype=torch.bool)
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask={"full_attention": full}).logits
        logits = ours(ids)
    assert (logits - reference).abs().max().item() < 1e-4
    # generate reads the exported folder (tokenizer and defaults included)
    assert main(["generate", "--model", str(out), "--prompt", "rev 1=", "--gen-length", "4"]) == 0
    # a second export into the same folder is refused without --overwrite
    assert main(["export", str(model_dir), "--out", str(out)]) == 2


def test_a_prompt_with_characters_the_tokenizer_lacks_is_warned_about(model_dir, tmp_path,
                                                                       capsys):  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompt", "rev é12=", "--gen-length",
                 "4", "--out", str(out)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "the tokenizer does not know 'é' in prompt 'rev é12='" in err
    assert f"wrote 1 record(s) to {out}" in err


def test_show_counts_each_batchs_edits_as_the_python_api_does(tmp_path, capsys):
    """joint_threshold edits: prompts of two lengths in a folder with row_length are two
    batches; each batch's --show count starts at 0 and equals its `sample` output's edits,
    the summary line and the records carry the totals, and each edit is listed with its
    step and the token it replaced."""
    from unmask.data.tokenizer import load_local_tokenizer

    folder = save_tiny_model(tmp_path / "final", seed=0)
    (folder / "generation_config.json").write_text(json.dumps({"unmask": {"row_length": 16}}))
    prompts = ["rev 12=", "add 1+22="]  # 7 and 9 tokens: two groups of their own
    flags = ["--decoder", "joint_threshold", "--threshold", "0.2", "--block-length", "8"]
    tok, model = load_local_tokenizer(folder), from_pretrained(folder).eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        config = SamplingConfig(decoder="joint_threshold", threshold=0.2, block_length=8,
                                row_length=16).fitted(ids.shape[1])  # fmt: skip
        expected.append(sample(model, ids, config, mask_id=tok.mask_token_id,
                               eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).edits)  # fmt: skip
    assert sum(expected) > 0  # the random tiny model edits
    argv = ["generate", "--model", str(folder), *flags, "--show", "--show-delay", "0", "--jsonl"]
    assert main([*argv, *(a for p in prompts for a in ("--prompt", p))]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["edits"] for r in records] == expected
    totals = [int(m) for m in re.findall(r"edited, (\d+) so far\)\n", err)]
    batch_ends = [a for a, b in zip(totals, totals[1:] + [0]) if b < a or b == 0]
    assert batch_ends[-len(expected) :] == expected  # each batch counts its own edits
    assert err.count("edited at step") == sum(expected)
    assert f", {sum(expected)} token edits" in err.splitlines()[-1]


@pytest.mark.parametrize("fraction, warned", [(0.0, True), (0.2, False)])
def test_edits_on_a_model_trained_without_them_are_warned_of(tmp_path, capsys, fraction,
                                                             warned):  # fmt: skip
    """joint_threshold on a folder whose run config says diffusion.edit_fraction 0: one
    warning line on stderr; a model trained with edits, or edits turned off, gets none."""
    run = tmp_path / "run"
    folder = save_tiny_model(run / "final", seed=0)
    (run / "config.yaml").write_text(f"diffusion: {{objective: mdlm, edit_fraction: {fraction}}}\n")
    argv = ["generate", "--model", str(folder), "--prompt", "rev 12=", "--gen-length", "4",
            "--decoder", "joint_threshold"]  # fmt: skip
    assert main(argv) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(lines) == int(warned)
    if warned:
        assert "diffusion.edit_fraction 0" in lines[0] and "joint_threshold" in lines[0]
    assert main([*argv, "--edit-threshold", "1.0"]) == 0  # edits off: nothing to warn of
    assert "warning" not in capsys.readouterr().err
    assert main(argv[:7]) == 0  # the masked decoder edits nothing
    assert "warning" not in capsys.readouterr().err


def test_progress_lines_when_output_is_not_a_terminal(model_dir, capsys):
    """Without a terminal a long generate says how far it is now and then (every 30 s; here
    every batch), between no other lines; --show draws its own frames instead."""
    import io

    from unmask.cli.generate import PROGRESS_SECONDS, progress_lines

    stream = io.StringIO()
    on_batch = progress_lines(5, every=0.0, stream=stream)
    for chunk in ([0, 1], [2, 3], [4]):
        on_batch(chunk)
    assert stream.getvalue().splitlines() == [
        "unmask: generate: 0/5 prompts done", "unmask: generate: 2/5 prompts done",
        "unmask: generate: 4/5 prompts done"]  # fmt: skip
    assert PROGRESS_SECONDS == 30.0
    quiet = io.StringIO()
    progress_lines(5, stream=quiet)([0, 1])
    assert quiet.getvalue() == ""  # within 30 s of the start
