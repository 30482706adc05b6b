"""Every recipe trains: each objective/family for 50 CPU steps with eval loss falling >= 20%,
LMMs-Engine's real DLLM example configs (their key sets, tests/seed_examples.py) with the
start-up line of keys that have no effect, the LMMs-Engine seed config through every entry
point, the Transformer Lab Dream config, and the seed-schema errors (one line, exit code 2)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import read_metrics
from seed_examples import EXAMPLES, NO_EFFECT_PREFIX, no_effect_keys, write_docs, write_example

from unmask.cli import main
from unmask.config import load_config
from unmask.train.trainer import Trainer

CONFIG_EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "examples"

RECIPES = {
    "mdlm": {"diffusion": {"objective": "mdlm", "t_sampling": "antithetic"}},
    "llada_random_length": {"diffusion": {"objective": "llada", "random_length_prob": 0.5}},
    "sft": {"diffusion": {"objective": "sft", "prompt_drop_prob": 0.1}},
    "dream_cart": {
        "model": {"model_type": "dream"},
        "diffusion": {"objective": "dream", "loss_weight": "cart[geo_p:0.3]"},
    },
    "bd3lm": {"diffusion": {"objective": "bd3lm", "block_size": 4}},
    "bert_modernbert": {"model": {"model_type": "modernbert"}, "diffusion": {"objective": "bert"}},
    "bert_bert": {"model": {"model_type": "bert"}, "diffusion": {"objective": "bert"}},
}

SAMPLED_AS = {
    "dream_cart": {"shift_logits": True},
    "bd3lm": {"block_causal": True, "block_length": 4},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_each_objective_trains_50_steps(tiny_config, name):
    extra = {
        "optim": {"learning_rate": 3e-3, "warmup_steps": 5},
        "train": {"max_steps": 50, "eval_steps": 0, "save_steps": 0, "eval_max_batches": 1},
        **RECIPES[name],
    }
    trainer = Trainer(load_config(tiny_config(extra)))
    before = trainer.evaluate()
    after = trainer.train()["eval_loss"]
    assert after <= 0.8 * before, (name, before, after)
    # final/ says how the model must be sampled; `unmask generate` and export pick it up
    if "bert" in name:
        return
    from unmask.checkpoint import export_model
    from unmask.sampling.config import resolve_sampling
    from unmask.sampling.generation_file import saved_sampling

    run = Path(trainer.cfg.train.output_dir)
    expected = SAMPLED_AS.get(name, {})
    for folder in (run / "final", export_model(run / "final", run / "exported")):
        defaults = resolve_sampling(saved_sampling(folder))
        assert defaults.shift_logits == expected.get("shift_logits", False), folder
        assert defaults.block_causal == expected.get("block_causal", False), folder
        if "block_length" in expected:
            assert defaults.block_length == expected["block_length"]


@pytest.fixture
def lmms_config(tmp_path):
    data = write_docs(tmp_path / "data" / "fineweb_edu_sample")
    tree = yaml.safe_load((CONFIG_EXAMPLES / "lmms_engine_dllm.yaml").read_text())
    tree["dataset_config"]["dataset_path"] = str(data)
    path = tmp_path / "dllm_train_muon_single_gpu.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_lmms_engine_seed_schema_maps_every_field(lmms_config):
    cfg = load_config(lmms_config)
    assert cfg.model.model_type == "qwen3_dllm" and cfg.model.hidden_size == 32
    assert cfg.optim.name == "muon" and cfg.optim.weight_decay == 0.01
    assert cfg.optim.adam_epsilon == 1e-8 and cfg.optim.warmup_steps == 1
    assert cfg.data.packing_length == 64 and cfg.data.dataset.endswith("fineweb_edu_sample")
    assert cfg.train.per_device_train_batch_size == 4
    assert cfg.train.gradient_accumulation_steps == 2 and cfg.train.max_steps == 3


@pytest.mark.slow
def test_lmms_engine_seed_config_runs_through_every_entry_point(lmms_config, tmp_path, monkeypatch):
    for i, argv in enumerate(
        (["train", str(lmms_config)], ["train", "--config", str(lmms_config)])
    ):
        cwd = tmp_path / f"cwd{i}"
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        assert main(argv) == 0
        assert (cwd / "runs" / lmms_config.stem / "final" / "model.safetensors").is_file()
    cwd = tmp_path / "cwd_module"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "unmask", "train", "--config", str(lmms_config)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = (cwd / "runs" / lmms_config.stem / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in metrics if "loss" in json.loads(r)][-1] == 3


@pytest.mark.slow
def test_transformer_lab_dream_config_runs(tmp_path):
    tree = yaml.safe_load((CONFIG_EXAMPLES / "transformer_lab_dream.yaml").read_text())
    tree["train"]["output_dir"] = str(tmp_path / "run")
    tree["train_steps"] = 12  # the example's 50 steps are covered by dream_cart above
    path = tmp_path / "tl.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(path)
    assert (cfg.diffusion.objective, cfg.diffusion.loss_weight) == ("dream", "cart[geo_p:0.3]")
    assert cfg.model.model_type == "dream" and cfg.train.run_name == "dream-tiny"
    assert cfg.train.logging_steps == 0.2 and cfg.optim.lr_scheduler_type == "cosine"
    trainer = Trainer(cfg)
    before = trainer.evaluate()
    after = trainer.train()["eval_loss"]
    assert after < before and trainer.step == 12
    written = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert written["model_type"] == "Dream"


def _run(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_real_lmms_engine_examples_run_as_they_are(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = main(["train", str(write_example(name, tmp_path))]), capsys.readouterr()
    assert code == 0, out.err[-2000:]
    lines = [line for line in out.out.splitlines() if line.startswith(NO_EFFECT_PREFIX)]
    assert len(lines) == 1 and sorted(no_effect_keys(lines[0])) == sorted(EXAMPLES[name].no_effect)
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r][-1] == 3
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "tensorboard").is_dir()  # report_to


def _set(path: str, value):
    """A change to an example's tree: set trainer argument or section key `path`."""

    def change(tree):
        node = tree[0]["config"] if isinstance(tree, list) else tree
        *parents, key = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value

    return change


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("dllm_train_muon_single_gpu", _set("trainer_args.sp_ulysses_degree", 2),
         "'trainer_args.sp_ulysses_degree: 2' is not supported: Ulysses sequence (context) "
         "parallelism does not exist in unmask yet"),
        ("dllm_train_muon_multi_gpu_fsdp2", _set("sp_ulysses_degree", 4),
         "'trainer_args.sp_ulysses_degree: 4' is not supported"),
        ("dllm_train_adam_multi_gpu_deepspeed", _set("trainer_args.fp16", True),
         "unmask's only mixed precision is bfloat16; set bf16: true"),
        ("dllm_train_example", _set("label_smoothing_factor", 0.1),
         "'trainer_args.label_smoothing_factor' is not supported by unmask"),
        ("dllm_train_muon_single_gpu", _set("dataset_config.extra_kwargs.collator_type", "default"),
         "unmask trains masked diffusion only (collator_type: dllm)"),
        ("dllm_train_example", _set("dataset_config.processor_config.processor_name", "Qwen/Q"),
         "'Qwen/Q' is not a local folder; unmask loads tokenizers from local folders only"),
        ("dllm_train_muon_single_gpu", _set("trainer_type", "sft_trainer"),
         "trainer_type: sft_trainer"),
        ("dllm_train_muon_single_gpu",
         _set("model_config.load_from_config.config.rope_scaling", {}),
         "'model_config.load_from_config.config.rope_scaling' is not supported"),
    ],
)  # fmt: skip
def test_refused_seed_keys_are_one_line_exit_2_nothing_written(
    tmp_path, capsys, name, change, message
):
    code, err = _run(["train", str(write_example(name, tmp_path, change))], capsys)
    assert code == 2 and len(err) == 1, err
    assert message in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"load_in_4bit": True}, "load_in_4bit: true trains LoRA adapters on a frozen 4-bit base"),
        ({"training_method": "mdm"}, "training_method: 'mdm' is not supported"),
        ({"train_device": "tpu"}, "train_device: 'tpu' is not supported"),
        ({"loss_weight_type": "cart[p:0.3]"}, "unknown loss weight 'cart[p:0.3]'"),
        ({"training_method": "dream", "lora_rank": 8}, "unknown config key 'lora_rank'"),
    ],
)
def test_transformer_lab_errors_are_one_line_exit_2(tiny_config, tmp_path, capsys, extra, message):
    if shutil.which("nvidia-smi") and "load_in_4bit" in extra:
        pytest.skip("a CUDA machine may have bitsandbytes")
    code, err = _run(["train", str(tiny_config(extra))], capsys)
    assert code == 2 and len(err) == 1, err
    assert message in err[0]
    assert not (tmp_path / "run").exists()


def test_mask_token_id_comes_from_the_model_folders_config(tiny_config, tmp_path, capsys):
    from conftest import save_tiny_model

    from unmask.checkpoint import load_for_sampling

    folder = save_tiny_model(tmp_path / "llada_like")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mask_token_id": 10}))
    extra = {"model": {"pretrained": str(folder)}, "data": {"tokenizer": str(folder)}}
    trainer = Trainer(load_config(tiny_config({**extra, "train": {"max_steps": 1}})))
    assert trainer.tokenizer.mask_token_id == 10 and trainer.objective.mask_id == 10
    assert len(trainer.tokenizer) == len(load_for_sampling(folder).tokenizer)  # none added
    assert load_for_sampling(folder).mask_id == 10  # config.json wins over the tokenizer
    assert load_for_sampling(folder, mask_id=5).mask_id == 5  # --mask-id wins over both
    (folder / "config.json").write_text(json.dumps({**config, "mask_token_id": 10_000}))
    extra["train"] = {"output_dir": str(tmp_path / "other")}
    code, err = _run(["train", str(tiny_config(extra, name="bad.yaml"))], capsys)
    assert code == 2 and len(err) == 1, err
    assert "mask_token_id 10000 is outside the tokenizer's" in err[0]
