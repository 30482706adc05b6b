"""Native diffusion transformer: masks, positions, backends, loss path, resize, errors."""

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import CUDA, tiny_model

import unmask.models
from unmask.errors import InputError
from unmask.models import (
    MODEL_BUILDERS,
    DiffusionTransformer,
    ModelConfig,
    build_model,
    config_from_hf,
    from_pretrained,
    hf_config_dict,
)
from unmask.models.attention import (
    FLEX_MIN_HEAD_DIM,
    attend,
    build_attention_mask,
    document_runs,
    resolve_backend,
    sdpa_gqa_usable,
)
from unmask.models.transformer import document_positions

VOCAB = 61


def _model(**overrides) -> DiffusionTransformer:
    # initializer_range large enough that attention patterns matter
    fields = dict(vocab_size=VOCAB, intermediate_size=48, rope_theta=1e4, initializer_range=0.2)
    return tiny_model(**(fields | overrides)).eval()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


DOCS = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [5] * 12 + [3] * 8])  # (2, 20)


def test_parameter_names_are_hf_qwen3_keys():
    model = _model(num_hidden_layers=1)
    layer = "model.layers.0."
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"}
    expected |= {f"{layer}self_attn.{n}_norm.weight" for n in "qk"}
    expected |= {f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    expected |= {f"{layer}input_layernorm.weight", f"{layer}post_attention_layernorm.weight"}
    assert set(model.state_dict()) == expected
    assert MODEL_BUILDERS["qwen3_dllm"] is DiffusionTransformer


def test_init_statistics():
    model = _model(initializer_range=0.02, hidden_size=64, intermediate_size=256)
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones(64))


def test_document_positions_restart():
    expected = list(range(7)) + list(range(9)) + list(range(4))
    assert document_positions(DOCS)[0].tolist() == expected
    assert document_positions(DOCS)[1].tolist() == list(range(12)) + list(range(8))


def test_default_positions_are_explicit_positions():
    model, ids = _model(), _ids(2, 20)
    with torch.no_grad():
        explicit = model(ids, doc_ids=DOCS, position_ids=document_positions(DOCS))
        assert torch.equal(model(ids, doc_ids=DOCS), explicit)
        plain = model(ids, position_ids=torch.arange(20).expand(2, 20))
        assert torch.equal(model(ids), plain)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen"])
def test_documents_do_not_see_each_other(backend):
    model, ids = _model(attn_implementation=backend), _ids(2, 20)
    changed = ids.clone()
    changed[0, 7:16] = (changed[0, 7:16] + 5) % VOCAB  # rewrite document 1 of row 0
    with torch.no_grad():
        before, after = model(ids, doc_ids=DOCS), model(changed, doc_ids=DOCS)
    assert (after[0, 7:16] - before[0, 7:16]).abs().max() > 1e-3  # doc 1 itself changed
    assert (after[0, :7] - before[0, :7]).abs().max() <= 1e-6
    assert (after[0, 16:] - before[0, 16:]).abs().max() <= 1e-6
    assert torch.equal(after[1], before[1])
    with torch.no_grad():  # without doc_ids the same edit reaches every position
        full_before, full_after = model(ids), model(changed)
    assert (full_after[0, :7] - full_before[0, :7]).abs().max() > 1e-4


def test_packed_row_equals_documents_run_alone():
    model, ids = _model(), _ids(2, 20)
    with torch.no_grad():
        packed = model(ids, doc_ids=DOCS)
        for row, spans in ((0, [(0, 7), (7, 16), (16, 20)]), (1, [(0, 12), (12, 20)])):
            for start, end in spans:
                alone = model(ids[row : row + 1, start:end])[0]
                assert (packed[row, start:end] - alone).abs().max() <= 1e-5


