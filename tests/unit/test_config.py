from pathlib import Path

import pytest
import yaml

from unmask.config import (
    RunConfig,
    dump_config,
    load_config,
    parse_override,
    quickstart_yaml,
    validate_tree,
)
from unmask.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_loads_and_matches_the_shown_copy():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig)
    assert (REPO / "configs" / "quickstart.yaml").read_text() == quickstart_yaml()


def test_overrides_are_yaml_scalars_and_nested():
    assert parse_override("train.max_steps=10") == (["train", "max_steps"], 10)
    assert parse_override("optim.learning_rate=3e-4")[1] in ("3e-4", 3e-4)
    cfg = load_config(None, ["train.max_steps=7", "optim.learning_rate=3e-4", "train.bf16=true"])
    assert cfg.train.max_steps == 7
    assert cfg.optim.learning_rate == pytest.approx(3e-4)
    assert cfg.train.bf16 is True


def test_unknown_key_names_nearest_valid_key():
    with pytest.raises(
        InputError, match=r"unknown config key 'train.max_step' .*'train.max_steps'"
    ):
        load_config(None, ["train.max_step=3"])
    with pytest.raises(InputError, match=r"'optim.learning_rate'"):
        validate_tree({"train": {"learning_rate": 1e-3}})
    with pytest.raises(InputError, match=r"unknown config key 'trian' .*'train'"):
        validate_tree({"trian": {}})


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("optim.lr=1e-3", "optim.learning_rate"),  # HF / PyTorch users type it
        ("train.lr=1e-3", "optim.learning_rate"),  # in the wrong section too
        ("optim.wd=0.1", "optim.weight_decay"),
        ("train.num_epochs=2", "train.num_train_epochs"),
        ("train.batch_size=8", "train.per_device_train_batch_size"),  # not eval.batch_size
        ("data.max_seq_length=64", "data.packing_length"),
        ("optim.grad_clip=1.0", "optim.max_grad_norm"),
        ("model.n_layer=2", "model.num_hidden_layers"),
        ("lr=1e-3", "optim.learning_rate"),  # no section at all
    ],
)
def test_names_from_other_tools_are_refused_with_the_unmask_key(override, meant):
    """Suggestions only: a foreign name is never accepted in place of unmask's."""
    key = override.split("=")[0]
    with pytest.raises(InputError) as err:
        load_config(None, [override])
    assert str(err.value) == f"unknown config key '{key}' (did you mean '{meant}'?)"


def test_every_foreign_name_points_at_a_real_key_and_shadows_none():
    from unmask.config.foreign import _NAMES_OF, FOREIGN_KEYS

    assert len(FOREIGN_KEYS) == sum(len(names.split()) for names in _NAMES_OF.values())  # unique
    sections = RunConfig.model_fields
    for name, meant in FOREIGN_KEYS.items():
        section, key = meant.split(".")
        assert key in sections[section].annotation.model_fields, (name, meant)
        # the name is unknown in the section it points to (it never hides a real key there)
        assert name not in sections[section].annotation.model_fields, name


def test_wrong_type_names_key_and_value():
    with pytest.raises(InputError, match=r"bad value for config key 'train.max_steps'.*'ten'"):
        load_config(None, ["train.max_steps=ten"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(InputError, match="mapping"):
        load_config(listy)


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["train.max_steps=5", "train.report_to=tensorboard"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["train"]["report_to"] == ["tensorboard"]


def test_fractional_steps_accepted():
    cfg = load_config(None, ["train.logging_steps=0.25", "optim.warmup_steps=0.1"])
    assert cfg.train.logging_steps == 0.25
    assert cfg.optim.warmup_steps == 0.1


def test_every_field_documented_and_reference_in_sync():
    from unmask.config import reference_markdown

    for name, field in RunConfig.model_fields.items():
        assert field.description, f"{name} has no docstring"
        for key, sub in getattr(field.annotation, "model_fields", {}).items():  # rewards: a list
            assert sub.description, f"{name}.{key} has no docstring"
    assert (REPO / "docs" / "configuration.md").read_text() == reference_markdown()


def test_a_config_file_without_output_dir_runs_in_runs_slash_its_name(tmp_path):
    from unmask.config import load_config

    path = tmp_path / "my-ablation.yaml"
    path.write_text("train: {max_steps: 3}\n")
    assert load_config(path).train.output_dir == "runs/my-ablation"
    path.write_text("data: {dataset: synthetic}\n")
    assert load_config(path).train.output_dir == "runs/my-ablation"
    assert load_config(path, ["train.output_dir=elsewhere"]).train.output_dir == "elsewhere"
    assert load_config().train.output_dir == "runs/quickstart"


def test_layout_keys_written_under_train_are_read_into_parallel_with_a_notice(tmp_path):
    """The layout keys moved from `train:` to `parallel:`; a config that still writes them
    under train (a file, or a command-line override) runs the same, with one notice."""
    from unmask.config import dump_config, load_config

    old = load_config(None, ["train.tensor_parallel=2", "train.pipeline_schedule=gpipe",
                             "train.max_steps=3"])  # fmt: skip
    new = load_config(None, ["parallel.tensor_parallel=2", "parallel.pipeline_schedule=gpipe",
                             "train.max_steps=3"])  # fmt: skip
    assert old.model_dump() == new.model_dump()
    assert old.parallel.tensor_parallel == 2 and old.train.max_steps == 3
    assert old.notices == [
        "unmask: config keys that moved, read under their new name (write them there): "
        "train.tensor_parallel -> parallel.tensor_parallel, train.pipeline_schedule -> "
        "parallel.pipeline_schedule"
    ]
    assert new.notices == []
    assert "tensor_parallel" not in dump_config(old).split("parallel:")[0]  # written anew
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  expert_parallel: 1\n  max_steps: 2\n")
    assert (
        load_config(path).notices[-1].endswith("train.expert_parallel -> parallel.expert_parallel")
    )
    # a file giving both spellings says two things: refused
    path.write_text("train:\n  dp_shard: 2\nparallel:\n  dp_shard: 2\n")
    with pytest.raises(InputError, match=r"^train.dp_shard and parallel.dp_shard are both given; "
                                         r"the key moved to parallel.dp_shard: keep that one$"):  # fmt: skip
        load_config(path)
    # a command-line override in either spelling wins over the file's value in the other
    path.write_text("train:\n  pipeline_schedule: gpipe\n")
    over = load_config(path, ["parallel.pipeline_schedule=1f1b"])
    assert over.parallel.pipeline_schedule == "1f1b"
    path.write_text("parallel:\n  pipeline_schedule: gpipe\n")
    assert load_config(path, ["train.pipeline_schedule=1f1b"]).parallel.pipeline_schedule == "1f1b"
