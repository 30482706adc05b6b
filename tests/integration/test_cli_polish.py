"""What a new user's first commands print: the version, the resolved config without a run,
where the reference is, progress on the held-out pass, a notice for too many CPU processes,
device auto, and a generate call that does not import the compiler stack."""

import subprocess
import sys

import pytest
import torch
import yaml
from conftest import save_tiny_model

from unmask.cli import main
from unmask.config import load_config
from unmask.device import resolve_device
from unmask.train.trainer import cpu_share_notice


def test_version_names_unmask_and_torch(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"unmask 0.1.0 (torch {torch.__version__})"


def test_print_config_shows_the_resolved_config_and_writes_nothing(tiny_config, tmp_path, capsys):
    path = tiny_config()
    assert main(["train", str(path), "optim.learning_rate=5e-4", "--print-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    expected = load_config(path, ["optim.learning_rate=5e-4"])
    assert shown["optim"]["learning_rate"] == 5e-4
    assert shown["train"] == yaml.safe_load(yaml.safe_dump(expected.train.model_dump(mode="json")))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("argv", "reference"),
    [(["--help"], "docs/configuration.md"), (["train", "--help"], "docs/configuration.md"),
     (["generate", "--help"], "docs/sampling.md"), (["eval", "--help"], "docs/sampling.md"),
     (["export", "--help"], "docs/sampling.md")],
)  # fmt: skip
def test_help_points_to_the_reference(argv, reference, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr().out.replace("\n", " ")
    assert reference in out and "docs/troubleshooting.md" in out


def test_held_out_pass_shows_progress(tiny_config, capsys):
    path = tiny_config({"eval": {"generate_accuracy": True, "max_examples": 8, "batch_size": 2},
                        "train": {"max_steps": 2}})  # fmt: skip
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "held-out generation: 2/8 prompts" in out and "held-out generation: 6/8 prompts" in out
    assert "held-out exact match:" in out


def test_more_cpu_processes_than_cores_is_a_notice():
    assert cpu_share_notice(2, cores=2) is None
    assert cpu_share_notice(8, cores=2) == (
        "8 processes share 2 CPU cores: expect each to run slower than one process would; "
        "launch at most one per core"
    )


def test_device_auto_everywhere():
    from unmask.cli import build_parser

    parser = build_parser()
    for command in (
        ["generate", "--model", "m", "--prompt", "p"],
        ["eval", "--model", "m", "--ppl", "t.txt"],
    ):
        assert parser.parse_known_args(command)[0].device == "auto"
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_a_generate_call_does_not_import_the_compiler_stack(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    code = (
        "import sys; from unmask.cli import main; "
        f"assert main(['generate', '--model', {str(model)!r}, '--prompt', 'rev 12=']) == 0; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split("\n")[-1] == "[]"