# CUDA: the compiled (Triton) flex kernel against CUDA's sdpa; skipped without a GPU
DEVICES = ["cpu", CUDA]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [8, 16])  # on CUDA: 8 runs flex unfused, 16 compiled
@pytest.mark.parametrize("packed", [True, False])
def test_sdpa_and_flex_agree(packed, head_dim, device):
    sdpa = _model(attn_implementation="sdpa", head_dim=head_dim).to(device)
    flex = _model(attn_implementation="flex", head_dim=head_dim).to(device)
    ids = _ids(2, 20).to(device)
    docs = DOCS.to(device) if packed else None
    with torch.no_grad():
        assert (sdpa(ids, doc_ids=docs) - flex(ids, doc_ids=docs)).abs().max() <= 1e-5


def test_auto_picks_flex_on_cuda_only_for_heads_the_compiled_kernel_takes():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_backend("auto", DOCS, cuda, FLEX_MIN_HEAD_DIM) == "flex"
    assert resolve_backend("auto", DOCS, cuda, 8) == "varlen"  # the kernel refuses < 16
    assert resolve_backend("auto", None, cuda, 64) == "sdpa"  # no documents: no mask
    assert resolve_backend("auto", DOCS, cpu, 64) == "varlen"
    assert resolve_backend("flex", DOCS, cuda, 8) == "flex"  # asked for: the unfused path


#: rows with different layouts; row 1's document 4 comes back after document 3 (its two
#: runs attend to each other, as under the dense mask)
SCATTERED = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [4] * 5 + [3] * 8 + [4] * 7])


def test_document_runs_group_a_returning_id():
    assert document_runs(SCATTERED) == (
        (((0, 7),), ((7, 16),), ((16, 20),)),
        (((0, 5), (13, 20)), ((5, 13),)),
    )
    assert document_runs(torch.zeros(1, 6, dtype=torch.long)) == ((((0, 6),),),)


def test_document_runs_read_the_device_once(monkeypatch):
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    document_runs(SCATTERED)
    assert reads == [1]


