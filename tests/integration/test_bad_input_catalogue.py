"""The bad-input catalogue: every kind of bad input to every command, checked the same way.

Each case builds its files under tmp_path and runs `unmask.cli.main`: exit code 2, at most
three lines on stderr that name the problem (and the fix, where there is one), no
traceback, and every file under tmp_path byte-for-byte as it was: no run directory, no
checkpoint, no partial output.
"""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import TINY, save_tiny_model

from unmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

BINARY = bytes(range(256)) * 8  # not UTF-8, not JSON
#: the tiny model as a DiffusionGemma (a sliding and a full layer, 4 experts)
GEMMA = {"model_type": "diffusion_gemma", "head_dim": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "diffusion_gemma": {"sliding_window": 8, "canvas_length": 4}}  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained for one step: its checkpoint-1 and final/ are copied by cases."""
    import yaml

    root = tmp_path_factory.mktemp("trained")
    tree = {**TINY, "train": {**TINY["train"], "max_steps": 1, "output_dir": str(root / "run")}}
    (root / "run.yaml").write_text(yaml.safe_dump(tree))
    assert main(["train", str(root / "run.yaml")]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "model")


@dataclass
class Ctx:
    """What a case builds with: its tmp_path, the tiny config writer and saved folders."""

    tmp: Path
    config: object  # conftest.tiny_config: (extra dict, name) -> path
    trained: Path
    model_folder: Path

    def train(self, extra: dict | None = None, *overrides: str) -> list[str]:
        return ["train", str(self.config(extra)), *overrides]

    def write(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path

    def checkpoint(self, manifest: bool = True) -> Path:
        """A copy of the tiny run's checkpoint-1 (without its manifest: an old-style one)."""
        path = self.tmp / "ckpt" / "checkpoint-1"
        shutil.copytree(self.trained / "checkpoint-1", path)
        if not manifest:
            (path / "manifest.json").unlink()
        return path

    def resume(self, path: Path, extra: dict | None = None) -> list[str]:
        return self.train(extra, f"train.resume_from_checkpoint={path}")

    def model(self) -> Path:
        path = self.tmp / "model"
        shutil.copytree(self.model_folder, path)
        return path


