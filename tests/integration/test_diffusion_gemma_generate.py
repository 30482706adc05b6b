"""A DiffusionGemma folder as transformers saves it (save_pretrained of a tiny random
DiffusionGemmaForBlockDiffusion, `save_tiny_diffusion_gemma`, plus a tokenizer), decoded by
decoder `entropy_bound` from every front end: `unmask generate` (the texts transformers'
own `generate` gives each prompt after torch.manual_seed(seed + row)), `unmask eval`
(generation tasks; likelihoods refused in one line), the lm-eval adapter, and `unmask
serve` (the openai client gets `unmask generate`'s text; requests are decoded one at a
time, all answered). Bad combinations: one line, exit 2."""

import asyncio
import json

import httpx
import openai
import pytest
import torch
from conftest import save_tiny_diffusion_gemma, save_tiny_model, write_toy_tasks

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.sampling import SamplingConfig
from unmask.sampling.texts import before_eos, generate_texts

pytestmark = pytest.mark.usefixtures("one_thread")

EOS, PAD = 1, 0
PROMPTS = ["add 12+7=", "a", "rev 90417=", "sort 31=", "the cat sat on the", "q"]
#: a cold schedule: canvases stop early, at different steps
OPTIONS = dict(gen_length=16, max_denoising_steps=8, temperature_start=0.3,
               temperature_end=0.1, confidence_threshold=0.3)  # fmt: skip
FLAGS = ["--gen-length", "16", "--max-denoising-steps", "8", "--temperature-start", "0.3",
         "--temperature-end", "0.1", "--confidence-threshold", "0.3"]  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "model")


@pytest.fixture(scope="module")
def sm(saved):
    return load_for_sampling(saved[1], device="cpu")


