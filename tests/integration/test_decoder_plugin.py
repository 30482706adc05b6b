"""A decoder added from outside the package, as docs/architecture.md says (Where to add, a
new decoder): a `BlockDecoder` subclass registered with `register_decoder` is a `decoder`
choice of `sample`, of `unmask generate --decoder`, of the serving engine's block calls and,
loaded as an installed package's `unmask.plugins` entry point, of `unmask serve`, with no
edit of unmask/. Its own options are its options model (`Decoder.options_model`: fields,
checks, a preset), given as `--decoder-option NAME=VALUE`, in a folder's
generation_config.json or in a request's "unmask": {"decoder_options": ...}, and refused in
one line naming the decoder."""

import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from conftest import installed_plugin, save_tiny_model
from test_serve import AUTH, KEY, generate, start_server

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.errors import InputError
from unmask.sampling import SamplingConfig, sample
from unmask.sampling.config import resolve_sampling
from unmask.sampling.decoders import DECODERS
from unmask.sampling.texts import before_eos
from unmask.serve.engine import Engine, Job

pytestmark = pytest.mark.usefixtures("one_thread")

#: the plug-in, as a package would ship it: a module that registers a decoder on import
PLUGIN = textwrap.dedent('''
    """A toy decoder: each step commits the `stride` rightmost masks of the block, the
    model's argmax there from one forward; the block's logits from BlockDecoder.forward. Its
    own options (stride, and a preset that sets it) are its pydantic options model."""
    from typing import Literal

    import torch
    from pydantic import BaseModel, ConfigDict, Field, model_validator

    from unmask.sampling import BlockDecoder, register_decoder


    class RightToLeftOptions(BaseModel):
        model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

        stride: int = Field(1, ge=1, le=8)
        """Masks committed per step, the rightmost first."""
        preset: Literal["careful", "fast"] | None = None
        """careful: stride 1; fast: stride 4 (a stride given with it wins)."""

        @model_validator(mode="after")
        def _preset(self):
            if self.preset is not None and "stride" not in self.model_fields_set:
                self.stride = {"careful": 1, "fast": 4}[self.preset]
            return self


    class RightToLeft(BlockDecoder):
        options_model = RightToLeftOptions

        def step(self, step, generator, out):
            masks = self.block_masks().clone()
            if not masks.any():
                return False
            logits = self.forward(step)  # (B, Lb, V): cache, guidance, prefix cache
            out.nfe += 1
            out.row_forwards += masks.shape[0]
            rows = torch.arange(masks.shape[0])
            positions = 1 + torch.arange(masks.shape[1])
            block = self.canvas.x[:, self.start : self.stop]
            for _ in range(self.own_options(self.config).stride):
                has = masks.any(1)
                if not has.any():
                    break
                last = (masks.long() * positions).argmax(1)  # the rightmost mask of each row
                chosen = logits[rows, last].argmax(-1)
                block[rows[has], last[has]] = chosen[has]
                masks[rows[has], last[has]] = False
                out.decoded += int(has.sum())
            out.steps += 1
            return True


    register_decoder("right_to_left", RightToLeft)
''')
PROMPTS = ["rev 90417=", "a", "sort 31=", "add 12+7="]
LENGTHS = [8, 4, 12, 8]


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """The plug-in as an installed package (its module, and its entry point in the
    `unmask.plugins` group)."""
    return installed_plugin(tmp_path_factory.mktemp("plugin"), "toy_decoder", None, PLUGIN)


@pytest.fixture(scope="module")
def registered(plugin_dir):
    sys.path.insert(0, str(plugin_dir))
    import toy_decoder  # noqa: F401  (registers it)

    yield "right_to_left"
    DECODERS.pop("right_to_left")  # the registry is process-wide: leave it as it was
    sys.path.remove(str(plugin_dir))
    sys.modules.pop("toy_decoder")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("decoder") / "model", seed=0)


@pytest.fixture(scope="module")
def sm(model_dir):
    return load_for_sampling(model_dir, device="cpu")


def ids_of(sm, prompt: str) -> torch.Tensor:
    return torch.tensor([sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])


def test_sample_runs_the_registered_decoder(registered, sm):
    config = SamplingConfig(gen_length=8, block_length=4, decoder=registered, history=True)
    prompt = ids_of(sm, "rev 90417=")
    out = sample(sm.model, prompt, config, mask_id=sm.mask_id)
    start = out.prompt_length
    first = torch.cat([prompt, torch.full((1, 8), sm.mask_id)], dim=1)
    canvases = [first, *out.history]
    changed = [int((a[0] != b[0]).nonzero()[0]) - start for a, b in zip(canvases, canvases[1:])]
    assert changed == [3, 2, 1, 0, 7, 6, 5, 4]  # right to left, block by block
    assert out.nfe == out.steps == 8 and out.decoded == 8
    for before, after, at in zip(canvases, canvases[1:], changed):  # the model's argmax there
        assert int(after[0, start + at]) == int(sm.model(before)[0, start + at].argmax())


