"""Seed-schema adapters: every Transformer Lab / LMMs-Engine field lands on its unmask key,
is listed once as having no effect, or is an error naming it and the reason; native trees
pass through unchanged."""

from pathlib import Path

import pytest
from seed_examples import EXAMPLES, example_tree, no_effect_keys

import unmask.config.compat.lmms_engine as lmms_engine
from unmask.config import validate_tree
from unmask.config.compat import sections_to_tree, translate
from unmask.config.compat.transformer_lab import TL_KEYS
from unmask.errors import InputError


def load(tree):
    translated = translate(tree)
    return validate_tree(translated.tree, translated.notices)


def test_native_tree_is_untouched():
    tree = {"model": {"hidden_size": 32}, "train": {"max_steps": 3}}
    translated = translate(tree)
    assert translated.tree is tree and translated.notices == []


def test_transformer_lab_fields_map_onto_unmask_keys():
    tree = {
        "training_method": "llada",
        "train_device": "cpu",
        "gpu_ids": "auto",
        "max_length": 128,
        "dtype": "bfloat16",
        "learning_rate": 2e-5,
        "learning_rate_schedule": "constant-with-warmup",  # the plugin's spelling
        "warmup_ratio": 0.1,
        "num_train_epochs": 0,
        "train_steps": 200,
        "batch_size": 4,
        "gradient_accumulation_steps": 8,
        "logging_steps": 0.01,
        "eval_steps": 0.25,
        "save_steps": 0.5,
        "lora": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.1,
        "mask_prompt_loss": True,
        "perbatch_cutoff": False,
        "resp_cutoff_ratio": 0.1,
        "adaptor_name": "my-adaptor",
        "log_to_wandb": True,
    }
    cfg = load(tree)
    assert (cfg.diffusion.objective, cfg.model.model_type) == ("sft", "llada")
    assert cfg.train.device == "cpu" and cfg.train.bf16 and cfg.data.packing_length == 128
    assert cfg.optim.learning_rate == 2e-5 and cfg.optim.warmup_ratio == 0.1
    assert cfg.optim.lr_scheduler_type == "constant_with_warmup"
    assert cfg.train.max_steps == 200 and cfg.train.num_train_epochs == 0
    assert cfg.train.per_device_train_batch_size == 4
    assert cfg.train.gradient_accumulation_steps == 8
    assert (cfg.train.logging_steps, cfg.train.eval_steps, cfg.train.save_steps) == (
        0.01,
        0.25,
        0.5,
    )
    assert (cfg.model.lora, cfg.model.lora_r, cfg.model.lora_alpha) == (True, 16, 32)
    assert cfg.model.lora_dropout == 0.1 and cfg.model.adaptor_name == "my-adaptor"
    assert cfg.diffusion.resp_cutoff_ratio == 0.1 and cfg.train.report_to == ["wandb"]


@pytest.mark.parametrize(
    "method, objective, weight, family",
    [
        ("dream", "dream", "cart[geo_p:0.3]", "dream"),
        ("llada", "sft", "inverse_t", "llada"),
        ("bert", "bert", "inverse_t", "modernbert"),
    ],
)
def test_training_method_sets_family_objective_and_weight(method, objective, weight, family):
    cfg = load({"training_method": method})
    assert (cfg.diffusion.objective, cfg.diffusion.loss_weight) == (objective, weight)
    assert cfg.model.model_type == family


def test_explicit_native_values_win_over_training_method():
    tree = {
        "training_method": "dream",
        "loss_weight_type": "scheduler",
        "model": {"model_type": "qwen2_dllm"},
    }
    cfg = load(tree)
    assert cfg.diffusion.loss_weight == "scheduler" and cfg.model.model_type == "qwen2_dllm"
    cfg = load({"training_method": "bert", "model": {"pretrained": "x"}})
    assert cfg.model.model_type == "qwen3_dllm"  # the folder's config.json decides


