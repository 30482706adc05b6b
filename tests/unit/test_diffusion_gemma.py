"""The diffusion_gemma family (models/diffusion_gemma.py) against transformers'
DiffusionGemmaForBlockDiffusion: tiny random models built by transformers (both layer types,
full layers with their own head size, key/value heads and no v_proj; every layer's dense MLP
beside its experts, as transformers always builds them; soft-capping that bites), saved with
its save_pretrained and read by unmask: the same canvas logits (float32, 1e-5) for the same
prompt, canvas and self-conditioning logits, in one call and in the sampler's split (encode
once, append an accepted canvas, decode); folders round-trip bit for bit both ways; images
and what the blocks lack are refused in one line; the 26B-A4B builds on the meta device."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from unmask.config import validate_tree
from unmask.errors import InputError
from unmask.models import (
    FAMILIES,
    ModelConfig,
    build_empty,
    build_model,
    config_from_hf,
    from_pretrained,
    resolve_model,
    shape_of,
)
from unmask.models.diffusion_gemma import DiffusionGemma, Experts
from unmask.models.lora import apply_lora
from unmask.parallel.tensor import check_tensor_parallel

SLIDING, FULL = "sliding_attention", "full_attention"
TEXT = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
        "num_global_key_value_heads": 1, "sliding_window": 4,
        "layer_types": [SLIDING, FULL, SLIDING, FULL], "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 24, "max_position_embeddings": 128,
        "final_logit_softcapping": 2.0, "initializer_range": 0.1}  # fmt: skip
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
          "position_embedding_size": 64}  # fmt: skip
PROMPT, CANVAS = 9, 6  # a prompt longer than the sliding window (4)
TOLERANCE = 1e-5


def transformers_model(seed: int = 0):
    """A tiny DiffusionGemmaForBlockDiffusion (tiny vision tower), its norms, router scales
    and layer scalars drawn from U(0.5, 1.5) (the encoder's scalars apart from the
    decoder's), so a swapped norm, scale or scalar shows."""
    torch.manual_seed(seed)
    config = transformers.DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION,
                                               canvas_length=CANVAS, initializer_range=0.1)  # fmt: skip
    model = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(transformers' model, its folder)."""
    root = tmp_path_factory.mktemp("diffusion_gemma")
    hf = transformers_model()
    hf.save_pretrained(root / "hf")
    return hf, root / "hf"


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (2, PROMPT), generator=g)
    canvas = torch.randint(0, 97, (2, CANVAS), generator=g)
    previous = 3 * torch.randn(2, CANVAS, 97, generator=g)  # last step's logits
    return prompt, canvas, previous


def reference(hf, prompt, canvas, previous=None, **extra):
    with torch.no_grad():
        return hf(input_ids=prompt, decoder_input_ids=canvas,
                  self_conditioning_logits=previous, **extra).logits  # fmt: skip


def test_canvas_logits_equal_transformers(folders):
    hf, folder = folders
    ours = from_pretrained(folder).eval()
    assert isinstance(ours, DiffusionGemma) and ours.config.model_type == "diffusion_gemma"
    layers = ours.model.layers
    assert [layer.self_attn.v_proj is None for layer in layers] == [False, True, False, True]
    assert layers[1].self_attn.q_proj.out_features == 4 * 16  # full layers: global_head_dim
    prompt, canvas, previous = inputs()
    keep = torch.tensor([True, False])  # the second row's self-conditioning dropped
    diffs = {}
    with torch.no_grad():
        for name, signal, mask in (("first step", None, None), ("self-conditioned", previous, None),
                                   ("per-row mask", previous, keep)):  # fmt: skip
            expected = reference(hf, prompt, canvas, signal, self_conditioning_mask=mask)
            got = ours(prompt, canvas, signal, self_conditioning_mask=mask)
            assert got.dtype == torch.float32 and got.shape == (2, CANVAS, 97)
            diffs[name] = (got - expected).abs().max().item()
        assert max(diffs.values()) <= TOLERANCE, diffs
        # what the comparison sees: capped logits, the signal, the whole prompt
        assert 1.2 < expected.abs().max() < 2.0  # inside the cap of 2, where tanh bends
        assert (ours(prompt, canvas) - ours(prompt, canvas, previous)).abs().max() > 1e-3
        changed = prompt.clone()
        changed[:, 0] = (changed[:, 0] + 1) % 97  # outside every sliding window of the canvas
        assert (ours(changed, canvas) - ours(prompt, canvas)).abs().max() > 1e-4