def test_its_own_options_reach_it(registered, sm):
    """The options model's fields, defaults and preset, read by the decoder: stride 2 commits
    the block's two rightmost masks a step from one forward."""
    prompt = ids_of(sm, "rev 90417=")
    runs = {}
    for name, options in {"default": None, "stride2": {"stride": 2}, "fast": {"preset": "fast"},
                          "fast_stride2": {"preset": "fast", "stride": 2}}.items():  # fmt: skip
        config = SamplingConfig(gen_length=8, block_length=4, decoder=registered,
                                decoder_options=options, history=True)  # fmt: skip
        runs[name] = sample(sm.model, prompt, config, mask_id=sm.mask_id)
    assert [runs[n].steps for n in runs] == [8, 4, 2, 4]  # 8 masks, 1 / 2 / 4 / 2 a step
    assert all(runs[n].nfe == runs[n].steps and runs[n].decoded == 8 for n in runs)
    start, out = runs["stride2"].prompt_length, runs["stride2"]
    first = torch.cat([prompt, torch.full((1, 8), sm.mask_id)], dim=1)
    canvases = [first, *out.history]
    changed = [sorted((a[0] != b[0]).nonzero()[:, 0].tolist()) for a, b in
               zip(canvases, canvases[1:])]  # fmt: skip
    assert changed == [[start + i, start + i + 1] for i in (2, 0, 6, 4)]
    for before, after, at in zip(canvases, canvases[1:], changed):  # both from one forward
        assert after[0, at].tolist() == sm.model(before)[0, at].argmax(-1).tolist()
    assert torch.equal(runs["fast_stride2"].answers, runs["stride2"].answers)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stride": 0}, "decoder 'right_to_left': bad value for option 'stride'"),
        ({"strde": 2}, "unknown option 'strde' of decoder 'right_to_left' \\(did you mean "
                       "'stride'\\?\\); its options: stride, preset"),
        ({"preset": "slow"}, "decoder 'right_to_left': bad value for option 'preset'"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_in_one_line_naming_the_decoder(registered, options, message):
    with pytest.raises(InputError, match=message) as err:
        resolve_sampling({"decoder": registered, "decoder_options": options})
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="decoder 'masked' declares no options of its own; "
                                         "drop decoder_options \\['stride'\\]"):  # fmt: skip
        resolve_sampling({"decoder": "masked", "decoder_options": {"stride": 2}})


def test_generate_takes_the_decoder_flag_and_its_options(registered, model_dir, sm, tmp_path,
                                                         capsys):  # fmt: skip
    for flags, options in [((), None), (("--decoder-option", "stride=2"), {"stride": 2}),
                           (("--decoder-option", "preset=fast", "--decoder-option", "stride=2"),
                            {"preset": "fast", "stride": 2})]:  # fmt: skip
        texts = generate(model_dir, tmp_path, PROMPTS[:2], "--gen-length", "8",
                         "--block-length", "4", "--decoder", registered, *flags)  # fmt: skip
        config = SamplingConfig(gen_length=8, block_length=4, decoder=registered,
                                decoder_options=options)  # fmt: skip
        for prompt, text in zip(PROMPTS, texts):
            out = sample(sm.model, ids_of(sm, prompt), config, mask_id=sm.mask_id,
                         eos_id=sm.eos_id)  # fmt: skip
            tokens = before_eos(out.answers[0].tolist(), sm.eos_id)
            assert text == sm.tokenizer.decode(tokens)
    capsys.readouterr()
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "refused.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompts", str(src), "--out",
                 str(dst), "--decoder", registered, "--decoder-option", "stride=0"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "decoder 'right_to_left': bad value for option 'stride'" in err
    assert not dst.exists()


def test_a_run_configs_yaml_carries_its_options(registered, tmp_path):
    """eval.sampling (the held-out generation's sampler) in a run's YAML."""
    from conftest import write_run_config

    from unmask.config import load_config

    sampler = {"decoder": registered, "block_length": 4}
    good = {"eval": {"sampling": {**sampler, "decoder_options": {"preset": "fast"}}}}
    cfg = load_config(write_run_config(tmp_path, "good", {}, good))
    assert DECODERS[registered].own_options(cfg.eval.sampling).stride == 4
    bad = {"eval": {"sampling": {**sampler, "decoder_options": {"stride": "wide"}}}}
    with pytest.raises(InputError, match="decoder 'right_to_left': bad value for option "
                                         "'stride'") as err:  # fmt: skip
        load_config(write_run_config(tmp_path, "bad", {}, bad))
    assert "\n" not in str(err.value)


