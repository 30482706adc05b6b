"""A family's folder is its `FolderLayout` (models/layouts.py, issue 54): a family added
from outside the package, whose folders nest the text model's keys under `text_config`, name
every tensor their own way and fuse q/k/v into one matrix, reads and writes its folders
through the layout it declares, with no edit under unmask/ (models/hf.py switches on no
family)."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from unmask.models import (
    DiffusionTransformer,
    Family,
    ModelConfig,
    from_pretrained,
    register_family,
    save_pretrained,
    unregister_family,
)
from unmask.models.families import FAMILIES
from unmask.models.layouts import FolderLayout

QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight$")
FUSED = re.compile(r"^transformer\.h\.(\d+)\.attn\.qkv\.weight$")


class NestedLayout(FolderLayout):
    """The text model's keys under text_config; `transformer.` for `model.`, `h` for
    `layers`; q, k and v stacked into one `qkv` matrix per layer."""

    def fields(self, hf, family):
        return super().fields(hf["text_config"], family)

    def config(self, cfg, family, dtype_name):
        text = super().config(cfg, family, dtype_name)
        tag = text.pop("unmask")
        return {"architectures": text.pop("architectures"), "model_type": text.pop("model_type"),
                "text_config": text, "unmask": tag}  # fmt: skip

    def to_folder(self, state):
        out, qkv = {}, {}
        for key, value in state.items():
            if match := QKV.match(key):
                qkv.setdefault(int(match[1]), {})[match[2]] = value
            else:
                out[key.replace("model.layers.", "transformer.h.", 1)
                      .replace("model.", "transformer.", 1)] = value  # fmt: skip
        for layer, parts in qkv.items():
            out[f"transformer.h.{layer}.attn.qkv.weight"] = torch.cat(
                [parts["q"], parts["k"], parts["v"]]
            )
        return out

    def to_native(self, state, cfg, folder):
        out = {}
        head = cfg.resolved_head_dim
        sizes = [cfg.num_attention_heads * head, *[cfg.num_key_value_heads * head] * 2]
        for key, value in state.items():
            if match := FUSED.match(key):
                for name, part in zip("qkv", value.split(sizes), strict=True):
                    out[f"model.layers.{match[1]}.self_attn.{name}_proj.weight"] = part
            else:
                out[key.replace("transformer.h.", "model.layers.", 1)
                      .replace("transformer.", "model.", 1)] = value  # fmt: skip
        return out


@pytest.fixture
def nested_family():
    family = Family("nested_dllm", "native", ("nested_dllm",), "NestedForMaskedDiffusion",
                    layout=NestedLayout())  # fmt: skip
    register_family(family, DiffusionTransformer)
    yield family
    unregister_family(family.name)
    assert "nested_dllm" not in FAMILIES


def tiny(model_type: str) -> ModelConfig:
    return ModelConfig(model_type=model_type, vocab_size=64, hidden_size=32,
                       intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, qk_norm=False)  # fmt: skip


def test_a_plugin_family_reads_and_writes_its_own_folder(nested_family, tmp_path):
    torch.manual_seed(0)
    model = DiffusionTransformer(tiny("nested_dllm"))
    save_pretrained(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "nested_dllm" and "hidden_size" not in config
    assert config["text_config"]["hidden_size"] == 32
    assert config["text_config"]["num_key_value_heads"] == 2
    assert config["unmask"]["model_type"] == "nested_dllm"
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert not any(key.startswith("model.") for key in tensors)
    assert tuple(tensors["transformer.h.1.attn.qkv.weight"].shape) == (
        4 * 8 + 2 * 2 * 8,
        32,
    )  # q, k, v of 8-wide heads
    assert "transformer.embed_tokens.weight" in tensors

    loaded = from_pretrained(tmp_path / "saved")
    assert loaded.config.model_type == "nested_dllm"
    assert loaded.config.model_dump() == model.config.model_dump()
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    save_pretrained(loaded, tmp_path / "again")  # the folder's own config.json, tagged
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_messages_list_families_from_the_registry(nested_family):
    with pytest.raises(ValueError, match=r"needs an MoE family \(qwen3_moe_dllm, llada_moe, "
                                         r"llada2_moe, diffusion_gemma\)"):  # fmt: skip
        ModelConfig(model_type="nested_dllm", num_experts=4)