def truncate(path: Path, keep: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def damaged(ctx: Ctx, name: str, manifest: bool, how: str) -> Path:
    """The checkpoint copy with file `name` truncated, removed or overwritten with junk."""
    path = ctx.checkpoint(manifest)
    if how == "truncate":
        truncate(path / name)
    elif how == "remove":
        (path / name).unlink()
    else:
        (path / name).write_text("{not json")
    return path


def case(name, build, *expect, skip=None):
    marks = [pytest.mark.skipif(skip[0], reason=skip[1])] if skip else []
    return pytest.param(build, expect, id=name, marks=marks)


def over(*overrides: str):
    """Build: the tiny config plus command-line overrides."""
    return lambda ctx: ctx.train(None, *overrides)


def with_config(extra: dict):
    return lambda ctx: ctx.train(extra)


def raw_config(text: str):
    return lambda ctx: ["train", str(ctx.write("bad.yaml", text))]


def grpo(rewards: list, module: str | None = None, **grpo_keys):
    """Build: the tiny config as a grpo run with these rewards; module: the text of
    user_rewards.py, written into the run's folder (the reward worker imports it from there)."""

    def build(ctx):
        if module is not None:
            ctx.write("user_rewards.py", module)
        return ctx.train({"diffusion": {"objective": "grpo"}, "rewards": rewards,
                          "grpo": grpo_keys})  # fmt: skip

    return build


def data_file(name: str, content, **data):
    return lambda ctx: ctx.train({"data": {"dataset": str(ctx.write(name, content)), **data}})


def pair_file(name: str, content: str):
    """Build: a preference run (diffusion.objective: preference) on a pair file."""
    return lambda ctx: ctx.train({"data": {"dataset": str(ctx.write(name, content))},
                                  "diffusion": {"objective": "preference"}})  # fmt: skip


def tokenizer_folder(files: dict):
    def build(ctx):
        for name, content in files.items():
            ctx.write(f"tok/{name}", content)
        (ctx.tmp / "tok").mkdir(exist_ok=True)
        return ctx.train({"data": {"tokenizer": str(ctx.tmp / "tok")}})

    return build


def pretrained(damage):
    def build(ctx):
        folder = ctx.model()
        damage(folder)
        return ctx.train({"model": {"pretrained": str(folder)}})

    return build


def resume_damaged(name: str, how: str, manifest: bool = True):
    return lambda ctx: ctx.resume(damaged(ctx, name, manifest, how))


def resume_run(change):
    """Build: `resume_from_checkpoint=true` on a copy of the finished tiny run (checkpoint-1,
    final/) after change(run folder)."""

    def build(ctx):
        run = ctx.tmp / "finished"
        shutil.copytree(ctx.trained, run)
        change(run)
        return ctx.train(None, f"train.output_dir={run}", "train.resume_from_checkpoint=true")

    return build


def cut_copy(run: Path) -> None:
    """checkpoint-1 as a copy cut short: its first files only, no manifest or state file."""
    for name in ("manifest.json", "trainer_state.json", "tokenizer.json"):
        (run / "checkpoint-1" / name).unlink()


def generate(*flags: str, model=True):
    return lambda ctx: ["generate", "--model", str(ctx.model() if model else ctx.tmp / "none"),
                        *flags]  # fmt: skip


def evaluate(*flags: str, text="some text to score\n"):
    return lambda ctx: ["eval", "--model", str(ctx.model()), "--ppl",
                        str(ctx.write("score.txt", text)), *flags]  # fmt: skip


def pairs(*flags: str, text='{"prompt": "rev 12=", "response": "21"}\n'):
    return lambda ctx: ["eval", "--model", str(ctx.model()), "--pairs",
                        str(ctx.write("pairs.jsonl", text)), *flags]  # fmt: skip


LM_TASK = """task: toy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{question}}}}"
doc_to_target: {target}
{choices}metric_list:
  - metric: {metric}
"""


def lm_task(*flags: str, kind="generate_until", data=True, preset="base"):
    """`unmask eval --tasks FILE.yaml --preset PRESET`: a local lm-eval task file (and its
    jsonl data unless `data` is False)."""

    def build(ctx):
        pytest.importorskip("lm_eval")
        records = ctx.tmp / "toy.jsonl"
        if data:
            ctx.write("toy.jsonl", '{"question": "rev 12=", "answer": "21"}\n')
        metric = "exact_match" if kind == "generate_until" else "acc"
        generate = kind == "generate_until"
        target = '"{{answer}}"' if generate else "0"
        choices = "" if generate else 'doc_to_choice: ["21", "12"]\n'
        task = ctx.write("toy.yaml", LM_TASK.format(data=records, kind=kind, metric=metric,
                                                    target=target, choices=choices))  # fmt: skip
        return ["eval", "--model", str(ctx.model()), "--tasks", str(task), "--preset", preset,
                *flags]  # fmt: skip

    return build


def preprocess(*flags: str, tokenizer=None):
    def build(ctx):
        data = ctx.write("corpus.jsonl", '{"text": "one"}\n{"text": "two"}\n')
        tok = tokenizer(ctx) if tokenizer else str(ctx.model())
        return ["preprocess", "--input", str(data), "--tokenizer", tok, *flags]

    return build


def run_dir(ctx) -> Path:
    run = ctx.tmp / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return run


def read_only_parent(ctx):
    parent = ctx.tmp / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    return ctx.train(None, f"train.output_dir={parent / 'run'}")


AS_ROOT = (hasattr(os, "geteuid") and os.geteuid() == 0, "root ignores file permissions")

# fmt: off
CASES = [
    # -- the config file ---------------------------------------------------------------------
    case("config-empty-file", raw_config(""), "is empty", "model:", "unmask train"),
    case("config-only-comments", raw_config("# nothing yet\n"), "is empty", "model:"),
    case("config-not-a-mapping", raw_config("- train\n- model\n"), "must hold a mapping"),
    case("config-invalid-yaml", raw_config("train: [1, 2\n"), "not valid YAML", "line"),
    case("config-missing-file", lambda ctx: ["train", str(ctx.tmp / "no.yaml")], "does not exist"),
    case("config-two-files", lambda ctx: ["train", str(ctx.config()), str(ctx.config())],
         "expected one config file", "section.key=value"),
    case("config-unknown-section", with_config({"trainn": {}}), "unknown config key 'trainn'",
         "did you mean 'train'"),
    case("config-unknown-key", with_config({"train": {"max_step": 5}}),
         "unknown config key 'train.max_step'", "did you mean 'train.max_steps'"),
    case("config-key-in-wrong-section", with_config({"train": {"learning_rate": 0.1}}),
         "'train.learning_rate'", "'optim.learning_rate'"),
    case("config-wrong-type", with_config({"train": {"max_steps": "ten"}}), "'train.max_steps'",
         "'ten'"),
    case("config-section-not-a-mapping", with_config({"optim": 3}), "'optim'", "dictionary"),
    # -- command-line overrides ----------------------------------------------------------
    case("override-without-equals", over("train.max_steps"), "section.key=value"),
    case("override-unknown-key", over("train.max_stepz=3"), "'train.max_stepz'",
         "did you mean 'train.max_steps'"),
    case("override-bad-value", over("train.max_steps=ten"), "'train.max_steps'", "'ten'"),
    case("override-hf-name", over("optim.lr=3e-4"), "unknown config key 'optim.lr'",
         "did you mean 'optim.learning_rate'"),
    case("config-foreign-names", with_config({"train": {"num_epochs": 2}}),
         "unknown config key 'train.num_epochs'", "did you mean 'train.num_train_epochs'"),
    case("override-empty-key-part", over("train..max_steps=3"), "empty key part",
         "section.key=value"),
    case("override-below-a-value", over("train.max_steps.x=1"), "'max_steps' is not a section"),
    # -- value ranges ------------------------------------------------------------------------
    case("train-batch-size-0", over("train.per_device_train_batch_size=0"),
         "'train.per_device_train_batch_size'", "must be >= 1 (got 0)"),
    case("train-batch-size-negative", over("train.per_device_train_batch_size=-4"),
         "'train.per_device_train_batch_size'", "must be >= 1 (got -4)"),
    case("eval-batch-size-0", over("train.per_device_eval_batch_size=0"),
         "'train.per_device_eval_batch_size'", "must be >= 1"),
    case("gradient-accumulation-0", over("train.gradient_accumulation_steps=0"),
         "'train.gradient_accumulation_steps'", "must be >= 1"),
    case("max-steps-0", over("train.max_steps=0"), "'train.max_steps'", "-1"),
    case("max-steps-negative", over("train.max_steps=-5"), "'train.max_steps'", "-1"),
    case("num-train-epochs-negative", over("train.num_train_epochs=-1"),
         "'train.num_train_epochs'", "must be >= 0"),
    case("nothing-to-train", over("train.max_steps=-1", "train.num_train_epochs=0"),
         "nothing to train", "train.max_steps"),
    case("logging-steps-negative", over("train.logging_steps=-1"), "'train.logging_steps'",
         "must be >= 0"),
    case("save-steps-negative", over("train.save_steps=-10"), "'train.save_steps'",
         "must be >= 0"),
    case("eval-steps-negative", over("train.eval_steps=-0.5"), "'train.eval_steps'",
         "must be >= 0"),
    case("save-total-limit-0", over("train.save_total_limit=0"), "'train.save_total_limit'",
         "must be >= 1"),
    case("save-total-limit-negative", over("train.save_total_limit=-2"),
         "'train.save_total_limit'", "must be >= 1"),
    case("learning-rate-negative", over("optim.learning_rate=-0.001"),
         "'optim.learning_rate'", "must be >= 0"),
    case("warmup-ratio-above-1", over("optim.warmup_ratio=1.5"), "'optim.warmup_ratio'",
         "must be <= 1"),
    case("warmup-steps-negative", over("optim.warmup_steps=-3"), "'optim.warmup_steps'",
         "whole step count"),
    case("hidden-size-0", over("model.hidden_size=0"), "'model.hidden_size'", "must be >= 1"),
    case("attention-heads-0", over("model.num_attention_heads=0"),
         "'model.num_attention_heads'", "must be >= 1"),
    case("kv-heads-0", over("model.num_key_value_heads=0"), "'model.num_key_value_heads'",
         "must be >= 1"),
    case("heads-do-not-divide-hidden-size", over("model.hidden_size=33"),
         "hidden_size (33) must be a multiple of num_attention_heads (2)", "head_dim"),
    case("kv-heads-do-not-divide-heads",
         over("model.num_attention_heads=4", "model.num_key_value_heads=3"),
         "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    # tensor / context parallelism: refused before any process group work
    case("tensor-parallel-does-not-divide-the-mlp-width",
         over("parallel.tensor_parallel=3", "model.num_attention_heads=6",
              "model.num_key_value_heads=3", "model.hidden_size=36"),
         "parallel.tensor_parallel=3 does not divide model.intermediate_size=64"),
    case("tensor-parallel-does-not-divide-query-heads", over("parallel.tensor_parallel=4"),
         "parallel.tensor_parallel=4 does not divide model.num_attention_heads=2",
         "use a tensor_parallel degree that divides it"),
    case("tensor-parallel-does-not-divide-kv-heads", over("parallel.tensor_parallel=2"),
         "parallel.tensor_parallel=2 does not divide model.num_key_value_heads=1"),
    case("tensor-parallel-above-the-world-size",
         over("parallel.tensor_parallel=2", "model.num_key_value_heads=2"),
         "parallel.tensor_parallel=2 does not divide the world size 1",
         "launch a multiple of 2 processes or lower it"),
    case("tensor-parallel-on-a-wrapped-hf-model",
         over("parallel.tensor_parallel=2", "model.model_type=bert"),
         "parallel.tensor_parallel=2 needs a native decoder", "wrapped HF model"),
    case("tensor-parallel-with-lora", over("parallel.tensor_parallel=2", "model.lora=true"),
         "parallel.tensor_parallel=2 does not combine with model.lora"),
    case("tensor-parallel-with-the-full-logits-loss",
         over("parallel.tensor_parallel=2", "model.loss_implementation=full"),
         "parallel.tensor_parallel=2 splits the LM head by vocabulary",
         "use loss_implementation chunked"),
    case("loss-implementation-unknown", over("model.loss_implementation=fused"),
         "'model.loss_implementation'", "Input should be 'chunked' or 'full' (got 'fused')"),
    case("tensor-parallel-0", over("parallel.tensor_parallel=0"), "'parallel.tensor_parallel'",
         "must be >= 1"),
    case("context-parallel-does-not-divide-query-heads", over("parallel.context_parallel=4"),
         "parallel.context_parallel=4 does not divide model.num_attention_heads=2",
         "pick a divisor of 2"),
    case("context-parallel-and-kv-heads-do-not-divide",
         over("parallel.context_parallel=2", "model.num_attention_heads=6",
              "model.num_key_value_heads=3", "model.head_dim=8"),
         "parallel.context_parallel=2 and model.num_key_value_heads=3: neither divides the other"),
    case("context-parallel-does-not-divide-the-row-length",
         over("parallel.context_parallel=2", "data.packing_length=21"),
         "parallel.context_parallel=2 does not divide data.packing_length=21",
         "use a multiple of 2"),
    case("context-parallel-above-the-world-size", over("parallel.context_parallel=2"),
         "parallel.context_parallel=2 does not divide the world size 1",
         "launch a multiple of 2 processes"),
    case("context-parallel-on-a-wrapped-hf-model",
         over("parallel.context_parallel=2", "model.model_type=bert"),
         "parallel.context_parallel=2 needs a native decoder", "set parallel.context_parallel=1"),
    case("context-parallel-with-a-per-batch-objective",
         over("parallel.context_parallel=2", "diffusion.objective=dream"),
         "parallel.context_parallel=2 needs an objective that draws each row's noise on its own",
         "'dream'"),
    case("context-parallel-with-per-row-normalization",
         over("parallel.context_parallel=2", "diffusion.loss_normalization=answer_padded"),
         "parallel.context_parallel=2 needs diffusion.loss_normalization token"),
    case("context-parallel-with-a-sampler-at-inference",
         over("parallel.context_parallel=2", "eval.generate_accuracy=true"),
         "parallel.context_parallel=2 splits training forwards only",
         "set eval.generate_accuracy=false"),
    case("context-parallel-0", over("parallel.context_parallel=0"), "'parallel.context_parallel'",
         "must be >= 1"),
    case("sequence-parallel-without-tensor-parallel", over("parallel.sequence_parallel=true"),
         "parallel.sequence_parallel: true shards the residual stream over the tensor-parallel "
         "ranks and needs parallel.tensor_parallel >= 2", "sequence_parallel: false"),
    case("sequence-parallel-with-pipeline-parallel",
         over("parallel.sequence_parallel=true", "parallel.tensor_parallel=2",
              "model.num_key_value_heads=2", "parallel.pipeline_parallel=2"),
         "parallel.sequence_parallel: true does not combine with parallel.pipeline_parallel=2"),
    case("sequence-parallel-with-a-sampler-at-inference",
         over("parallel.sequence_parallel=true", "parallel.tensor_parallel=2",
              "model.num_key_value_heads=2", "eval.generate_accuracy=true"),
         "parallel.sequence_parallel: true serves training forwards only",
         "eval.generate_accuracy: true samples with a KV cache"),
    case("layers-negative", over("model.num_hidden_layers=-1"), "'model.num_hidden_layers'",
         "must be >= 1"),
    case("layers-0", over("model.num_hidden_layers=0"), "'model.num_hidden_layers'",
         "must be >= 1"),
    case("intermediate-size-0", over("model.intermediate_size=0"),
         "'model.intermediate_size'", "must be >= 1"),
    case("vocab-size-0", over("model.vocab_size=0"), "'model.vocab_size'", "must be >= 1"),
    case("packing-length-above-positions", over("model.max_position_embeddings=16"),
         "data.packing_length (20)", "max_position_embeddings (16)"),
    case("packing-length-1", over("data.packing_length=1"), "'data.packing_length'",
         "must be >= 2"),
    case("unknown-scheduler", over("optim.lr_scheduler_type=cosin"),
         "'optim.lr_scheduler_type'", "'cosine'"),
    case("unknown-objective", over("diffusion.objective=mdml"), "'diffusion.objective'",
         "'mdlm'"),
    case("unknown-optimizer", over("optim.name=sgd"), "'optim.name'", "'adamw'"),
    case("unknown-reporter", over("train.report_to=tensorbord"), "'tensorbord'",
         "tensorboard"),
    case("mask-probability-above-1", over("diffusion.random_length_prob=1.5"),
         "'diffusion.random_length_prob'", "must be <= 1"),
    case("mask-probability-negative", over("diffusion.prompt_drop_prob=-0.1"),
         "'diffusion.prompt_drop_prob'", "must be >= 0"),
    case("time-eps-0", over("diffusion.time_eps=0"), "'diffusion.time_eps'", "must be > 0"),
    case("async-checkpoint-with-lora", over("model.lora=true", "train.async_checkpoint=true"),
         "train.async_checkpoint does not support model.lora", "train.async_checkpoint=false"),
    # DiffusionGemma: a canvas decoder without [MASK] (docs/diffusion.md, Uniform corruption)
    case("uniform-objective-without-a-canvas-decoder", over("diffusion.objective=uniform"),
         "trains a prompt encoder and canvas decoder", "use a masked objective"),
    case("masked-objective-on-diffusion-gemma", with_config({"model": GEMMA}),
         "has no [MASK] token: diffusion.objective 'mdlm' needs one",
         "diffusion.objective uniform"),
    case("canvas-longer-than-a-row", with_config({
        "model": {**GEMMA, "diffusion_gemma": {"canvas_length": 32}},
        "diffusion": {"objective": "uniform"}}),
        "canvas_length (32) is above data.packing_length (20)", "raise data.packing_length"),
    # -- data files ---------------------------------------------------------------------------
    case("data-unknown-pad-policy", over("data.pad_policy=eoss"), "'data.pad_policy'",
         "'eos', 'single_eos' or 'packed'", "'eoss'"),
    case("data-missing-file",
         lambda ctx: ctx.train({"data": {"dataset": str(ctx.tmp / "no.jsonl")}}),
         "does not exist", "accepted:"),
    case("data-empty-text-file", data_file("empty.txt", ""), "holds 0 documents"),
    case("data-empty-jsonl-file", data_file("empty.jsonl", ""), "holds 0 documents"),
    case("data-binary-as-text", data_file("blob.txt", BINARY), "blob.txt", "not UTF-8 text"),
    case("data-binary-as-jsonl", data_file("blob.jsonl", BINARY), "blob.jsonl",
         "one JSON object per line"),
    case("data-jsonl-bad-line", data_file("bad.jsonl", '{"text": "a"}\n{"text": \n'),
         "bad.jsonl", "line 2 is not valid JSON", "one JSON object per line"),
    case("data-jsonl-missing-text-field", data_file("rows.jsonl", '{"body": "a"}\n'),
         "no 'text' field", "data.text_field"),
    case("preference-pair-without-rejected",
         pair_file("pairs.jsonl", '{"prompt": "rev 12=", "chosen": "21"}\n'), "pairs.jsonl",
         "row 1 has no 'rejected'", "need 'prompt', 'chosen' and 'rejected'"),
    case("preference-pair-without-chosen",
         pair_file("prefs.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                   '{"prompt": "rev 12=", "rejected": "12"}\n'),
         "prefs.jsonl", "row 2 has no 'chosen'"),
    case("preference-pair-without-prompt",
         pair_file("pairs.jsonl", '{"chosen": "21", "rejected": "12"}\n'), "row 1 has no 'prompt'",
         "chat message lists"),
    case("preference-with-random-length",
         with_config({"diffusion": {"objective": "preference", "random_length_prob": 0.1}}),
         "diffusion.random_length_prob: 0"),
    case("data-unknown-extension", data_file("rows.csv", "a,b\n"), "cannot tell the format",
         "data.dataset_format"),
    case("data-missing-eval-file",
         lambda ctx: ctx.train({"data": {"dataset": str(ctx.write("d.txt", "doc\n" * 50)),
                                         "eval_dataset": str(ctx.tmp / "no.txt")}}),
         "no.txt", "does not exist"),
    # -- tokenizer folders ----------------------------------------------------------------------
    case("tokenizer-missing", lambda ctx: ctx.train({"data": {"tokenizer": str(ctx.tmp / "t")}}),
         "data.tokenizer", "does not exist"),
    case("tokenizer-folder-without-files", tokenizer_folder({"notes.txt": "hi"}),
         "holds no tokenizer files", "save_pretrained"),
    case("tokenizer-corrupt-json", tokenizer_folder({"tokenizer.json": "{not json"}),
         "data.tokenizer", "cannot load", "save_pretrained"),
    case("tokenizer-json-of-something-else", tokenizer_folder({"tokenizer.json": '{"a": 1}'}),
         "data.tokenizer", "cannot load", "save_pretrained"),
    # -- pretrained model folders --------------------------------------------------------------
    case("pretrained-missing", lambda ctx: ctx.train({"model": {"pretrained": str(ctx.tmp / "m")}}),
         "does not exist", "model.pretrained"),
    case("pretrained-truncated-weights",
         pretrained(lambda folder: truncate(folder / "model.safetensors")),
         "model.safetensors", "damaged", "re-export"),
    case("pretrained-corrupt-config",
         pretrained(lambda folder: (folder / "config.json").write_text("{oops")),
         "config.json", "not valid JSON"),
    case("pretrained-unknown-model-type",
         pretrained(lambda folder: (folder / "config.json").write_text('{"model_type": "gpt9"}')),
         "model_type 'gpt9' is not supported", "qwen3"),
    case("pretrained-config-bad-value", pretrained(lambda folder: edit_json(
        folder / "config.json", num_hidden_layers=0)),
         "config.json", "'num_hidden_layers': must be >= 1"),
    case("pretrained-weights-of-another-shape", pretrained(lambda folder: edit_json(
        folder / "config.json", intermediate_size=96)),
         "do not match config.json", "(32, 64) there, (32, 96) in the model"),
    case("pretrained-no-weights",
         pretrained(lambda folder: (folder / "model.safetensors").unlink()),
         "no weights", "model.safetensors"),
    case("pretrained-packing-length-above-positions",
         lambda ctx: ctx.train({"model": {"pretrained": str(ctx.model())},
                                "data": {"packing_length": 5000}}),
         "data.packing_length (5000)", "max_position_embeddings (4096)"),
    # -- checkpoints to resume from -------------------------------------------------------------
    case("resume-missing", lambda ctx: ctx.resume(ctx.tmp / "checkpoint-9"), "does not exist",
         "true for the newest"),
    case("resume-not-a-checkpoint", lambda ctx: ctx.resume(ctx.write("empty/x", "").parent),
         "not a complete unmask checkpoint"),
    case("resume-truncated-model", resume_damaged("model.safetensors", "truncate"),
         "is damaged", "model.safetensors"),
    case("resume-missing-optimizer", resume_damaged("optimizer.pt", "remove"),
         "optimizer.pt is missing", "resume from an older one"),
    case("resume-missing-rng-state", resume_damaged("rng_state.pt", "remove"),
         "rng_state.pt is missing", "resume from an older one"),
    case("resume-corrupt-trainer-state", resume_damaged("trainer_state.json", "junk"),
         "is damaged (trainer_state.json", "resume from an older one"),
    case("resume-corrupt-manifest", resume_damaged("manifest.json", "junk"),
         "manifest.json is not readable", "resume from an older one"),
    case("resume-no-manifest-truncated-model",
         resume_damaged("model.safetensors", "truncate", manifest=False),
         "model.safetensors", "resume from an older one"),
    case("resume-no-manifest-missing-optimizer",
         resume_damaged("optimizer.pt", "remove", manifest=False),
         "optimizer.pt is missing", "resume from an older one"),
    case("resume-no-manifest-missing-rng-state",
         resume_damaged("rng_state.pt", "remove", manifest=False), "rng_state.pt is missing",
         "resume from an older one"),
    case("resume-no-manifest-truncated-optimizer",
         resume_damaged("optimizer.pt", "truncate", manifest=False),
         "optimizer.pt cannot be read", "resume from an older one"),
    case("resume-no-manifest-corrupt-trainer-state",
         resume_damaged("trainer_state.json", "junk", manifest=False),
         "trainer_state.json is not valid JSON", "resume from an older one"),
    case("resume-other-optimizer",
         lambda ctx: ctx.resume(ctx.checkpoint(), {"optim": {"name": "muon"}}),
         "optimizer.pt does not match optim", "the config it was written with"),
    case("resume-other-model-shape",
         lambda ctx: ctx.resume(ctx.checkpoint(), {"model": {"intermediate_size": 96}}),
         "does not match the model in the config", "the config it was written with"),
    case("resume-true-damaged-checkpoint-of-a-finished-run",
         resume_run(lambda run: truncate(run / "checkpoint-1" / "model.safetensors")),
         "cannot resume", "checkpoint-1 is damaged (model.safetensors holds",
         "No intact checkpoint is left", "train.overwrite_output_dir=true"),
    case("resume-true-checkpoint-cut-short", resume_run(cut_copy),
         "checkpoint-1 is damaged (no manifest.json or trainer_state.json)"),
    case("resume-true-final-without-checkpoint",
         resume_run(lambda run: shutil.rmtree(run / "checkpoint-1")),
         "holds a finished run's final/ but no checkpoint", "train.overwrite_output_dir=true"),
    case("resume-true-folder-of-other-files",
         lambda ctx: ctx.train(None, f"train.output_dir={ctx.write('mine/notes.txt', 'x').parent}",
                               "train.resume_from_checkpoint=true"),
         "holds no checkpoint, and files no unmask run writes (notes.txt)", "check train.output_dir"),
    # -- output directories -------------------------------------------------------------------
    case("output-dir-is-a-file",
         lambda ctx: ctx.train(None, f"train.output_dir={ctx.write('f', 'x')}"),
         "is a file", "choose a folder"),
    case("output-dir-under-a-file",
         lambda ctx: ctx.train(None, f"train.output_dir={ctx.write('f', 'x') / 'run'}"),
         "is a file", "choose"),
    case("output-dir-read-only-parent", read_only_parent, "no write permission", "choose",
         skip=AS_ROOT),
    case("output-dir-holds-a-run",
         lambda ctx: ctx.train(None, f"train.output_dir={run_dir(ctx)}"), "already holds a run",
         "train.resume_from_checkpoint=true"),
    # -- unmask generate ----------------------------------------------------------------------
    case("generate-missing-model", generate("--prompt", "a", model=False), "is not a folder"),
    case("generate-no-prompts", generate(), "no prompts", "--prompt"),
    case("generate-prompts-file-missing",
         lambda ctx: generate("--prompts", str(ctx.tmp / "p.jsonl"))(ctx), "does not exist"),
    case("generate-prompts-not-json",
         lambda ctx: generate("--prompts", str(ctx.write("p.jsonl", "hello\n")))(ctx),
         "p.jsonl:1", "not JSON", '{"prompt": "..."} per line'),
    case("generate-bad-flag-value", generate("--prompt", "a", "--gen-length", "many"),
         "--gen-length", "'many'"),
    case("generate-auto-cap-below-a-block",
         generate("--prompt", "a", "--gen-length", "auto", "--block-length", "4",
                  "--gen-length-max", "2"),
         "gen_length_max (2) is smaller than one block (block_length 4)", "at least 4"),
    case("generate-auto-cap-past-the-positions",
         generate("--prompt", "a", "--gen-length", "auto", "--block-length", "4",
                  "--gen-length-max", "400000"),
         "gen_length_max=400000 after a prompt of 1 tokens exceeds", "lower gen_length_max"),
    case("generate-negative-temperature", generate("--prompt", "a", "--temperature", "-1"),
         "'temperature'", "-1"),
    case("generate-top-p-above-1", generate("--prompt", "a", "--top-p", "1.5"),
         "'top_p'", "must be <= 1", "1.5"),
    case("generate-top-p-0", generate("--prompt", "a", "--top-p", "0"),
         "'top_p'", "must be > 0"),
    case("generate-negative-eos-penalty", generate("--prompt", "a", "--eos-penalty", "-1"),
         "'eos_penalty'", "must be >= 0"),
    case("generate-hook-raises",
         lambda ctx: generate("--prompt", "a", "--logits-hook", "json:dumps", "--out",
                              str(ctx.tmp / "out.jsonl"))(ctx),
         "logits_hook json:dumps raised at step 0", "TypeError"),
    case("generate-hook-not-importable",
         generate("--prompt", "a", "--tokens-hook", "no_such_module_x:f"),
         "'tokens_hook'", "cannot import module 'no_such_module_x'", "PYTHONPATH"),
    case("generate-hook-not-module-function", generate("--prompt", "a", "--logits-hook", "f"),
         "'logits_hook'", "expected module:function"),
    case("generate-no-end-of-turn-token",
         generate("--prompt", "a", "--confidence-eos-eot-inf", "--gen-length", "4"),
         "confidence_eos_eot_inf", "end-of-turn token id", "<|eot_id|>"),
    case("generate-batch-size-0", generate("--prompt", "a", "--batch-size", "0"),
         "--batch-size", ">= 1"),
    case("generate-out-is-a-folder",
         lambda ctx: generate("--prompt", "a", "--out", str(ctx.write("o/x", "").parent))(ctx),
         "--out", "is a folder"),
    case("generate-mask-id-outside-vocab", generate("--prompt", "a", "--mask-id", "500"),
         "mask token id 500", "--mask-id"),
    case("generate-corrupt-config",
         lambda ctx: ["generate", "--model", str(corrupt_config(ctx.model())), "--prompt", "a"],
         "config.json", "not valid JSON"),
    case("generate-truncated-weights",
         lambda ctx: ["generate", "--model",
                      str(truncate(ctx.model() / "model.safetensors").parent), "--prompt", "a"],
         "model.safetensors", "damaged", "re-export"),
    case("generate-tokenizer-larger-than-vocab",
         lambda ctx: generate("--prompt", "a", "--tokenizer", str(big_tokenizer(ctx)))(ctx),
         "401 tokens, more than the 128", "--tokenizer"),
    # -- unmask eval ------------------------------------------------------------------------
    case("eval-missing-model", lambda ctx: ["eval", "--model", str(ctx.tmp / "m"), "--ppl",
                                            str(ctx.write("t.txt", "x"))], "is not a folder"),
    case("eval-missing-text", lambda ctx: ["eval", "--model", str(ctx.model()), "--ppl",
                                           str(ctx.tmp / "no.txt")], "--ppl", "does not exist"),
    case("eval-empty-text", evaluate(text=""), "holds no tokens", "give a file with text"),
    case("eval-binary-text", evaluate(text=BINARY), "score.txt", "not UTF-8 text"),
    case("eval-context-0", evaluate("--context", "0"), "--context", ">= 1"),
    case("eval-mc-num-0", evaluate("--mc-num", "0"), "--mc-num", ">= 1"),
    case("eval-without-ppl", lambda ctx: ["eval", "--model", str(ctx.model())], "--ppl",
         "unmask eval --help"),
    case("eval-ppl-and-pairs", pairs("--ppl", "x.txt"), "--ppl", "not allowed with"),
    case("eval-pairs-not-json", pairs(text="rev 12=21\n"), "pairs.jsonl:1", "not JSON",
         "--separator"),
    case("eval-pairs-missing-prompt", pairs(text='{"question": "a", "answer": "b"}\n'),
         "no 'prompt' field", "--prompt-field"),
    case("eval-pairs-missing-answer", pairs(text='{"prompt": "a", "label": "b"}\n'),
         "'response or answer'", "--answer-field"),
    case("eval-pairs-field-not-text", pairs(text='{"prompt": "a", "response": 3}\n'),
         "must be strings"),
    case("eval-pairs-empty", pairs(text="\n\n"), "holds no prompt/answer pairs"),
    case("eval-pairs-no-separator", pairs("--separator", "|", text="rev 12=21\n"),
         "pairs.jsonl:1", "no '|'", "--separator"),
    case("eval-pairs-empty-answer", pairs("--separator", "=", text="rev 12=\n"),
         "empty answer"),
    case("eval-pad-without-row-length", pairs("--eos", "pad"), "--eos pad", "--row-length"),
    case("eval-row-length-with-eos-none", pairs("--eos", "none", "--row-length", "16"),
         "--row-length", "--eos pad"),
    case("eval-bad-eos", pairs("--eos", "two"), "--eos", "invalid choice"),
    case("eval-pair-flag-with-ppl", evaluate("--separator", "="), "--separator",
         "apply to --pairs"),
    case("eval-context-with-pairs", pairs("--context", "4"), "--context", "--ppl"),
    case("eval-out-is-a-folder", lambda ctx: pairs("--out", str(ctx.tmp))(ctx), "--out",
         "is a folder"),
    case("eval-unknown-preset", lm_task(preset="chat"), "--preset", "invalid choice",
         "'base', 'instruct'"),
    case("eval-missing-task-file", lambda ctx: ["eval", "--model", str(ctx.model()), "--tasks",
                                                str(ctx.tmp / "tasks" / "no.yaml")],
         "task file", "no.yaml", "does not exist"),
    case("eval-missing-include-path", lm_task("--include-path", "no-such-folder"),
         "--include-path 'no-such-folder' is not a folder"),
    case("eval-task-data-missing", lm_task(data=False), "--tasks", "could not load"),
    case("eval-instruct-likelihood-task", lm_task(kind="multiple_choice", preset="instruct"),
         "task 'toy' is multiple_choice", "--preset base"),
    case("eval-preset-with-ppl", evaluate("--preset", "base"), "--preset",
         "apply to --tasks"),
    case("eval-sampling-flag-with-pairs", pairs("--temperature", "0.5"), "--temperature",
         "apply to --tasks"),
    case("eval-pair-flag-with-tasks", lm_task("--eos", "none"), "--eos",
         "apply to --ppl / --pairs"),
    case("eval-tasks-limit-0", lm_task("--limit", "0"), "--limit must be > 0"),
    case("eval-tasks-seed-negative", lm_task("--seed", "-1"), "--seed", "0..2**32 - 1"),
    case("eval-tasks-num-fewshot-negative", lm_task("--num-fewshot", "-1"), "--num-fewshot",
         ">= 0"),
    case("eval-tasks-missing-model", lambda ctx: ["eval", "--model", str(ctx.tmp / "m"),
                                                  "--tasks", str(ctx.write("t.yaml", "task: t"))],
         "is not a folder"),
    case("eval-tasks-bad-sampling-value", lm_task("--top-p", "2"), "top_p", "<= 1"),
    # -- unmask export ------------------------------------------------------------------------
    case("export-missing-source", lambda ctx: ["export", str(ctx.tmp / "c"), "--out",
                                               str(ctx.tmp / "o")], "is not a folder"),
    case("export-source-without-model", lambda ctx: ["export", str(ctx.write("e/x", "").parent),
                                                     "--out", str(ctx.tmp / "o")],
         "no config.json"),
    case("export-out-not-empty", lambda ctx: ["export", str(ctx.model()), "--out",
                                              str(ctx.write("o/x", "").parent)],
         "is not empty", "--overwrite"),
    case("export-out-is-a-file", lambda ctx: ["export", str(ctx.model()), "--out",
                                              str(ctx.write("o", "x"))], "is a file"),
    case("export-bad-dtype", lambda ctx: ["export", str(ctx.model()), "--out", str(ctx.tmp / "o"),
                                          "--dtype", "int8"], "--dtype", "float32"),
    case("export-corrupt-config",
         lambda ctx: ["export", str(corrupt_config(ctx.model())), "--out", str(ctx.tmp / "o")],
         "config.json", "not valid JSON"),
    case("export-overwrite-with-truncated-weights",
         lambda ctx: ["export", str(truncate(ctx.model() / "model.safetensors").parent),
                      "--out", str(ctx.write("o/keep.txt", "mine").parent), "--overwrite"],
         "model.safetensors", "damaged"),
    case("export-truncated-weights",
         lambda ctx: ["export", str(truncate(ctx.model() / "model.safetensors").parent),
                      "--out", str(ctx.tmp / "o")], "model.safetensors", "damaged"),
    # -- unmask preprocess --------------------------------------------------------------------
    case("preprocess-missing-input",
         lambda ctx: ["preprocess", "--input", str(ctx.tmp / "no.jsonl"), "--output-prefix",
                      str(ctx.tmp / "s"), "--tokenizer", str(ctx.model())],
         "no.jsonl"),
    case("preprocess-output-prefix-under-a-file",
         lambda ctx: preprocess("--output-prefix", str(ctx.write("f", "x") / "s"))(ctx),
         "--output-prefix", "a file"),
    case("preprocess-output-prefix-is-a-folder",
         lambda ctx: preprocess("--output-prefix", str(ctx.write("o/x", "").parent) + "/")(ctx),
         "--output-prefix"),
    case("preprocess-missing-tokenizer",
         lambda ctx: preprocess("--output-prefix", str(ctx.tmp / "s"),
                                tokenizer=lambda c: str(c.tmp / "t"))(ctx),
         "--tokenizer", "does not exist"),
    case("preprocess-not-a-tokenizer",
         lambda ctx: preprocess("--output-prefix", str(ctx.tmp / "s"),
                                tokenizer=lambda c: str(c.write("t/notes.txt", "hi").parent))(ctx),
         "--tokenizer", "holds no tokenizer files"),
    case("preprocess-workers-0",
         lambda ctx: preprocess("--output-prefix", str(ctx.tmp / "s"), "--workers", "0")(ctx),
         "--workers", ">= 1"),
    # -- unmask plot and unmask runs -------------------------------------------------------------
    case("plot-not-a-run-dir", lambda ctx: ["plot", str(ctx.write("r/notes.txt", "").parent)],
         "metrics.jsonl"),
    case("plot-binary-metrics",
         lambda ctx: ["plot", str(ctx.write("r/metrics.jsonl", BINARY).parent)], "metrics.jsonl"),
    case("plot-missing-dir", lambda ctx: ["plot", str(ctx.tmp / "r")], "is not a folder",
         "run directory"),
    case("plot-out-is-a-file", lambda ctx: ["plot", str(run_dir(ctx)), "--out",
                                            str(ctx.write("o", "x"))], "is a file", "folder"),
    case("runs-missing-folder", lambda ctx: ["runs", str(ctx.tmp / "runs")], "does not exist"),
    case("runs-folder-is-a-file", lambda ctx: ["runs", str(ctx.write("runs", ""))], "is a file"),
    # -- unmask serve: refused before it binds a port ------------------------------------------
    case("serve-missing-model", lambda ctx: ["serve", "--model", str(ctx.tmp / "nope")],
         "--model", "is not a folder"),
    case("serve-runs-not-a-folder", lambda ctx: ["serve", "--model", str(ctx.model()), "--runs",
                                                 str(ctx.write("runs", ""))],
         "--runs", "is not a folder"),
    case("serve-prefix-cache-negative", lambda ctx: ["serve", "--model", str(ctx.model()),
                                                     "--prefix-cache-mb", "-1"],
         "--prefix-cache-mb", "must be a number of megabytes >= 0"),
    case("serve-threads-0", lambda ctx: ["serve", "--model", str(ctx.model()), "--threads", "0"],
         "--threads", "must be a whole number >= 1"),
    case("serve-one-thread-below-negative", lambda ctx: ["serve", "--model", str(ctx.model()),
                                                         "--one-thread-below", "-1"],
         "--one-thread-below", "must be a whole number >= 0"),
    # -- grpo: rewards and groups ---------------------------------------------------------------
    case("grpo-group-size-1", grpo([{"fn": "exact_match"}], group_size=1), "'grpo.group_size'",
         "must be >= 2"),
    case("grpo-no-rewards", grpo([]), "needs rewards", "rewards: [{fn: exact_match}]"),
    case("grpo-reward-not-importable", grpo([{"fn": "no_such_module:score"}]),
         "rewards[0]", "no_such_module"),
    case("grpo-reward-raises", grpo([{"fn": "user_rewards:score"}],
                                    "def score(prompt, completion, record):\n"
                                    "    raise KeyError('label')\n"),
         "rewards[0]", "KeyError"),
    case("grpo-reward-not-a-number", grpo([{"fn": "user_rewards:score"}],
                                          "def score(prompt, completion, record):\n"
                                          "    return 'yes'\n"),
         "rewards[0]", "'yes'"),
    case("grpo-kl-without-lora", grpo([{"fn": "exact_match"}], kl_beta=0.1),
         "grpo.kl_beta > 0 needs model.lora: true"),
    case("grpo-on-a-logit-shift-model",
         lambda ctx: ctx.train({"diffusion": {"objective": "grpo"}, "model": {"model_type": "dream"},
                                "rewards": [{"fn": "exact_match"}]}),
         "grpo does not support logit-shift models (Dream)", "qwen3"),
    # -- unmask plan -----------------------------------------------------------------------------
    case("plan-unknown-device",
         lambda ctx: ["plan", str(ctx.config(None)), "--world", "2", "--device", "h1000"],
         "--device 'h1000' is not a device the planner knows", "h100"),
    case("plan-world-the-mesh-cannot-factor",
         lambda ctx: ["plan", str(ctx.config(None)), "parallel.tensor_parallel=4",
                      "model.num_attention_heads=4", "model.num_key_value_heads=4", "--world", "6"],
         "does not divide the world size 6"),
    case("plan-sequence-parallel",
         lambda ctx: ["plan", str(ctx.config(None)), "parallel.tensor_parallel=2",
                      "parallel.sequence_parallel=true", "--world", "2"],
         "unmask plan does not model parallel.sequence_parallel yet",
         "parallel.sequence_parallel=false"),
    case("plan-layout-that-does-not-fit",
         lambda ctx: ["plan", str(ctx.config({"model": {"hidden_size": 4096,
                                                        "intermediate_size": 16384,
                                                        "num_hidden_layers": 48,
                                                        "num_attention_heads": 32,
                                                        "num_key_value_heads": 8}})),
                      "--world", "1", "--device", "a100"],
         "the layout does not fit", "largest term is", "--world"),
    # -- the command line itself ---------------------------------------------------------------
    case("cli-unknown-command", lambda ctx: ["trian"], "invalid choice: 'trian'",
         "unmask --help"),
    case("cli-no-command", lambda ctx: [], "command", "unmask --help"),
    case("cli-unknown-flag", lambda ctx: ["train", "--bogus"], "--bogus",
         "unmask train --help"),
    case("cli-missing-required-flag", lambda ctx: ["generate", "--prompt", "a"], "--model",
         "unmask generate --help"),
    case("cli-bad-choice", lambda ctx: ["preprocess", "--input", "a", "--output-prefix", "b",
                                        "--tokenizer", "c", "--on-bad-record", "ignore"],
         "--on-bad-record", "'ignore'"),
]
# fmt: on


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def corrupt_config(folder: Path) -> Path:
    (folder / "config.json").write_text("{oops")
    return folder


def big_tokenizer(ctx) -> Path:
    """The char tokenizer with 200 more tokens than the tiny model's vocabulary."""
    from unmask.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_tokens([f"<extra{i}>" for i in range(300)])
    folder = ctx.tmp / "big_tok"
    tok.save_pretrained(str(folder))
    return folder


def snapshot(root: Path) -> dict:
    """Every file (bytes) and folder under root."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize(("build", "expect"), CASES)
def test_bad_input_is_refused(
    build, expect, tmp_path, tiny_config, trained, model_folder, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a relative default output_dir lands where it is seen
    argv = build(Ctx(tmp_path, tiny_config, trained, model_folder))
    before = snapshot(tmp_path)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert 1 <= len(lines) <= 3, err
    assert "Traceback" not in err
    for part in expect:
        assert part in err, (part, err)
    assert snapshot(tmp_path) == before


def test_debug_shows_the_traceback(tiny_config, tmp_path):
    """--debug: the traceback, then the same one line and exit code 2; without it, no
    traceback (a real process, as a user runs it)."""
    config = str(tiny_config({"train": {"max_steps": 0}}))
    runs = {}
    for flags in ([], ["--debug"]):
        runs[bool(flags)] = subprocess.run(
            [sys.executable, "-m", "unmask", *flags, "train", config],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    plain, debug = runs[False], runs[True]
    assert plain.returncode == debug.returncode == 2
    assert "Traceback" not in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()
    assert not (tmp_path / "run").exists()


#: the catalogue's layout cases, and layouts of pipeline and expert parallelism. Left out:
#: what the planner cannot plan at all, each refused in its own line before any layout
#: (sequence parallelism; a wrapped transformers encoder: "the planner plans native decoders")
LAYOUT_CASES = [
    *(c for c in CASES if c.id.startswith(("tensor-parallel", "context-parallel",
                                           "packing-length-above"))
      and not c.id.endswith("wrapped-hf-model")),
    case("pipeline-with-tied-embeddings",
         over("parallel.pipeline_parallel=2", "model.tie_word_embeddings=true"),
         "parallel.pipeline_parallel=2 puts the embedding on the first stage"),
    case("pipeline-with-lora", over("parallel.pipeline_parallel=2", "model.lora=true"),
         "parallel.pipeline_parallel=2 does not combine with model.lora"),
    case("pipeline-above-the-world-size", over("parallel.pipeline_parallel=2"),
         "does not divide the world size 1"),
    case("expert-parallel-on-a-dense-model", over("parallel.expert_parallel=2"),
         "parallel.expert_parallel=2 needs a mixture-of-experts model"),
    # issue 54: family cases the trainer and the planner once refused in different lines
    case("pipeline-on-diffusion-gemma",
         lambda ctx: ctx.train({"model": {**GEMMA, "tie_word_embeddings": True},
                                "diffusion": {"objective": "uniform"}},
                               "parallel.pipeline_parallel=2"),
         "parallel.pipeline_parallel=2: model_type 'diffusion_gemma' has no pipeline stages"),
    case("4-bit-without-lora", over("model.load_in_4bit=true"),
         "model.load_in_4bit: true trains LoRA adapters on a frozen 4-bit base",
         "set model.lora: true"),
    case("float8-without-bf16", over("train.float8=true", "train.bf16=false"),
         "train.float8: true trains the linear layers in float8 beside a bf16 model"),
    # issue 56: a trained or LoRA-adapted vision tower on a folder without one (the planner
    # once planned it, the trainer refused it after loading the model)
    case("freeze-vision-on-a-folder-without-a-tower",
         lambda ctx: ctx.train({"model": {"pretrained": str(ctx.model_folder),
                                          "freeze_vision": False}}),
         "model.freeze_vision / a vision LoRA target needs a diffusion_gemma folder"),
    case("vision-lora-on-a-folder-without-a-tower",
         lambda ctx: ctx.train({"model": {"pretrained": str(ctx.model_folder), "lora": True,
                                          "lora_target_modules": ["q_proj", "vision_tower"]}}),
         "model.freeze_vision / a vision LoRA target needs a diffusion_gemma folder"),
]  # fmt: skip


@pytest.mark.parametrize("build, expect", LAYOUT_CASES)
def test_the_planner_refuses_a_bad_layout_in_the_trainers_line(
    build, expect, tmp_path, tiny_config, trained, model_folder, capsys, monkeypatch
):
    """`unmask plan` and `unmask train` check a layout with the same function
    (train/setup.py plan_parallel): the same exit code and the same line (the planner's
    only line)."""
    monkeypatch.chdir(tmp_path)
    argv = build(Ctx(tmp_path, tiny_config, trained, model_folder))
    assert argv[0] == "train"
    errors = {}
    for command in (argv, ["plan", *argv[1:], "--world", "1", "--device", "cpu"]):
        capsys.readouterr()
        assert main(command) == 2, command
        err = capsys.readouterr().err
        errors[command[0]] = [line for line in err.splitlines() if line.startswith("unmask: error")]
        if command[0] == "plan":  # the refusal alone (no notice repeating it before)
            assert err.strip().splitlines() == errors["plan"], err
    assert len(errors["train"]) == 1 and errors["plan"] == errors["train"], errors
    for part in expect:
        assert part in errors["plan"][0], (part, errors)
