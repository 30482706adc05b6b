"""Every model family x the shape options a config can set, trained 2 steps by the trainer:
the folders it writes (final/, checkpoint-2/) and `unmask export`'s reload in unmask with
bit-equal weights and logits, in float64 too, and, where transformers has the family's class
and the folder's config.json says the whole architecture in that class's keys, load in
transformers with no missing, unexpected or unknown key and logits within 1e-5.

The families come from the registry (models/families.py `FAMILIES`), the options from
`OPTIONS`. The selection is a covering one, not every combination: per family, the base
config, then the options that apply to it (the config validates and changes something)
packed greedily into as few cases as validate together, those that transformers' class can
express (qk_norm on Qwen3, a bias on Llama, GQA/MHA, tied heads, OLMoE's clip_qkv, ...)
apart from those only unmask's own "unmask" tag can carry (qk_norm: false on Qwen3, a
partial rotary on Llama, a sigmoid router on Qwen3-MoE, ...). So every option value occurs
at least once per family that takes it, and each transformers-expressible one is checked
against transformers. `test_the_selection_covers_every_family_and_option` holds the
selection to that.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY_GEMMA, write_run_config

from unmask.checkpoint.generation import UNMASK_GENERATION_FILE
from unmask.checkpoint.open import load_for_sampling
from unmask.cli import main
from unmask.config import load_config
from unmask.models import FAMILIES, ModelConfig, config_from_hf, from_pretrained, hf_config_dict
from unmask.models.hf import ARCHITECTURE_FIELDS
from unmask.sampling.generation_file import GENERATION_FILE, saved_sampling
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDING, FULL = "sliding_attention", "full_attention"
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# what each case's model section starts from (conftest's TINY: 2 layers, 2 query heads and
# 1 key/value head, hidden 32, vocabulary 128)
GEMMA_MODEL = TINY_GEMMA["model"]

DECODER = lambda base: base.native and not base.diffusion_gemma  # noqa: E731
MOE_ROUTER = lambda base: base.num_experts > 0  # noqa: E731
GEMMA = lambda base: base.diffusion_gemma is not None  # noqa: E731
EVERY = lambda base: True  # noqa: E731

OPTIONS = {
    "qk_norm": (DECODER, lambda base: {"qk_norm": not base.qk_norm}),
    "tied": (EVERY, lambda base: {"tie_word_embeddings": not base.tie_word_embeddings}),
    "attention_bias": (DECODER, lambda base: {"attention_bias": not base.attention_bias}),
    "qkv_bias": (DECODER, lambda base: {"qkv_bias": not base.qkv_bias}),
    "mha": (DECODER, lambda base: {"num_key_value_heads": base.num_attention_heads}),
    "head_dim": (DECODER, lambda base: {"head_dim": 8}),
    "partial_rotary": (DECODER, lambda base: {"partial_rotary_factor": 0.5}),
    "qk_norm_scope": (DECODER, lambda base: {"qk_norm_scope": "head" if base.qk_norm_scope ==
                                             "projection" else "projection"}),
    "clip_qkv": (DECODER, lambda base: {"clip_qkv": 0.5}),
    # MoE routers (the families with experts)
    "norm_topk_prob": (MOE_ROUTER, lambda base: {"norm_topk_prob": not base.norm_topk_prob}),
    "sigmoid_router": (MOE_ROUTER, lambda base: {"router_score": "sigmoid", "norm_topk_prob": True,
                                                 "expert_bias_update_rate": 1e-2}),
    "group_limited": (MOE_ROUTER, lambda base: {"n_group": 2, "topk_group": 1}),
    "routed_scaling": (MOE_ROUTER, lambda base: {"routed_scaling_factor": 2.5}),
    "shared_expert": (MOE_ROUTER, lambda base: {"num_shared_experts": 1}),
    "dense_first_layer": (MOE_ROUTER, lambda base: {"first_k_dense_replace": 1}),
    "mlp_only_layers": (MOE_ROUTER, lambda base: {"mlp_only_layers": [1]}),
    "router_losses": (MOE_ROUTER, lambda base: {"router_aux_loss_coef": 0.01,
                                                "router_z_loss_coef": 1e-3}),
    "moe_loop": (MOE_ROUTER, lambda base: {"moe_implementation": "loop"}),
    # DiffusionGemma's layer patterns and full-attention shapes
    "gemma_all_full": (GEMMA, lambda base: {"diffusion_gemma": {**_section(base),
                                                                "layer_types": [FULL, FULL]}}),
    "gemma_default_pattern": (GEMMA, lambda base: {"diffusion_gemma": {**_section(base),
                                                                       "layer_types": None}}),
    "gemma_global_shape": (GEMMA, lambda base: {"diffusion_gemma": {
        **_section(base), "global_head_dim": 8, "num_global_key_value_heads": 2}}),
    "gemma_window_rope": (GEMMA, lambda base: {"diffusion_gemma": {
        **_section(base), "sliding_window": 3, "global_rope_theta": 5e4,
        "global_partial_rotary_factor": 0.5, "final_logit_softcapping": 5.0}}),
    "gemma_mha": (GEMMA, lambda base: {"num_key_value_heads": base.num_attention_heads}),
    "gemma_bias": (GEMMA, lambda base: {"attention_bias": True}),
}  # fmt: skip
"""Option name -> (whether it is an option of a family's base ModelConfig, the fields it
sets given that config)."""

# fields that change training, not the logits of given weights: a folder need not say them
_TRAINING_ONLY = {"moe_implementation", "router_aux_loss_coef", "router_z_loss_coef",
                  "expert_bias_update_rate", "initializer_range", "max_position_embeddings"}  # fmt: skip


def _section(base: ModelConfig) -> dict:
    return base.diffusion_gemma.model_dump() if base.diffusion_gemma else {}


def _base_section(family: str) -> dict:
    """A family's model section: TINY's sizes, experts for MoE families, DiffusionGemma's
    tiny layout."""
    if family == "diffusion_gemma":
        return dict(GEMMA_MODEL)
    section = {"model_type": family}
    if FAMILIES[family].moe:
        section.update(MOE)
    return section


def _config(section: dict) -> ModelConfig | None:
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128}  # fmt: skip
    try:
        return ModelConfig(**{**tiny, **section})
    except ValueError:
        return None


def _changes(cfg: ModelConfig, base: ModelConfig) -> bool:
    return cfg.model_dump() != base.model_dump()


def transformers_expressible(cfg: ModelConfig) -> bool:
    """Whether transformers' class of the family reads the whole architecture from the
    config.json unmask writes (read without unmask's own tag, as transformers does), and has
    the class at all."""
    if not cfg.native:
        return True  # the family is transformers' class itself (BertForMaskedLM, ...)
    written = hf_config_dict(cfg)
    if getattr(transformers, written["architectures"][0], None) is None:
        return False  # remote code (Dream, LLaDA, LLaDA2.0): no class in transformers
    bare = {**written, "unmask": {"model_type": cfg.model_type}}
    read = config_from_hf(bare)
    unused = set(_TRAINING_ONLY)
    if all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) and not cfg.diffusion_gemma:
        unused.add("intermediate_size")  # no dense MLP: OLMoE's folders have no key for it
    return all(getattr(read, key) == getattr(cfg, key) or key in unused
               or (key == "head_dim" and read.resolved_head_dim == cfg.resolved_head_dim)
               for key in ARCHITECTURE_FIELDS)  # fmt: skip


def selection() -> dict[str, dict]:
    """Case id -> model section: per family (registry order) the base, then the options
    that apply packed greedily, transformers-expressible ones apart from the others."""
    cases = {}
    for family in FAMILIES:
        section = _base_section(family)
        base = _config(section)
        assert base is not None, family
        cases[f"{family}-base"] = section
        packs: dict[bool, list[tuple[list[str], dict]]] = {True: [], False: []}
        for name, (applies, option) in OPTIONS.items():
            if not applies(base):
                continue
            fields = option(base)
            alone = _config({**section, **fields})
            if alone is None or not _changes(alone, base):
                continue  # the family does not take it, or it is its default
            kind = transformers_expressible(alone) and transformers_expressible(base)
            for names, packed in packs[kind]:
                together = _config({**packed, **fields})
                if together is not None and transformers_expressible(together) == kind:
                    names.append(name)
                    packed.update(fields)
                    break
            else:
                packs[kind].append(([name], {**section, **fields}))
        for packed in packs.values():
            for names, fields in packed:
                cases[f"{family}-{'+'.join(names)}"] = fields
    return cases


CASES = selection()


def test_the_selection_covers_every_family_and_option():
    """Every registered family has a base case; every option that a family takes (alone) is
    in one of its cases; each transformers-expressible option is in a case transformers
    checks."""
    for family in FAMILIES:
        assert f"{family}-base" in CASES
        base = _config(_base_section(family))
        mine = {name: fields for name, fields in CASES.items() if name.startswith(f"{family}-")}
        for option, (applies, make) in OPTIONS.items():
            alone = _config({**_base_section(family), **make(base)})
            if not applies(base) or alone is None or not _changes(alone, base):
                continue
            holding = [n for n in mine if option in n.removeprefix(f"{family}-").split("+")]
            assert len(holding) == 1, (family, option, holding)
            if transformers_expressible(alone):
                assert transformers_expressible(_config(mine[holding[0]])), (family, option)
    # the selection is what the issue lists: qk_norm off on Qwen3, MoE routers, patterns
    assert "qk_norm" in [n for n in CASES if n.startswith("qwen3_dllm-")][-1]
    assert any("sigmoid_router" in n for n in CASES if n.startswith("qwen3_moe_dllm-"))
    assert any("gemma_all_full" in n for n in CASES if n.startswith("diffusion_gemma-"))


def _inputs(cfg: ModelConfig) -> tuple:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, cfg.vocab_size, (2, 10), generator=g)
    if FAMILIES[cfg.model_type].shape.canvas_decoder:
        return ids[:, :6], ids[:, 6:]  # prompt, canvas
    return (ids,)


def _logits(model, inputs: tuple) -> torch.Tensor:
    with torch.no_grad():
        out = model(*inputs)
    return out.logits if hasattr(out, "logits") else out


def _transformers_logits(hf, cfg: ModelConfig, inputs: tuple) -> torch.Tensor:
    with torch.no_grad():
        if FAMILIES[cfg.model_type].shape.canvas_decoder:
            return hf(input_ids=inputs[0], decoder_input_ids=inputs[1]).logits
        if not cfg.native:
            return hf(input_ids=inputs[0]).logits
        batch, length = inputs[0].shape  # a prepared 4-D mask: bidirectional, as unmask's
        full = torch.ones(batch, 1, length, length, dtype=torch.bool)
        return hf(input_ids=inputs[0], attention_mask=full).logits


def _check_transformers(folder: Path, cfg: ModelConfig, inputs: tuple, ours: torch.Tensor):
    config = json.loads((folder / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    # generation_config.json is read by from_pretrained: a key its class refuses raises here
    hf, info = cls.from_pretrained(folder, output_loading_info=True)
    if FAMILIES[cfg.model_type].carried:  # transformers builds a vision tower unmask lacks
        info["missing_keys"] = {k for k in info["missing_keys"]
                                if not k.startswith(FAMILIES[cfg.model_type].carried)}  # fmt: skip
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    theirs = _transformers_logits(hf.eval(), cfg, inputs)
    assert (theirs - ours).abs().max().item() <= 1e-5
    generation = getattr(cls, "generation_config_class", None) or transformers.GenerationConfig
    generation.from_pretrained(folder)  # the file alone, by the class the model reads it with


@pytest.mark.parametrize("case", list(CASES))
def test_folders_reload_bit_equal_and_load_in_transformers(case, tmp_path):
    section = CASES[case]
    run_section = {"model": section, "train": {"max_steps": 2, "save_steps": 2, "eval_steps": 0}}
    if FAMILIES[section.get("model_type", "qwen3_dllm")].shape.canvas_decoder:
        run_section["diffusion"] = TINY_GEMMA["diffusion"]
    run = tmp_path / "run"
    cfg = load_config(write_run_config(tmp_path, "run", {}, run_section))
    trainer = Trainer(cfg)
    trainer.train()
    trained = trainer.model.eval()
    arch = trained.config
    inputs = _inputs(arch)
    expected = _logits(trained, inputs)
    exported = tmp_path / "exported"
    assert main(["export", str(run / "final"), "--out", str(exported)]) == 0
    expressible = transformers_expressible(arch)
    for folder in (run / "final", run / "checkpoint-2", exported):
        again = from_pretrained(folder).eval()
        state = again.state_dict()
        for key, tensor in trained.state_dict().items():
            assert torch.equal(tensor, state[key]), (folder.name, key)
        assert torch.equal(_logits(again, inputs), expected), folder.name
        if FAMILIES[arch.model_type].native:
            again_cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
            assert {k: getattr(again_cfg, k) for k in ARCHITECTURE_FIELDS if k != "head_dim"} == {
                k: getattr(arch, k) for k in ARCHITECTURE_FIELDS if k != "head_dim"
            }
        assert saved_sampling(folder) == saved_sampling(run / "final") or folder == exported
        if expressible:
            _check_transformers(folder, arch, inputs, expected)
    # float64: the same logits within float32's tolerance (the grouped GEMM takes no float64)
    # (DiffusionGemma's logits are float32 whatever the weights, as transformers')
    double = load_for_sampling(exported, device="cpu", dtype=torch.float64).model
    assert {p.dtype for p in double.parameters()} == {torch.float64}
    torch.testing.assert_close(_logits(double, inputs).float(), expected, atol=1e-4, rtol=1e-4)
    if (exported / UNMASK_GENERATION_FILE).is_file():  # strict generation config: both files
        assert "unmask" in json.loads((exported / UNMASK_GENERATION_FILE).read_text())
        assert "unmask" not in json.loads((exported / GENERATION_FILE).read_text())
