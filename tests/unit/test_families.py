"""Model families: logit parity with transformers' Qwen2 and Llama, and the Dream and LLaDA
folder layouts (load, same logits as the equivalent transformers model, byte-for-byte round
trip). The LLaDA key map is written out by hand below as documentation. Then the registry
itself: ModelConfig's choices, config.json round trips, released mask ids, the logit shift."""

import json

import pytest
import torch
import transformers
from conftest import PARITY_SIZES, perturb_norms, tiny_model
from pydantic import ValidationError
from safetensors.torch import save_file

from unmask.config import validate_tree
from unmask.errors import InputError
from unmask.models import (
    FAMILIES,
    MODEL_BUILDERS,
    DiffusionTransformer,
    ModelConfig,
    build_empty,
    config_from_hf,
    decoder_layers,
    family_of_config,
    folder_mask_token_id,
    from_pretrained,
    hf_config_dict,
    samples_with_logit_shift,
)
from unmask.models.build import OWN_BLOCKS
from unmask.models.families import LLADA_KEY_MAP, family_for_hf_type
from unmask.models.hf_wrapped import build_encoder

# LLaDA (OLMo-style) names for layer 0 and the top level, as found in LLaDA-8B folders.
LLADA_LAYOUT = {
    "model.embed_tokens.weight": "model.transformer.wte.weight",
    "model.norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
    "model.layers.0.input_layernorm.weight": "model.transformer.blocks.0.attn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "model.transformer.blocks.0.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight": "model.transformer.blocks.0.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight": "model.transformer.blocks.0.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight": "model.transformer.blocks.0.attn_out.weight",
    "model.layers.0.post_attention_layernorm.weight": "model.transformer.blocks.0.ff_norm.weight",
    "model.layers.0.mlp.gate_proj.weight": "model.transformer.blocks.0.ff_proj.weight",
    "model.layers.0.mlp.up_proj.weight": "model.transformer.blocks.0.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight": "model.transformer.blocks.0.ff_out.weight",
}


def qwen2_model():
    torch.manual_seed(0)
    return perturb_norms(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**PARITY_SIZES)))


def llama_model(**extra):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**PARITY_SIZES, rope_theta=5e4, rms_norm_eps=1e-5, **extra)
    return perturb_norms(transformers.LlamaForCausalLM(cfg))


def bidirectional_logits(model, ids):
    full = torch.ones(ids.shape[0], 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=full).logits  # a 4-D mask is used as is


def ids():
    return torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "make, family",
    [
        (qwen2_model, "qwen2_dllm"),
        (llama_model, "llama_dllm"),
        (lambda: llama_model(attention_bias=True), "llama_dllm"),
    ],
)
def test_logit_parity_with_transformers(tmp_path, make, family):
    hf = make()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    assert ours.config.model_type == family and not ours.config.qk_norm
    x = ids()
    reference = bidirectional_logits(hf, x)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 97  # the reference is non-causal
    assert (bidirectional_logits(hf, changed)[:, 0] - reference[:, 0]).abs().max() > 1e-4
    with torch.no_grad():
        diff = (ours(x) - reference).abs().max().item()
    assert diff <= 1e-4
    # and back into transformers, weights identical
    ours.save_pretrained(tmp_path / "ours")
    again = type(hf).from_pretrained(tmp_path / "ours")
    for key, tensor in hf.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[key]), key


def _write(folder, config, state):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _same_bytes(a, b):
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_dream_layout_loads_and_round_trips(tmp_path):
    hf = qwen2_model()  # Dream = Qwen2 weights under model_type "Dream"
    config = {
        "architectures": ["DreamModel"],
        "auto_map": {"AutoModel": "modeling_dream.DreamModel"},
        "model_type": "Dream",
        "hidden_act": "silu",
        "mask_token_id": 151666,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        **PARITY_SIZES,
    }
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    _write(tmp_path / "dream", config, state)
    ours = from_pretrained(tmp_path / "dream").eval()
    assert ours.config.model_type == "dream" and ours.config.qkv_bias
    with torch.no_grad():
        assert (ours(ids()) - bidirectional_logits(hf, ids())).abs().max().item() <= 1e-4
    ours.save_pretrained(tmp_path / "again")
    _same_bytes(tmp_path / "dream", tmp_path / "again")