def test_lmms_engine_split_batches_and_fsdp2_reach_train():
    tree = {
        "trainer_type": "dllm_trainer",
        "trainer_args": {"fsdp2": False, "accelerator_config": {"split_batches": True}},
    }
    cfg = load(tree)
    assert cfg.parallel.fsdp2 is False and cfg.train.split_batches is True


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"trainer_args": {"label_smoothing_factor": 0.1}}, "'trainer_args.label_smoothing"),
        ({"trainer_args": {"learning_rat": 1}}, "(did you mean 'learning_rate'?)"),
        ({"trainer_args": {"sp_ulysses_degree": 2}}, "sp_ulysses_degree: 2' is not supported: "
         "Ulysses sequence (context) parallelism does not exist in unmask yet"),
        ({"trainer_args": {"fp16": True}}, "unmask's only mixed precision is bfloat16"),
        ({"trainer_args": {"tp_degree": 4}}, "unmask has no tensor parallelism"),
        ({"trainer_args": {"eval_strategy": "sometimes"}}, "use one of no, steps, epoch"),
        ({"dataset_config": {"extra_kwargs": {"collator_type": "default"}}},
         "collator_type: default' is not supported: unmask trains masked diffusion only"),
        ({"dataset_config": {"dataset_type": "vision"}}, "reads plain-text documents"),
        ({"dataset_config": {"dataset_format": "csv"}}, "dataset_format: csv"),
        ({"dataset_config": {"processor_config": {"processor_name": "Qwen/Qwen3-0.6B"}}},
         "processor_name: 'Qwen/Qwen3-0.6B' is not a local folder; unmask loads tokenizers "
         "from local folders only"),
        ({"dataset_config": {"processor_config": {"processor_type": "qwen2_5_vl"}}},
         "unmask trains text models"),
        ({"gpu_ids": "0,1"}, "gpu_ids: '0,1' is not supported: unmask uses one process per"),
        ({"dtype": "float16"}, "dtype: 'float16' is not supported: unmask's only mixed"),
        ({"train_device": "tpu"}, "train_device: 'tpu' is not supported: unmask trains on"),
    ],
)  # fmt: skip
def test_unsupported_fields_name_themselves_and_the_reason(tree, message):
    with pytest.raises(InputError) as info:
        translate(tree)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_native_keys_win_over_seed_spellings():
    seed = {"trainer_args": {"use_muon": True, "accelerator_config": {"split_batches": True}}}
    cfg = load(seed)
    assert cfg.optim.name == "muon" and cfg.train.split_batches is True
    native = {**seed, "optim": {"name": "adamw"}, "train": {"split_batches": False}}
    cfg = load(native)
    assert cfg.optim.name == "adamw" and cfg.train.split_batches is False
    with pytest.raises(InputError, match=r"accelerator_config.split_batch' is not supported by "
                       r"unmask \(did you mean 'split_batches'\?\)"):  # fmt: skip
        translate({"trainer_args": {"accelerator_config": {"split_batch": True}}})


# The fields Transformer Lab's Diffusion LLM Trainer documents (its plugin page).
TL_DOCUMENTED = (
    "train_device", "gpu_ids", "training_method", "batch_size", "gradient_accumulation_steps",
    "max_length", "dtype", "load_in_4bit", "lora", "learning_rate", "learning_rate_schedule",
    "warmup_ratio", "num_train_epochs", "train_steps", "logging_steps", "eval_steps",
    "save_steps", "lora_r", "lora_alpha", "lora_dropout", "mask_prompt_loss",
    "perbatch_cutoff", "resp_cutoff_ratio", "loss_weight_type", "adaptor_name", "log_to_wandb",
)  # fmt: skip