@pytest.mark.parametrize("docs", [DOCS, SCATTERED, DOCS[:1].expand(3, 20)])
def test_varlen_equals_dense_sdpa_outputs_and_gradients(docs):
    """varlen (one sdpa call per document, no mask) against sdpa with the dense (B, 1, L, L)
    document mask: outputs and the gradients of q, k, v (GQA: 6 query, 2 K/V heads)."""
    g = torch.Generator().manual_seed(7)
    batch = docs.shape[0]
    q = torch.randn(batch, 6, 20, 8, generator=g, requires_grad=True)
    k = torch.randn(batch, 2, 20, 8, generator=g, requires_grad=True)
    v = torch.randn(batch, 2, 20, 8, generator=g, requires_grad=True)
    dense, varlen = build_attention_mask(docs, "sdpa"), build_attention_mask(docs, "varlen")
    assert varlen.dense is None and dense.dense.shape == (batch, 1, 20, 20)
    ours, want = attend(q, k, v, varlen, scale=0.3), attend(q, k, v, dense, scale=0.3)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(ours.shape, generator=g)
    got = torch.autograd.grad((ours * upstream).sum(), [q, k, v])
    ref = torch.autograd.grad((want * upstream).sum(), [q, k, v])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_picks_varlen_for_packed_rows_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", DOCS, cpu, 16) == "varlen"
    assert resolve_backend("auto", None, cpu, 16) == "sdpa"
    varlen, sdpa = _model(attn_implementation="varlen"), _model(attn_implementation="sdpa")
    ids = _ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(varlen(ids, doc_ids=SCATTERED), sdpa(ids, doc_ids=SCATTERED),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_enable_gqa_equals_repeated_kv(masked):
    """attend() hands sdpa the shared K/V heads (enable_gqa) on CPU: the same outputs and
    gradients as repeating each K/V head for its query heads first."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 20, 8, generator=g, requires_grad=True)  # 6 query heads
    k = torch.randn(2, 2, 20, 8, generator=g, requires_grad=True)  # 2 K/V heads
    v = torch.randn(2, 2, 20, 8, generator=g, requires_grad=True)
    mask = build_attention_mask(DOCS if masked else None, "sdpa")
    assert sdpa_gqa_usable(q.device, masked)
    ours = attend(q, k, v, mask, scale=0.3)
    repeated = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1),
        attn_mask=mask.dense, scale=0.3,
    )  # fmt: skip
    torch.testing.assert_close(ours, repeated, rtol=1e-6, atol=1e-6)
    upstream = torch.randn(ours.shape, generator=g)
    got = torch.autograd.grad((ours * upstream).sum(), [q, k, v])
    want = torch.autograd.grad((repeated * upstream).sum(), [q, k, v])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # CUDA's kernels that take a mask take no enable_gqa: K/V are repeated there
    assert not sdpa_gqa_usable(torch.device("cuda"), True)
    assert sdpa_gqa_usable(torch.device("cuda"), False)


def test_targets_path_matches_full_cross_entropy_and_grads():
    ids = _ids(2, 20)
    targets = _ids(2, 20, seed=7)
    targets[torch.rand(2, 20, generator=torch.Generator().manual_seed(3)) < 0.5] = -100
    ours, ref = _model(), _model()

    losses = ours(ids, doc_ids=DOCS, targets=targets, vocab_chunk=16)  # 4 vocab chunks
    logits = ref(ids, doc_ids=DOCS)
    selected = targets != -100
    expected = F.cross_entropy(logits[selected], targets[selected], reduction="none")
    assert losses.shape == (2, 20) and losses.dtype == torch.float32
    assert torch.equal(losses[~selected], torch.zeros(int((~selected).sum())))
    assert (losses[selected] - expected).abs().max() <= 1e-5

    losses.sum().backward()
    expected.sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, param in ours.named_parameters():
        assert (param.grad - ref_grads[name].grad).abs().max() <= 1e-5, name


def test_all_ignored_targets_give_zero_loss_and_zero_grads():
    model = _model()
    losses = model(_ids(1, 8), targets=torch.full((1, 8), -100))
    assert torch.equal(losses, torch.zeros(1, 8))
    losses.sum().backward()
    assert torch.equal(model.lm_head.weight.grad, torch.zeros_like(model.lm_head.weight))


def test_gradient_checkpointing_gives_same_grads():
    plain, ckpt = _model(), _model()
    ckpt.gradient_checkpointing = True
    ids, targets = _ids(2, 20), _ids(2, 20, seed=4)
    plain(ids, doc_ids=DOCS, targets=targets).sum().backward()
    ckpt(ids, doc_ids=DOCS, targets=targets).sum().backward()
    ckpt_grads = dict(ckpt.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.allclose(param.grad, ckpt_grads[name].grad, atol=1e-6), name


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_mean_init(tied):
    model = _model(tie_word_embeddings=tied)
    old_embed = model.model.embed_tokens.weight.detach().clone()
    old_head = model.lm_head.weight.detach().clone()
    model.resize_token_embeddings(VOCAB + 3)

    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert model.config.vocab_size == VOCAB + 3 and embed.shape == (VOCAB + 3, 32)
    assert torch.equal(embed[:VOCAB], old_embed)
    assert torch.allclose(embed[VOCAB:], old_embed.mean(0).expand(3, 32), atol=1e-7)
    assert torch.equal(head[:VOCAB], old_head)
    assert torch.allclose(head[VOCAB:], old_head.mean(0).expand(3, 32), atol=1e-7)
    assert (head is embed) == tied
    assert model(_ids(1, 5)).shape == (1, 5, VOCAB + 3)


def test_tied_embeddings_share_storage():
    model = _model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    untied = _model()
    assert model.num_parameters() == untied.num_parameters() - VOCAB * 32


def test_bf16_autocast_close_to_fp32():
    model, ids = _model(), _ids(2, 20)
    with torch.no_grad():
        reference = model(ids, doc_ids=DOCS)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(ids, doc_ids=DOCS)
            losses = model(ids, doc_ids=DOCS, targets=ids)
    assert low.dtype == torch.bfloat16 and losses.dtype == torch.float32
    scale = reference.abs().max()
    assert (low.float() - reference).abs().max() <= 0.05 * scale
    assert torch.isfinite(losses).all()


def test_save_and_reload_roundtrip(tmp_path):
    model = _model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "out")
    cfg = ModelConfig(pretrained=str(tmp_path / "out"), attn_implementation="sdpa")
    again = build_model(cfg)
    assert again.config.attn_implementation == "sdpa"
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[key]), key
    as_bf16 = from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    assert as_bf16.model.norm.weight.dtype == torch.bfloat16


def test_config_mapping_roundtrip():
    cfg = ModelConfig(vocab_size=50, head_dim=8, rope_theta=5e5, tie_word_embeddings=True)
    hf = hf_config_dict(cfg)
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    assert config_from_hf(hf) == cfg
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    assert config_from_hf(legacy).rope_theta == 5e5
    assert ModelConfig().resolved_head_dim == 32


def _write_folder(folder, config=None):
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_error_messages(tmp_path):
    with pytest.raises(InputError, match="does not exist; set model.pretrained"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(InputError, match="config.json' is missing"):
        from_pretrained(_write_folder(tmp_path / "empty"))
    mistral = hf_config_dict(ModelConfig()) | {"model_type": "mistral"}  # llama is supported
    with pytest.raises(InputError, match="model_type 'mistral' is not supported"):
        from_pretrained(_write_folder(tmp_path / "mistral", mistral))
    with pytest.raises(InputError, match="no weights in .*expected model.safetensors"):
        from_pretrained(_write_folder(tmp_path / "noweights", hf_config_dict(ModelConfig())))
    yarn = hf_config_dict(ModelConfig()) | {"rope_parameters": {"rope_type": "yarn"}}
    with pytest.raises(InputError, match="RoPE scaling type 'yarn' is not supported"):
        config_from_hf(yarn)


def test_mismatched_weights_error(tmp_path):
    _model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="do not match config.json: missing .*layers.2"):
        from_pretrained(tmp_path)


def test_config_rejects_unknown_keys_and_bad_heads():
    with pytest.raises(ValueError, match="num_hidden_layer"):
        ModelConfig(num_hidden_layer=2)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    assert ModelConfig.model_fields["rope_theta"].description.startswith("RoPE base")


def test_models_package_imports_form_no_cycle():
    """Every unmask import in unmask/models is at module level, and the module graph is a
    DAG (hf.py below transformer.py, build.py above both)."""
    package = Path(unmask.models.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        graph[path.stem] = set()
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in (n for n in names if n.startswith("unmask")):
                assert node in top, f"{path.name}:{node.lineno} imports {name} in a function"
                if name.startswith("unmask.models.") and path.stem != "__init__":
                    graph[path.stem].add(name.split(".")[2])
    assert "transformer" not in graph["hf"] and "build" not in graph["transformer"]
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, f"import cycle: {' -> '.join((*stack, module))}"
        if module not in done:
            for dep in graph.get(module, ()):
                visit(dep, (*stack, module))
            done.add(module)

    for module in graph:
        visit(module, ())


@pytest.mark.parametrize(("flag", "layers"), [(False, []), (True, [0, 1, 2, 3]), (2, [0, 2]),
                                              (3, [0, 3])])  # fmt: skip
def test_activation_checkpointing_none_full_selective_same_gradients(monkeypatch, flag, layers):
    """Selective checkpointing recomputes every n-th layer only; the gradients are those of
    the plain backward (recomputation is exact)."""
    import unmask.models.transformer as transformer
    from unmask.config.train import TrainConfig
    from unmask.models import ModelConfig, build_model
    from unmask.train.setup import checkpointing_choice

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    grads = []
    seen = []
    real = transformer.checkpoint

    def counting(layer, *args, **kwargs):
        seen.append(list(model.model.layers).index(layer))
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(transformer, "checkpoint", counting)
    for setting in (False, flag):
        torch.manual_seed(0)
        model = build_model(cfg)
        model.gradient_checkpointing = setting
        seen.clear()
        model(ids, targets=ids).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert seen == layers
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)
    choice = {"none": False, "full": True, "selective": 3}
    for name, want in choice.items():
        train = TrainConfig(activation_checkpointing=name, activation_checkpointing_every=3)
        assert checkpointing_choice(train) == want
    assert checkpointing_choice(TrainConfig(gradient_checkpointing=True)) is True