def test_encode_once_append_a_canvas_and_decode_as_transformers_block_loop(folders):
    """The sampler's split: the prompt encoded once, an accepted canvas appended to its cache
    (encoder pass at the next positions), the next canvas decoded over it; and left-padded
    prompts, whose padding no token attends to."""
    hf, folder = folders
    ours = from_pretrained(folder).eval()
    prompt, canvas, previous = inputs()
    accepted = torch.randint(0, 97, (2, CANVAS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = transformers.DynamicCache(config=hf.config.get_text_config(decoder=True))
        hf.model.encoder(input_ids=prompt, cache=cache)
        after = torch.arange(PROMPT, PROMPT + CANVAS)[None]
        hf.model.encoder(input_ids=accepted, cache=cache, position_ids=after)
        expected = hf(
            decoder_input_ids=canvas, cache=cache, self_conditioning_logits=previous
        ).logits
        ours_cache = ours.encode(accepted, ours.encode(prompt))
        # full layers keep every token, sliding ones the last sliding_window - 1
        assert [k.shape[2] for k in ours_cache.keys] == [3, 15, 3, 15]
        assert ours_cache.length == PROMPT + CANVAS
        got = ours.decode(canvas, ours_cache, previous)
        assert (got - expected).abs().max().item() <= TOLERANCE

        real = torch.ones(2, PROMPT, dtype=torch.bool)
        real[1, :3] = False  # three padding tokens before the second prompt
        expected = reference(hf, prompt, canvas, previous, attention_mask=real,
                             decoder_attention_mask=torch.nn.functional.pad(real, (0, CANVAS),
                                                                            value=True))  # fmt: skip
        got = ours(prompt, canvas, previous, prompt_mask=real)
        assert (got - expected).abs().max().item() <= TOLERANCE
        assert (got[1] - ours(prompt, canvas, previous)[1]).abs().max() > 1e-4  # it masked


def test_folders_round_trip_bit_for_bit_and_transformers_reads_ours(folders, tmp_path):
    hf, folder = folders
    ours = from_pretrained(folder).eval()
    # the vision tower is carried, not run
    assert ours.hf_carried_weights and all(
        k.startswith("model.encoder.") for k in ours.hf_carried_weights
    )
    assert not any("vision" in name for name in ours.state_dict())
    ours.save_pretrained(tmp_path / "ours")
    with safe_open(str(folder / "model.safetensors"), "pt") as theirs, \
            safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as written:  # fmt: skip
        assert set(written.keys()) == set(theirs.keys())  # transformers' names, ties and all
        for key in theirs.keys():
            assert torch.equal(written.get_tensor(key), theirs.get_tensor(key)), key
    source = json.loads((folder / "config.json").read_text())
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert {k: v for k, v in saved.items() if k != "unmask"} == source
    again = from_pretrained(tmp_path / "ours").eval()
    assert again.config == ours.config
    for key, tensor in ours.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[key]), key
    for key, tensor in ours.hf_carried_weights.items():
        assert torch.equal(tensor, again.hf_carried_weights[key]), key
    back = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "ours").eval()
    prompt, canvas, previous = inputs()
    assert torch.equal(reference(back, prompt, canvas, previous),
                       reference(hf, prompt, canvas, previous))  # fmt: skip