def test_every_documented_transformer_lab_field_is_read():
    assert set(TL_DOCUMENTED) <= set(TL_KEYS)
    for schedule in ("constant", "linear", "cosine", "constant-with-warmup"):
        assert load({"learning_rate_schedule": schedule}).optim.lr_scheduler_type == (
            schedule.replace("-", "_")
        )


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_real_lmms_engine_examples_map_every_key(name, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tok").mkdir()
    tree = example_tree(name, tmp_path / "docs", tmp_path / "tok", tmp_path / "run")
    cfg = load(sections_to_tree(tree, "x") if isinstance(tree, list) else tree)
    ex = EXAMPLES[name]
    assert cfg.data.dataset == str(tmp_path / "docs") and not cfg.data.streaming
    assert cfg.data.tokenizer == str(tmp_path / "tok") and cfg.data.packing_length == 64
    assert cfg.optim.name == ("muon" if "use_muon" in ex.trainer_args else "adamw")
    assert cfg.optim.lr_scheduler_type == "cosine" and cfg.optim.weight_decay == 0.01
    assert cfg.train.split_batches is ("accelerator_config" in ex.trainer_args)
    assert cfg.train.report_to == ["tensorboard"] and cfg.train.run_name == "seed-example"
    assert cfg.train.dataloader_num_workers == 0 and cfg.train.bf16
    assert cfg.train.max_steps == 3 and cfg.train.gradient_checkpointing
    assert cfg.train.output_dir == str(tmp_path / "run")
    assert cfg.model.model_type == "qwen3_dllm" and cfg.model.hidden_size == 32
    assert len(cfg.notices) == 1
    assert sorted(no_effect_keys(cfg.notices[0])) == sorted(ex.no_effect)


def test_list_of_sections_reads_as_the_sections_layout():
    config = {"trainer_type": "dllm_trainer", "dataset_config": {}, "model_config": {},
              "max_steps": 3, "trainer_args": {"seed": 1}}  # fmt: skip
    expected = {"trainer_type": "dllm_trainer", "dataset_config": {}, "model_config": {},
                "trainer_args": {"max_steps": 3, "seed": 1}}  # fmt: skip
    for entry in ({"type": "trainer"}, {"task_type": "trainer"}, {}):
        assert sections_to_tree([{**entry, "config": config}], "f") == expected
    for entries, message in (
        ([{"type": "trainer"}, {"type": "trainer"}], "exactly one '- type: trainer' entry"),
        ([{"type": "evaluator", "config": {}}], "section type 'evaluator' is not supported"),
        ([{"type": "trainer", "configs": {}}], "'configs' is not supported"),
    ):
        with pytest.raises(InputError, match=None) as info:
            sections_to_tree(entries, "f")
        assert message in str(info.value)


def test_qwen3_dllm_gets_lmms_engines_defaults_for_fields_left_out():
    tree = {"model_config": {"load_from_config": {"model_type": "qwen3_dllm",
                                                  "config": {"hidden_size": 64}}}}  # fmt: skip
    model = load(tree).model
    assert (model.hidden_size, model.num_hidden_layers, model.vocab_size) == (64, 32, 151936)
    assert (model.num_attention_heads, model.num_key_value_heads, model.head_dim) == (32, 32, 128)
    assert (model.rope_theta, model.max_position_embeddings) == (10000.0, 32768)
    tree["model_config"]["load_from_config"]["config"]["num_attention_heads"] = 8
    tree["model"] = {"head_dim": 16}  # a native key wins
    model = load(tree).model
    assert (model.num_attention_heads, model.num_key_value_heads, model.head_dim) == (8, 8, 16)


def test_training_arguments_with_a_value_unmask_lacks():
    args = {"report_to": ["wandb", "mlflow"], "save_strategy": "no", "save_steps": 50,
            "dataloader_num_workers": 3, "sp_ulysses_degree": 1}  # fmt: skip
    cfg = load({"trainer_args": args})
    assert cfg.train.report_to == ["wandb"] and cfg.train.save_steps == 0
    assert cfg.train.dataloader_num_workers == 3
    keys = no_effect_keys(cfg.notices[0])
    assert keys == ["trainer_args.report_to: mlflow", "trainer_args.sp_ulysses_degree"]
    assert load({"trainer_args": {"report_to": "none"}}).train.report_to == []
    assert load({"trainer_type": "dllm_trainer"}).notices == []


def test_recipes_doc_names_every_lmms_engine_key_unmask_reads():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    section = doc[doc.index("## Seed configs") : doc.index("## SFT data")]
    keys = [*lmms_engine._TRAINER_ARGS, *lmms_engine._NO_EFFECT, *lmms_engine._REFUSED]
    missing = [key for key in keys if f"`{key}`" not in section and f"{key}`" not in section]
    assert not missing
