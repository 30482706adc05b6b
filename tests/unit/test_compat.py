"""Seed-schema adapters: every Transformer Lab / LMMs-Engine field lands on its unmask key,
unsupported ones are errors naming them, native trees pass through unchanged."""

import pytest

from unmask.config import validate_tree
from unmask.config.compat import translate
from unmask.errors import InputError


def test_native_tree_is_untouched():
    tree = {"model": {"hidden_size": 32}, "train": {"max_steps": 3}}
    assert translate(tree) is tree


def test_transformer_lab_fields_map_onto_unmask_keys():
    tree = {
        "training_method": "llada",
        "train_device": "cpu",
        "gpu_ids": "auto",
        "max_length": 128,
        "dtype": "bfloat16",
        "learning_rate": 2e-5,
        "learning_rate_schedule": "constant_with_warmup",
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
    cfg = validate_tree(translate(tree))
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
    cfg = validate_tree(translate({"training_method": method}))
    assert (cfg.diffusion.objective, cfg.diffusion.loss_weight) == (objective, weight)
    assert cfg.model.model_type == family


def test_explicit_native_values_win_over_training_method():
    tree = {
        "training_method": "dream",
        "loss_weight_type": "scheduler",
        "model": {"model_type": "qwen2_dllm"},
    }
    cfg = validate_tree(translate(tree))
    assert cfg.diffusion.loss_weight == "scheduler" and cfg.model.model_type == "qwen2_dllm"
    cfg = validate_tree(translate({"training_method": "bert", "model": {"pretrained": "x"}}))
    assert cfg.model.model_type == "qwen3_dllm"  # the folder's config.json decides


def test_lmms_engine_split_batches_and_fsdp2_reach_train():
    tree = {
        "trainer_type": "dllm_trainer",
        "trainer_args": {"fsdp2": False, "accelerator_config": {"split_batches": True}},
    }
    cfg = validate_tree(translate(tree))
    assert cfg.train.fsdp2 is False and cfg.train.split_batches is True


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"trainer_args": {"deepspeed": "ds.json"}}, "'trainer_args.deepspeed' is not supported"),
        ({"trainer_args": {"learning_rat": 1}}, "(did you mean 'learning_rate'?)"),
        ({"dataset_config": {"extra_kwargs": {"collator_type": "vlm"}}}, "collator_type: vlm"),
        ({"gpu_ids": "0,1"}, "gpu_ids: '0,1' is not supported"),
        ({"dtype": "float16"}, "dtype: 'float16' is not supported"),
    ],
)
def test_unsupported_fields_name_themselves(tree, message):
    with pytest.raises(InputError, match=None) as info:
        translate(tree)
    assert message in str(info.value)


def test_native_keys_win_over_seed_spellings():
    seed = {"trainer_args": {"use_muon": True, "accelerator_config": {"split_batches": True}}}
    cfg = validate_tree(translate(seed))
    assert cfg.optim.name == "muon" and cfg.train.split_batches is True
    native = {**seed, "optim": {"name": "adamw"}, "train": {"split_batches": False}}
    cfg = validate_tree(translate(native))
    assert cfg.optim.name == "adamw" and cfg.train.split_batches is False
    with pytest.raises(InputError, match=r"accelerator_config.split_batch' is not supported by "
                       r"unmask \(did you mean 'split_batches'\?\)"):  # fmt: skip
        translate({"trainer_args": {"accelerator_config": {"split_batch": True}}})