def test_a_fresh_model_writes_a_folder_transformers_loads(tmp_path):
    cfg = config_from_hf(json.loads(transformers_model().config.to_json_string()))
    torch.manual_seed(3)
    ours = build_model(cfg).eval()
    assert ours.config.diffusion_gemma.layer_types == TEXT["layer_types"]
    ours.save_pretrained(tmp_path / "fresh")
    written = json.loads((tmp_path / "fresh" / "config.json").read_text())
    assert "vision_config" not in written and written["unmask"]["model_type"] == "diffusion_gemma"
    assert config_from_hf(written) == ours.config
    config = transformers.DiffusionGemmaConfig.from_pretrained(tmp_path / "fresh")
    config.vision_config = transformers.Gemma4VisionConfig(**VISION)  # no tower here: a small one
    theirs = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "fresh",
                                                                         config=config).eval()  # fmt: skip
    prompt, canvas, previous = inputs()
    with torch.no_grad():
        diff = ours(prompt, canvas, previous) - reference(theirs, prompt, canvas, previous)
    assert diff.abs().max().item() <= TOLERANCE


def test_a_folder_with_attention_biases_reads_the_encoders_own(tmp_path):
    """transformers ties the encoder's weights to the decoder's, never its biases: with
    attention_bias its folder stores the encoder's q/k/v/o biases too (drawn apart from the
    decoder's here, so a shared bias shows). unmask reads them, equals transformers' logits,
    writes them back bit for bit; a folder that lacks them (unmask's before it kept them)
    reads the decoder's, and weights that fit no family name the real one."""
    torch.manual_seed(0)
    config = transformers.DiffusionGemmaConfig(text_config={**TEXT, "attention_bias": True},
                                               vision_config=VISION, canvas_length=CANVAS,
                                               initializer_range=0.1)  # fmt: skip
    hf = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as theirs:
        stored = {key: theirs.get_tensor(key) for key in theirs.keys()}
    encoder_bias = "model.encoder.language_model.layers.0.self_attn.q_proj.bias"
    assert not torch.equal(stored[encoder_bias], stored[encoder_bias.replace(
        "encoder.language_model", "decoder")])  # fmt: skip
    ours = from_pretrained(tmp_path / "hf").eval()
    prompt, canvas, previous = inputs()
    with torch.no_grad():
        expected = reference(hf, prompt, canvas, previous)
        assert (ours(prompt, canvas, previous) - expected).abs().max().item() <= TOLERANCE
    ours.save_pretrained(tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as written:
        assert set(written.keys()) == set(stored)
        for key in stored:
            assert torch.equal(written.get_tensor(key), stored[key]), key
    back = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "ours").eval()
    theirs = hf.state_dict()
    assert all(torch.equal(tensor, theirs[key]) for key, tensor in back.state_dict().items())
    assert (reference(back, prompt, canvas, previous) - expected).abs().max() <= TOLERANCE

    old = tmp_path / "old"  # no encoder biases: the decoder's are the encoder's
    old.mkdir()
    (old / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    from safetensors.torch import save_file

    save_file({k: v for k, v in stored.items()
               if not (k.startswith("model.encoder.language_model") and k.endswith("bias"))},
              str(old / "model.safetensors"))  # fmt: skip
    shared = from_pretrained(old).state_dict()
    assert torch.equal(shared["model.layers.1.self_attn.encoder_o_proj_bias"],
                       stored["model.decoder.layers.1.self_attn.o_proj.bias"])  # fmt: skip
    # under LoRA the encoder pass runs the adapters too (the wrapped projection is called)
    lora = apply_lora(from_pretrained(tmp_path / "hf").eval(),
                      ours.config.model_copy(update={"lora": True, "lora_dropout": 0.0}))  # fmt: skip
    with torch.no_grad():
        assert (lora(prompt, canvas, previous) - expected).abs().max().item() <= TOLERANCE
        for name, param in lora.named_parameters():
            if ".k_proj.lora_B" in name:
                param.fill_(0.05)  # the adapters move the keys: the encoder's too
        cache = lora.encode(prompt)
        assert (cache.keys[0] - ours.encode(prompt).keys[0]).abs().max() > 1e-3
    with pytest.raises(InputError, match="tensor_parallel=2 does not split DiffusionGemma's"):
        check_tensor_parallel(resolve_model(ours.config), 2)

    plain = json.loads((tmp_path / "hf" / "config.json").read_text())
    plain["text_config"]["attention_bias"] = False
    (old / "config.json").write_text(json.dumps(plain))
    with pytest.raises(InputError, match=r"unexpected .*bias.* \(is it a "
                       r"DiffusionGemmaForBlockDiffusion \(diffusion_gemma\) checkpoint"):  # fmt: skip
        from_pretrained(old)


def test_images_and_what_the_blocks_lack_are_refused_in_one_line(folders):
    for key in ("vision_config", "image_token_id"):
        with pytest.raises(InputError, match=rf"model.diffusion_gemma.*{key}: unmask's "
                           "diffusion_gemma is text only \\(no vision tower"):  # fmt: skip
            validate_tree({"model": {"model_type": "diffusion_gemma",
                                     "diffusion_gemma": {key: {"hidden_size": 16}}}})  # fmt: skip
    with pytest.raises(InputError, match="diffusion_gemma holds model_type diffusion_gemma"):
        validate_tree({"model": {"model_type": "qwen3_dllm", "diffusion_gemma": {}}})
    with pytest.raises(InputError, match="has router_score='softmax'"):
        validate_tree({"model": {"model_type": "diffusion_gemma", "router_score": "sigmoid"}})
    _, folder = folders
    source = json.loads((folder / "config.json").read_text())
    for change, message in (
        ({"tie_word_embeddings": False}, "tie_word_embeddings=false .* not supported yet"),
        ({"text_config": {**source["text_config"], "use_bidirectional_attention": "all"}},
         "use_bidirectional_attention='all' is not supported"),
        ({"text_config": {**source["text_config"], "hidden_activation": "silu"}},
         "hidden_activation='silu' is not supported; need gelu_pytorch_tanh"),
        ({"text_config": {k: v for k, v in source["text_config"].items() if k != "num_experts"}},
         "num_experts / top_k_experts are missing"),
    ):  # fmt: skip
        with pytest.raises(InputError, match=message):
            config_from_hf({**source, **change})


# The 26B-A4B: transformers' defaults (configuration_diffusion_gemma.py: RoPE parameters per
# layer type, 5:1 sliding pattern, vocabulary, soft-cap 30, canvas 256) with the sizes of the
# published Gemma 4 26B-A4B text model that DiffusionGemma's backbone is (its EP-plan comment
# names google/gemma-4-26B-A4B-it and its 2 global key/value heads).
CONFIG_26B_A4B = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"],
    "model_type": "diffusion_gemma",
    "canvas_length": 256,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "diffusion_gemma_text", "vocab_size": 262_144, "hidden_size": 2816,
        "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
        "num_key_value_heads": 8, "num_global_key_value_heads": 2, "head_dim": 256,
        "global_head_dim": 512, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "sliding_window": 1024, "max_position_embeddings": 262_144,
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": "vision",
        "layer_types": ([SLIDING] * 5 + [FULL]) * 5,
        "rope_parameters": {
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                   "rope_theta": 1_000_000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
}  # fmt: skip


def test_26b_a4b_builds_on_the_meta_device_with_its_parameter_counts():
    cfg = config_from_hf(CONFIG_26B_A4B)
    model = build_empty(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    h, inner, experts, vocab = 2816, 2112, 128, 262_144
    sliding = 2 * h * 16 * 256 + 2 * h * 8 * 256  # q, o; k, v
    full = 2 * h * 16 * 512 + h * 2 * 512  # q, o; k (V is the normed K)
    moe = experts * h + experts * 3 * 704 * h + h + experts  # router (proj, scale, per expert)
    norms = 7 * h + 2 * 256  # layer norms, q/k norms (the layer scalars are buffers)
    layer = 3 * h * inner + moe + norms
    total = (
        vocab * h
        + 25 * (sliding + layer)
        + 5 * (full + layer - 2 * 256 + 2 * 512)
        + h
        + 3 * h * inner
        + h
    )  # final norm; self-conditioning's MLP and pre-norm
    assert model.num_parameters() == total
    assert round(total / 1e9, 1) == 25.3  # "25.2B" published, with its vision encoder apart
    active = model.num_active_parameters()
    assert active == total - 30 * (experts - 8) * 3 * 704 * h
    assert round(active / 1e9, 1) == 3.8  # "3.8B active"
    print(f"26B-A4B: {total:,} parameters, {active:,} active per token")
    # the shape's per-layer matmul weights are the layers' own
    shape = shape_of(cfg)
    assert shape is FAMILIES["diffusion_gemma"].shape and not shape.staged
    for index, block in enumerate(model.model.layers):
        linears = sum(m.in_features * m.out_features for m in block.modules()
                      if isinstance(m, torch.nn.Linear))  # fmt: skip
        routed = sum(m.active_matmul_params() for m in block.modules() if isinstance(m, Experts))
        assert shape.layer_matmul_params(cfg, index) == linears + routed, index
    assert shape.attention_width(cfg) == round((25 * 16 * 256 + 5 * 16 * 512) / 30)


def test_the_model_section_defaults_and_round_trips():
    cfg = ModelConfig(model_type="diffusion_gemma", num_hidden_layers=7)
    section = cfg.diffusion_gemma
    assert section.layer_types == [SLIDING] * 5 + [FULL, FULL]  # resolved; the last is full
    assert section.global_head_dim == cfg.resolved_head_dim and cfg.num_experts == 8
    assert ModelConfig().diffusion_gemma is None  # every other family: no section
    with pytest.raises(ValueError, match="the last layer must be full_attention"):
        ModelConfig(model_type="diffusion_gemma", num_hidden_layers=2,
                    diffusion_gemma={"layer_types": [FULL, SLIDING]})  # fmt: skip


def test_called_as_the_native_decoder_it_refuses_in_one_line():
    model = build_model(ModelConfig(model_type="diffusion_gemma", num_hidden_layers=2))
    ids = torch.zeros(1, 4, dtype=torch.long)
    for call in (
        lambda: model(ids),
        lambda: model(ids, targets=ids),
        lambda: model(ids, doc_ids=ids),
    ):
        with pytest.raises(InputError, match="not one row of tokens; train it with "
                           "diffusion.objective uniform"):  # fmt: skip
            call()


def test_it_trains_with_uniform_only_and_plans_without_tensor_or_pipeline_parallelism():
    from unmask.config import load_config
    from unmask.plan.shards import planned_model_config
    from unmask.train.setup import plan_parallel

    cfg = load_config(None, ["model.model_type=diffusion_gemma"])  # the quickstart's mdlm
    with pytest.raises(InputError, match=r"^model 'diffusion_gemma' \(a canvas decoder\) has "
                       r"no \[MASK\] token: diffusion.objective 'mdlm' needs one"):  # fmt: skip
        plan_parallel(cfg, 1)
    cfg = load_config(None, ["model.model_type=diffusion_gemma", "diffusion.objective=uniform",
                             "eval.generate_accuracy=false",
                             "model.diffusion_gemma.canvas_length=8"])  # fmt: skip
    assert plan_parallel(cfg, 1).dims.world_size == 1  # the trainer's checks pass
    assert planned_model_config(cfg) is cfg  # planned (tests/unit/test_plan_diffusion_gemma.py)
    for key in ("tensor_parallel", "pipeline_parallel"):
        with pytest.raises(InputError, match=rf"^parallel.{key}=2: model_type 'diffusion_gemma' "
                           r"(trains under tensor parallelism, but unmask plan does not model|has no pipeline stages)"):  # fmt: skip
            planned_model_config(cfg.model_copy(update={
                "parallel": cfg.parallel.model_copy(update={key: 2})}))  # fmt: skip