def test_llada_layout_key_map_loads_and_round_trips(tmp_path):
    hf = llama_model()  # LLaDA = Llama blocks under OLMo-style names
    for ours_key, llada_key in LLADA_LAYOUT.items():  # the module's map says the same
        generic = ours_key.replace(".0.", ".N.")
        assert LLADA_KEY_MAP[generic] == llada_key.replace(".0.", ".N.")
    state = {}
    for key, value in hf.state_dict().items():
        generic = key.replace(".0.", ".N.").replace(".1.", ".N.")
        layer = ".1." if ".1." in key else ".0."
        state[LLADA_KEY_MAP[generic].replace(".N.", layer)] = value.contiguous()
    config = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "block_type": "llama",
        "d_model": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "n_layers": 2,
        "mlp_hidden_size": 96,
        "vocab_size": 97,
        "embedding_size": 97,
        "rope_theta": 5e4,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 128,
        "weight_tying": False,
        "include_bias": False,
        "mask_token_id": 126336,
    }
    _write(tmp_path / "llada", config, state)
    ours = from_pretrained(tmp_path / "llada").eval()
    assert ours.config.model_type == "llada"
    with torch.no_grad():
        assert (ours(ids()) - bidirectional_logits(hf, ids())).abs().max().item() <= 1e-4
    ours.save_pretrained(tmp_path / "again")
    _same_bytes(tmp_path / "llada", tmp_path / "again")


def test_family_defaults_and_fresh_family_folders(tmp_path):
    assert ModelConfig(model_type="dream").qkv_bias and not ModelConfig(model_type="llada").qk_norm
    assert ModelConfig().qk_norm and not ModelConfig().qkv_bias
    for family in ("qwen2_dllm", "llama_dllm", "dream", "llada"):
        model = tiny_model(model_type=family, **PARITY_SIZES).eval()
        model.save_pretrained(tmp_path / family)
        again = from_pretrained(tmp_path / family).eval()
        assert again.config.model_type == family
        with torch.no_grad():
            assert torch.equal(model(ids()), again(ids()))


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_encoder_wrapper_matches_transformers_and_isolates_documents(tmp_path, family):
    import torch.nn.functional as F

    model = tiny_model(model_type=family, vocab_size=97, num_attention_heads=2,
                       num_key_value_heads=2, max_position_embeddings=64).eval()  # fmt: skip
    x = ids()
    targets = torch.where(x % 3 == 0, x, -100)
    with torch.no_grad():
        logits = model.hf_model(input_ids=x).logits
        ce = model(x, targets=targets)
        expected = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        assert torch.allclose(ce, expected, atol=1e-6) and torch.equal(model(x), logits)
        # two packed documents see only themselves
        docs = torch.tensor([[0] * 5 + [1] * 6] * 2)
        pos = torch.tensor([list(range(5)) + list(range(6))] * 2)
        packed = model(x, doc_ids=docs, position_ids=pos)
        alone = model(x[:, 5:])
        assert (packed[:, 5:] - alone).abs().max().item() < 1e-5
    model.save_pretrained(tmp_path / family)
    from unmask.models.hf_wrapped import load_encoder

    again = load_encoder(tmp_path / family).eval()
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


# --- the family registry ------------------------------------------------------------------


def test_registry_and_model_config_choices_agree():
    for name in FAMILIES:  # every registered family is a valid model_type, nothing else
        assert ModelConfig(model_type=name).model_type == name
    with pytest.raises(ValidationError, match="Input should be 'qwen3_dllm', "):
        ModelConfig(model_type="gpt2")
    for name, family in FAMILIES.items():
        assert family.name == name
        default = DiffusionTransformer if family.native else build_encoder
        assert MODEL_BUILDERS[name] is OWN_BLOCKS.get(name, default)  # its own blocks
        for key, value in family.config_defaults.items():  # switches the family implies
            assert getattr(ModelConfig(model_type=name), key) == value


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.native])
def test_native_family_config_json_round_trip(name):
    family = FAMILIES[name]
    cfg = ModelConfig(model_type=name, rope_theta=5e4, tie_word_embeddings=True, **PARITY_SIZES)
    written = hf_config_dict(cfg)
    assert written["model_type"] == family.hf_model_type
    assert written["architectures"] == [family.architecture]
    assert family_for_hf_type(written["model_type"]) is family

    def same(back):  # head_dim may come back resolved (16) or absent (None): same shapes
        assert back.resolved_head_dim == cfg.resolved_head_dim
        assert back.model_dump(exclude={"head_dim"}) == cfg.model_dump(exclude={"head_dim"})

    same(config_from_hf(written))
    released = {k: v for k, v in written.items() if k != "unmask"}  # as the family's own folder
    assert family_of_config(released) is family
    same(config_from_hf(released))