@torch.no_grad()
def transformers_text(hf, sm, prompt: str, seed: int) -> str:
    """transformers' generate for the prompt alone after torch.manual_seed(seed), decoded
    as unmask decodes an answer (before EOS; at most gen_length tokens)."""
    ids = torch.tensor([sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    torch.manual_seed(seed)
    out = hf.generate(ids, max_new_tokens=16, max_denoising_steps=8, t_max=0.3, t_min=0.1,
                      confidence_threshold=0.3, eos_token_id=EOS, pad_token_id=PAD)  # fmt: skip
    answer = before_eos(out.sequences[0, ids.shape[1] :].tolist()[:16], EOS)
    return sm.tokenizer.decode(answer, skip_special_tokens=True)


def write_prompts(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_unmask_generate_gives_transformers_texts(saved, sm, tmp_path, capsys):
    """--seed 11: prompt r draws as transformers after torch.manual_seed(11 + r), in one
    batch or in batches of 4."""
    hf, folder = saved
    dst = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(folder), "--prompts",
                 write_prompts(tmp_path / "p.jsonl", PROMPTS), "--out", str(dst), "--seed",
                 "11", "--show", "--show-delay", "0", *FLAGS]) == 0  # fmt: skip
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    expected = [transformers_text(hf, sm, p, 11 + r) for r, p in enumerate(PROMPTS)]
    assert [r["completion"] for r in records] == expected
    assert len({r["completion"] for r in records}) == len(PROMPTS)
    err = capsys.readouterr().err
    assert "step 1" in err and "forward calls" in err  # --show drew the drafts
    # prompt r draws from 11 + r whatever the batch size
    assert main(["generate", "--model", str(folder), "--prompts", str(tmp_path / "p.jsonl"),
                 "--out", str(dst), "--seed", "11", "--batch-size", "4", *FLAGS]) == 0  # fmt: skip
    assert [json.loads(line)["completion"] for line in dst.read_text().splitlines()] == expected
    # the folder's own defaults (transformers': 48 steps at most), no option given
    assert main(["generate", "--model", str(folder), "--prompt", "a", "--gen-length", "8",
                 "--seed", "3", "--jsonl"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    ids = torch.tensor([[sm.tokenizer("a", add_special_tokens=False)["input_ids"][0]]])
    torch.manual_seed(3)
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    answer = before_eos(out.sequences[0, 1:].tolist(), EOS)
    assert record["completion"] == sm.tokenizer.decode(answer, skip_special_tokens=True)


def test_the_command_line_refuses_bad_combinations_in_one_line(saved, tmp_path, capsys):
    folder = str(saved[1])
    masked = str(save_tiny_model(tmp_path / "masked"))
    base = ["generate", "--prompt", "a"]
    assert main([*base, "--model", folder, "--decoder", "masked"]) == 2
    assert main([*base, "--model", folder, "--block-length", "4"]) == 2
    assert main([*base, "--model", folder, "--temperature-start", "0.2"]) == 2
    assert main([*base, "--model", masked, "--decoder", "entropy_bound"]) == 2
    assert main([*base, "--model", masked, "--entropy-bound", "0.2"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 5, err
    assert "decoder 'masked' fills [MASK] tokens, and this model has none" in err[0]
    assert "decoder entropy_bound takes no block_length" in err[1]
    assert "temperature_start (0.2) must be above temperature_end (0.4)" in err[2]
    assert "this model (qwen3_dllm) is not one" in err[3]
    assert "entropy_bound is an option of decoder entropy_bound" in err[4]


TOY_ROWS = [{"question": "add 1+2=", "choices": ["3", "4"], "label": 0},
            {"question": "rev 12=", "choices": ["21", "12"], "label": 0}]  # fmt: skip


def test_unmask_eval_generates_and_refuses_likelihoods(saved, tmp_path, offline, capsys):
    pytest.importorskip("lm_eval")
    folder, tasks = str(saved[1]), write_toy_tasks(tmp_path / "tasks", TOY_ROWS)
    out = tmp_path / "results.json"
    assert main(["eval", "--model", folder, "--tasks", "toy_gen", "--include-path", str(tasks),
                 "--preset", "instruct", "--max-denoising-steps", "8", "--seed", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    tree = json.loads(out.read_text())
    sampling = tree["unmask"]["sampling"]
    assert sampling["uniform_canvas"] is True and sampling["max_denoising_steps"] == 8
    assert sampling["block_length"] is None  # the instruct preset's masked options left out
    assert tree["throughput"]["generated_tokens"] > 0
    capsys.readouterr()
    assert main(["eval", "--model", folder, "--tasks", "toy_mc", "--include-path", str(tasks),
                 "--preset", "base"]) == 2  # fmt: skip
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    assert main(["eval", "--model", folder, "--pairs", str(pairs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert "task 'toy_mc' is multiple_choice (scored by likelihood)" in err[0]
    assert "--preset instruct and generate_until tasks" in err[0]
    assert "likelihoods of uniform-canvas (diffusion_gemma) models are not implemented" in err[1]


def test_the_lm_eval_adapter_generates_as_generate_texts(saved, sm):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from unmask.eval.harness import UnmaskLM

    lm = UnmaskLM.create_from_arg_string(
        f"pretrained={saved[1]},seed=4,max_denoising_steps=8,temperature_start=0.3,"
        "temperature_end=0.1,confidence_threshold=0.3"
    )
    assert lm.options.uniform_canvas and lm.options.max_denoising_steps == 8
    # the task's temperature is not the decoder's: its schedule is
    requests = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 16,
                                                     "temperature": 0.0}), i)
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    texts = lm.generate_until(requests)
    config = SamplingConfig(uniform_canvas=True, **OPTIONS)
    expected = generate_texts(sm, PROMPTS, config, 16, torch.Generator().manual_seed(4))
    assert texts == [r["completion"].split("\n")[0] for r in expected]
    assert lm.stats["forward_passes"] > 0 and lm.stats["generated_tokens"] > 0
    with pytest.raises(ValueError, match="likelihoods of uniform-canvas .* not implemented"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("a", "b"), 0)])


def test_the_server_answers_what_generate_answers(saved, sm, tmp_path):
    """The openai client, a completions request with a seed: `unmask generate --seed`'s
    text; three requests at once (each decoded alone, in turn): each its own text."""
    from unmask.serve.app import Server, build_app
    from unmask.serve.engine import Engine

    folder = saved[1]
    expected = []
    for seed, prompt in enumerate(PROMPTS[:3]):
        dst = tmp_path / f"out{seed}.jsonl"
        assert main(["generate", "--model", str(folder), "--prompt", prompt, "--out", str(dst),
                     "--seed", str(seed), *FLAGS]) == 0  # fmt: skip
        expected.append(json.loads(dst.read_text())["completion"])
    assert expected[0] == transformers_text(saved[0], sm, PROMPTS[0], 0)
    engine = Engine(sm)
    app = build_app(Server(sm, engine, "tiny"))
    unmask = {"max_denoising_steps": 8, "temperature_start": 0.3, "temperature_end": 0.1,
              "confidence_threshold": 0.3}  # fmt: skip

    async def ask_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="none",
                                        http_client=http, max_retries=0)  # fmt: skip
            asks = [client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                              seed=seed, extra_body={"unmask": unmask})
                    for seed, prompt in enumerate(PROMPTS[:3])]  # fmt: skip
            replies = await asyncio.gather(*asks)
            refused = []
            for bad in ({"block_length": 4}, {"max_denoising_steps": 5000},
                        {"uniform_canvas": False, "decoder": "masked"}):  # fmt: skip
                with pytest.raises(openai.BadRequestError) as err:
                    await client.completions.create(model="tiny", prompt="a", max_tokens=8,
                                                    extra_body={"unmask": bad})  # fmt: skip
                refused.append(str(err.value))
            return replies, refused

    try:
        replies, refused = asyncio.run(ask_all())
    finally:
        engine.close()
    assert [r.choices[0].text for r in replies] == expected
    assert "decoder entropy_bound takes no block_length" in refused[0]
    assert "unmask.max_denoising_steps (5000) is over this server's 4096" in refused[1]
    assert "decoder 'masked' fills [MASK] tokens, and this model has none" in refused[2]
    assert engine.stats.requests.get("finished") == 3