def test_a_folder_carries_its_options(registered, tmp_path):
    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
    from unmask.sampling.generation_file import (
        GENERATION_FILE,
        generation_config_text,
        saved_sampling,
    )

    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    options = {"decoder": registered, "decoder_options": {"preset": "fast"}}
    (tmp_path / GENERATION_FILE).write_text(generation_config_text(tok, options, False))
    config = resolve_sampling(saved_sampling(tmp_path), {"gen_length": 8})
    assert config.decoder_options == {"preset": "fast"}
    assert DECODERS[registered].own_options(config).stride == 4
    # another decoder named later: the folder's options were its decoder's, and go
    other = resolve_sampling(saved_sampling(tmp_path), {"gen_length": 8, "decoder": "masked"})
    assert other.decoder == "masked" and other.decoder_options is None
    same = resolve_sampling({"decoder": registered, "decoder_options": {"stride": 2}},
                            {"decoder": registered})  # fmt: skip
    assert same.decoder_options == {"stride": 2}


def test_the_engine_batches_it_as_each_prompt_alone(registered, sm):
    """Rows joining between block calls, at different blocks of different answers, decode
    what `sample` decodes for each prompt alone (the engine's block calls, by hand)."""
    engine = Engine(sm, start=False)
    jobs, events = [], {i: [] for i in range(len(PROMPTS))}
    for i, (prompt, length) in enumerate(zip(PROMPTS, LENGTHS)):
        config = SamplingConfig(gen_length=length, block_length=4, decoder=registered)
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        jobs.append(Job(ids, config, emit=events[i].append))
    assert not any(job.auto for job in jobs) and len({job.group for job in jobs}) == 1
    active, call = [], 0
    while call == 0 or active:
        active += [job for job, at in zip(jobs, [0, 0, 1, 2]) if at == call]
        engine.run_block(active)
        active = [job for job in active if job.block >= 0]
        call += 1
    for i, (prompt, length) in enumerate(zip(PROMPTS, LENGTHS)):
        config = SamplingConfig(gen_length=length, block_length=4, decoder=registered)
        out = sample(sm.model, ids_of(sm, prompt), config, mask_id=sm.mask_id, eos_id=sm.eos_id)
        expected = sm.tokenizer.decode(before_eos(out.answers[0].tolist(), sm.eos_id))
        done = [e for e in events[i] if e["type"] == "done"]
        assert done and done[0]["text"] == expected


def test_unmask_serve_loads_it_as_an_entry_point_and_serves_it(
    plugin_dir, registered, model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", str(plugin_dir))  # the package is "installed" there
    proc, base = start_server(model_dir, "--api-key", KEY)
    try:
        expected = generate(model_dir, tmp_path, ["rev 123="], "--gen-length", "8",
                            "--block-length", "4", "--decoder", registered)  # fmt: skip
        body = {"model": "tiny", "prompt": "rev 123=", "max_tokens": 8,
                "unmask": {"block_length": 4, "decoder": registered}}  # fmt: skip
        reply = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected[0]
        # its own options from the request's fields
        strided = generate(model_dir, tmp_path, ["rev 123="], "--gen-length", "8",
                           "--block-length", "4", "--decoder", registered, "--decoder-option",
                           "stride=2")  # fmt: skip
        body["unmask"]["decoder_options"] = {"stride": 2}
        reply = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == strided[0]
        body["unmask"]["decoder_options"] = {"stride": 9}
        refused = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert "decoder 'right_to_left': bad value for option 'stride'" in error["message"]
        del body["unmask"]["decoder_options"]
        info = httpx.get(base + "/api/info", headers=AUTH).json()
        decoder = next(o for o in info["sampling_options"] if o["name"] == "decoder")
        assert registered in decoder["choices"]
        body["unmask"]["decoder"] = "nope"
        refused = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert refused.status_code == 400 and "unknown decoder 'nope'" in refused.text
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("command", [["-m", "unmask", "runs"], ["-m", "unmask.eval.harness"]])
def test_a_plugin_that_fails_to_import_stops_the_command_in_one_line(tmp_path, command):
    """`unmask` and `unmask-lm-eval` both load the plug-ins first."""
    installed_plugin(tmp_path, "broken", "no_such_module_here")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, *command, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    name = "unmask" if command[1] == "unmask" else "unmask-lm-eval"
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f"{name}: error: plug-in 'toy' (no_such_module_here) failed to load: "
        "ModuleNotFoundError: No module named 'no_such_module_here'"
    )


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(decoder="blocks_from_start"), "blocks_from_start is Fast-dLLM v2's form"),
        (dict(decoder="left_to_right", cfg_scale=1.0), "has no mask to guide with"),
        (dict(decoder="masked", autoregressive=True), "an autoregressive model decodes left"),
        (dict(decoder="masked", blocks_from_start=True, block_causal=True, shift_logits=True,
              block_length=4, threshold=0.9), "block_causal attention cannot use the logit"),
    ],
)  # fmt: skip
def test_options_are_checked_for_the_decoder_that_runs(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**options)
