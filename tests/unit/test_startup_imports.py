"""`unmask --help` stays fast (benchmarks/startup.py measures it against `import torch`):
building the command line loads none of what only some commands use: DTensor (with sympy
under it), transformers, the model code, plotting, serving, the trainer."""

import subprocess
import sys

import torch

from unmask.dtensor import is_dtensor

HEAVY = ("torch.distributed.tensor", "sympy", "transformers", "matplotlib", "starlette",
         "uvicorn", "unmask.models.transformer", "unmask.train.trainer", "unmask.serve.app")  # fmt: skip


def test_the_parser_imports_nothing_heavy():
    code = ("import sys; from unmask.cli import build_parser; build_parser(); "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)  # fmt: skip
    assert done.stdout.strip() == "[]", done.stdout


def test_reading_a_checkpoint_loads_no_sharding_code():
    """`unmask generate`, `eval` and `export` open a saved model (checkpoint/open.py,
    saved.py, export.py) without torch.distributed.fsdp or DTensor (half a second of their
    start-up, with sympy): only the trainer shards."""
    modules = ("unmask.cli.generate", "unmask.cli.evaluate", "unmask.checkpoint.open",
               "unmask.checkpoint.saved", "unmask.checkpoint.export")  # fmt: skip
    heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "sympy")
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; "
            f"print([m for m in {heavy!r} if m in sys.modules])")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)  # fmt: skip
    assert done.stdout.strip() == "[]", done.stdout


def test_is_dtensor_without_the_module():
    assert not is_dtensor(torch.zeros(2)) and not is_dtensor(None)