def _folder(folder, config):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_mask_token_id_falls_back_to_the_familys_released_id(tmp_path):
    llada = hf_config_dict(ModelConfig(model_type="llada", **PARITY_SIZES))
    assert llada["model_type"] == "llada" and "mask_token_id" not in llada
    released = {k: v for k, v in llada.items() if k != "unmask"}
    assert folder_mask_token_id(_folder(tmp_path / "a", released)) == 126336
    own = {**released, "mask_token_id": 7}
    assert folder_mask_token_id(_folder(tmp_path / "b", own)) == 7  # config.json wins
    assert folder_mask_token_id(_folder(tmp_path / "c", llada)) is None  # written by unmask
    dream = {"model_type": "Dream", "architectures": ["DreamModel"], **PARITY_SIZES}
    assert folder_mask_token_id(_folder(tmp_path / "d", dream)) == 151666
    qwen2 = hf_config_dict(ModelConfig(model_type="qwen2_dllm", **PARITY_SIZES))
    qwen2.pop("unmask")
    assert folder_mask_token_id(_folder(tmp_path / "e", qwen2)) is None  # no released id
    assert folder_mask_token_id(tmp_path) is None  # no config.json


def test_logit_shift_helper():
    dream = {"model_type": "Dream", "architectures": ["DreamModel"], "mask_token_id": 151666}
    assert samples_with_logit_shift(dream)
    assert samples_with_logit_shift(hf_config_dict(ModelConfig(model_type="dream", **PARITY_SIZES)))
    qwen2 = hf_config_dict(ModelConfig(model_type="qwen2_dllm", **PARITY_SIZES))
    assert not samples_with_logit_shift(qwen2)
    assert not samples_with_logit_shift({"model_type": "qwen2"})
    assert not samples_with_logit_shift({"model_type": "mistral"})


def test_build_empty_is_the_meta_path_from_pretrained_uses(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llada", tie_word_embeddings=True, **PARITY_SIZES)
    model = DiffusionTransformer(cfg).eval()
    empty = build_empty(cfg)
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # tied again
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in empty.parameters())
    empty.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(empty.eval()(ids()), model(ids()))
    half = build_empty(cfg, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.lm_head.weight is half.model.embed_tokens.weight
    assert decoder_layers(model) == list(model.model.layers) and len(decoder_layers(model)) == 2
    assert decoder_layers(torch.nn.Linear(2, 2)) == []
    with pytest.raises(ValueError, match="encoder"):
        build_empty(ModelConfig(model_type="bert", **PARITY_SIZES))


def test_switches_a_layout_has_no_key_for_ride_in_the_unmask_tag(tmp_path):
    """`qk_norm: false` on Qwen3 (docs/muon.md's demo), a bias on Qwen2's o_proj, a partial
    rotary on Llama: config.json's layout has no key for them, so the "unmask" tag carries
    them (and only them) and the folder reloads bit for bit; a config the layout holds whole
    gets no such entry. LLaDA's folders have no tensors for q/k norms or an o_proj bias:
    refused in one line."""
    for family, switch in (("qwen3_dllm", {"qk_norm": False}),
                           ("qwen2_dllm", {"attention_bias": True}),
                           ("llama_dllm", {"partial_rotary_factor": 0.5, "qk_norm": True})):  # fmt: skip
        torch.manual_seed(0)
        model = DiffusionTransformer(ModelConfig(model_type=family, **PARITY_SIZES, **switch))
        folder = tmp_path / family
        model.save_pretrained(str(folder))
        written = json.loads((folder / "config.json").read_text())
        assert written["unmask"]["model"] == switch
        again = from_pretrained(folder).eval()
        assert {k: getattr(again.config, k) for k in switch} == switch
        assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
        with torch.no_grad():
            assert torch.equal(again(ids()), model.eval()(ids()))
    plain = hf_config_dict(ModelConfig(model_type="qwen3_dllm", **PARITY_SIZES))
    assert plain["unmask"] == {"model_type": "qwen3_dllm"}
    # a qk_norm: false folder unmask wrote before the tag carried it: its weights say it
    old = tmp_path / "qwen3_dllm"
    written = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**written, "unmask": plain["unmask"]}))
    assert from_pretrained(old).config.qk_norm is False
    for key in ("qk_norm", "attention_bias"):
        with pytest.raises(InputError, match=f"LLaDA's layout.*set {key}: false"):
            validate_tree({"model": {"model_type": "llada", key: True}})
