"""Logit parity with transformers' own Qwen3 and round trips through HF folders."""

import json

import pytest
import torch
import transformers
from conftest import PARITY_SIZES, perturb_norms

from unmask.models import from_pretrained


def _tiny_hf_model(tied: bool) -> "transformers.Qwen3ForCausalLM":
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**PARITY_SIZES, head_dim=16, tie_word_embeddings=tied,
                                   rope_theta=1e4)  # fmt: skip
    # non-trivial norms so a q_norm/k_norm mix-up shows (Qwen3 has no biases to perturb)
    return perturb_norms(transformers.Qwen3ForCausalLM(cfg))


def _hf_bidirectional_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers logits with an all-True 4-D mask: the dict form bypasses the causal mask."""
    batch, length = ids.shape
    full = torch.ones(batch, 1, length, length, dtype=torch.bool)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask={"full_attention": full}).logits


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_bidirectional(tmp_path, tied):
    hf_model = _tiny_hf_model(tied)
    hf_model.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))

    reference = _hf_bidirectional_logits(hf_model, ids)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 97
    # The reference really is non-causal: the last token moves position 0's logits.
    assert (_hf_bidirectional_logits(hf_model, changed)[:, 0] - reference[:, 0]).abs().max() > 1e-4

    with torch.no_grad():
        logits = ours(ids)
    assert logits.shape == (2, 12, 97)
    assert (logits - reference).abs().max().item() <= 1e-4
    if tied:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_reloads_in_transformers(tmp_path, tied):
    hf_model = _tiny_hf_model(tied)
    hf_model.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")

    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == "qwen3"
    assert written["architectures"] == ["Qwen3ForCausalLM"]
    assert written["unmask"] == {"model_type": "qwen3_dllm"}
    assert written["head_dim"] == 16 and written["tie_word_embeddings"] is tied

    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "ours")
    assert reloaded.config.rope_parameters["rope_theta"] == 1e4
    original, again = hf_model.state_dict(), reloaded.state_dict()
    assert set(original) == set(again)
    for key, tensor in original.items():
        assert torch.equal(tensor, again[key]), key
    if tied:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = _tiny_hf_model(tied=False)
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = from_pretrained(tmp_path)
    ours_state = ours.state_dict()
    for key, tensor in hf_model.state_dict().items():
        assert torch.equal(tensor, ours_state[key]), key
