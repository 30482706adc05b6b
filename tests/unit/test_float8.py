"""train.float8 (unmask/models/float8.py): refused in one line, before anything is written,
where it cannot run (a CPU, no bf16, no torchao); which layers it converts (the decoder
blocks' linears with dimensions that are multiples of 16; not the head, the embedding or
the experts), checked on torchao's own conversion where torchao is installed."""

import pytest
import torch
import yaml
from conftest import TINY, deep_update, tiny_model

from unmask.cli import main
from unmask.models.float8 import check_float8, float8_eligible


@pytest.mark.parametrize("bf16,message", [
    (True, "train.float8: true needs a CUDA GPU with float8 tensor cores"),
    (False, "set train.bf16: true as well"),
])  # fmt: skip
def test_float8_on_a_cpu_is_one_line_and_exit_2(tmp_path, capsys, bf16, message):
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), "float8": True,
                                        "bf16": bf16, "device": "cpu"}})  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()
    check_float8(False, False, torch.device("cpu"))  # not asked: nothing to check


def test_the_decoder_blocks_linears_are_the_ones_converted():
    model = tiny_model(hidden_size=32, intermediate_size=64)
    names = [n for n, m in model.named_modules() if float8_eligible(m, n)]
    assert names and all(n.startswith("model.layers.") for n in names)
    assert "lm_head" not in names
    torchao = pytest.importorskip("torchao.float8")
    from unmask.models.float8 import convert_to_float8

    assert convert_to_float8(model) == len(names)
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted == names and torchao is not None
