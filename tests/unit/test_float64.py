"""float64 for every model family (the registry's): a float64 copy of a tiny model gives
its float32 logits within float32's tolerance; `moe_implementation: auto` takes the loop
where torch._grouped_mm has no kernel for the dtype (float64), and an explicit grouped_mm
says so in one line."""

import copy

import pytest
import torch
from conftest import TINY_GEMMA

from unmask.models import FAMILIES, ModelConfig, build_model
from unmask.models.moe import Experts, grouped_mm_fits

pytestmark = pytest.mark.usefixtures("one_thread")

# expert and hidden widths whose float32 rows are multiples of 16 bytes: `auto` picks the
# grouped GEMM in float32, so float64 is where it must not
SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _config(family: str) -> ModelConfig:
    if FAMILIES[family].section:  # DiffusionGemma: conftest's tiny layout
        return ModelConfig(**{**SIZES, **TINY_GEMMA["model"], "vocab_size": 64})
    return ModelConfig(**SIZES, model_type=family, **(MOE if FAMILIES[family].moe else {}))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if FAMILIES[model.config.model_type].shape.canvas_decoder:
            return model(ids[:, :5], ids[:, 5:]).float()
        return model(ids).float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_forward_equals_float32(family):
    torch.manual_seed(0)
    model = build_model(_config(family)).eval()
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    single = _logits(model, ids)
    double = copy.deepcopy(model).to(torch.float64)
    assert {p.dtype for p in double.parameters()} == {torch.float64}
    wide = _logits(double, ids)
    assert single.abs().max() > 1e-2  # logits that say something
    torch.testing.assert_close(wide, single, atol=2e-5, rtol=1e-4)


def test_grouped_mm_is_chosen_only_for_its_dtypes():
    assert grouped_mm_fits(32, 48, dtype=torch.float32)
    assert not grouped_mm_fits(32, 48, dtype=torch.float64)
    experts = Experts(ModelConfig(**SIZES, model_type="qwen3_moe_dllm", **MOE))
    assert experts.uses_grouped_mm(torch.float32) and not experts.uses_grouped_mm(torch.float64)
    experts.implementation = "grouped_mm"
    with pytest.raises(ValueError, match=r"grouped_mm needs float32, bfloat16 or float16 .*"
                                         r"here torch.float64\); use loop or auto"):  # fmt: skip
        experts.uses_grouped_mm(torch.float64)
