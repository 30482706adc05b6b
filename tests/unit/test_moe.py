"""MoE families: logit parity with transformers' Qwen3-MoE and OLMoE, folder round trips,
grouped GEMM vs the sorted-token loop, routing rules, refusals of bad configs."""

import json

import pytest
import torch
import transformers
from conftest import CUDA, PARITY_SIZES, perturb_norms
from safetensors.torch import load_file, save_file

from unmask.errors import InputError
from unmask.models import from_pretrained
from unmask.models.build import build_model
from unmask.models.config import ModelConfig
from unmask.models.moe import Experts, Router, grouped_mm_fits, moe_blocks

MOE_SIZES = {"num_experts": 8, "num_experts_per_tok": 2}


def _hf_bidirectional_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers logits with an all-True 4-D mask (a 4-D mask replaces the causal one)."""
    batch, length = ids.shape
    full = torch.ones(batch, 1, length, length, dtype=torch.bool)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=full).logits


def _tiny_hf(kind: str):
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **PARITY_SIZES, **MOE_SIZES, head_dim=16, moe_intermediate_size=32,
            norm_topk_prob=True, rope_theta=1e4, mlp_only_layers=[1],
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        sizes = {**PARITY_SIZES, "intermediate_size": 32}
        cfg = transformers.OlmoeConfig(**sizes, **MOE_SIZES, rope_theta=1e4, clip_qkv=4.0)
        model = transformers.OlmoeForCausalLM(cfg)
    with torch.no_grad():  # routers start at zero in transformers: every expert ties
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return perturb_norms(model)


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_logits_match_transformers_moe(tmp_path, kind):
    hf_model = _tiny_hf(kind)
    hf_model.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    assert ours.config.model_type == {"qwen3_moe": "qwen3_moe_dllm", "olmoe": "llada_moe"}[kind]
    assert len(moe_blocks(ours)) == (1 if kind == "qwen3_moe" else 2)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = _hf_bidirectional_logits(hf_model, ids)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 97
    assert (_hf_bidirectional_logits(hf_model, changed)[:, 0] - reference[:, 0]).abs().max() > 1e-4
    with torch.no_grad():
        logits = ours(ids)
    assert (logits - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_export_reloads_in_transformers_with_equal_logits(tmp_path, kind):
    hf_model = _tiny_hf(kind)
    hf_model.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == kind
    cls = transformers.Qwen3MoeForCausalLM if kind == "qwen3_moe" else transformers.OlmoeForCausalLM
    reloaded = cls.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_hf_bidirectional_logits(reloaded, ids),
                       _hf_bidirectional_logits(hf_model, ids))  # fmt: skip


def _tiny(model_type: str, **extra) -> ModelConfig:
    sizes = {**PARITY_SIZES, "moe_intermediate_size": 32, "head_dim": 16}
    return ModelConfig(model_type=model_type, **{**sizes, **MOE_SIZES, **extra})


LLADA2 = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
          "first_k_dense_replace": 1, "num_shared_experts": 1}  # fmt: skip


@pytest.mark.parametrize(
    "model_type, extra",
    [("qwen3_moe_dllm", {}), ("llada_moe", {"clip_qkv": 3.0}), ("llada2_moe", LLADA2)],
)
def test_read_save_read_is_bit_exact(tmp_path, model_type, extra):
    torch.manual_seed(0)
    first = build_model(_tiny(model_type, **extra))
    if model_type == "llada2_moe":
        with torch.no_grad():
            moe_blocks(first)[0].gate.expert_bias.normal_()
    first.save_pretrained(tmp_path / "a")
    loaded = from_pretrained(tmp_path / "a")
    loaded.save_pretrained(tmp_path / "b")
    a, b = (
        load_file(tmp_path / "a" / "model.safetensors"),
        load_file(tmp_path / "b" / "model.safetensors"),
    )
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in first.state_dict().items())
    assert (tmp_path / "a" / "config.json").read_bytes() == (
        tmp_path / "b" / "config.json"
    ).read_bytes()


def test_llada2_layout_names(tmp_path):
    torch.manual_seed(0)
    model = build_model(_tiny("llada2_moe", **LLADA2))
    model.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llada2_moe" and config["partial_rotary_factor"] == 0.5
    assert {config[k] for k in ("n_group", "topk_group", "num_shared_experts")} == {4, 2, 1}
    for key in ("model.word_embeddings.weight", "model.layers.1.attention.query_key_value.weight",
                "model.layers.1.attention.dense.weight", "model.layers.1.attention.query_layernorm.weight",
                "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias",
                "model.layers.1.mlp.experts.7.down_proj.weight",
                "model.layers.1.mlp.shared_experts.up_proj.weight",
                "model.layers.0.mlp.gate_proj.weight"):  # fmt: skip
        assert key in keys, key
    assert load_file(tmp_path / "model.safetensors")[
        "model.layers.1.attention.query_key_value.weight"
    ].shape == ((4 + 2 * 2) * 16, 64)


def test_expert_count_disagreeing_with_weights_is_refused(tmp_path):
    torch.manual_seed(0)
    build_model(_tiny("qwen3_moe_dllm")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts"] = 4
    config["unmask"]["moe"]["num_experts"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="num_experts=4 but the weights of .* hold 8 experts"):
        from_pretrained(tmp_path)


# the CUDA cases run where a GPU is present (CUDA's bf16 grouped GEMM is the fast path on
# sm90; float32 takes torch's fallback) and are skipped elsewhere
DEVICES = ["cpu", CUDA]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_sorted_loop_and_gradients(dtype, device):
    cfg = _tiny("qwen3_moe_dllm")
    experts = Experts(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    assert grouped_mm_fits(64, 32, dtype=dtype)
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 2], device=device)
    x = torch.randn(int(counts.sum()), 64, dtype=dtype, device=device, requires_grad=True)
    results = []
    for implementation in ("grouped_mm", "loop"):
        experts.implementation = implementation
        out = experts(x, counts)
        grads = torch.autograd.grad(out.float().square().sum(), [x, *experts.parameters()])
        results.append((out, grads))
    tol = 0 if dtype == torch.float32 else 2e-2
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, atol=tol + 1e-5, rtol=tol + 1e-5)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, atol=tol + 1e-4, rtol=tol + 1e-4)


def test_group_limited_sigmoid_router_matches_a_per_token_reference():
    cfg = _tiny("llada2_moe", **LLADA2)
    router = Router(cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        router.weight.normal_()
        router.expert_bias.normal_(0, 0.3)
    x = torch.randn(20, 64)
    experts, weights, logits = router(x)
    for t in range(20):  # reference: plain Python over groups, per token
        scores = torch.sigmoid(x[t] @ router.weight.T)
        biased = scores + router.expert_bias
        groups = [sorted(biased[g * 2 : g * 2 + 2].tolist(), reverse=True) for g in range(4)]
        best = sorted(range(4), key=lambda g: -(groups[g][0] + groups[g][1]))[:2]
        allowed = [e for e in range(8) if e // 2 in best]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:2]
        assert sorted(experts[t].tolist()) == sorted(chosen)
        want = scores[chosen] / scores[chosen].sum() * 2.5
        got = dict(zip(experts[t].tolist(), weights[t].tolist()))
        assert [got[e] for e in chosen] == pytest.approx(want.tolist(), rel=1e-6)


def test_mfu_counts_active_parameters_only():
    from unmask.train.mfu import flop_model

    model = build_model(_tiny("qwen3_moe_dllm"))
    dense = build_model(ModelConfig(**{**PARITY_SIZES, "intermediate_size": 64}))
    # top-2 experts of width 32 = one dense MLP of width 64, plus the 8 x 64 router
    assert flop_model(model).matmul_params == flop_model(dense).matmul_params + 2 * 8 * 64


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) is above num_experts \(8\)"),
        ({"n_group": 3}, r"n_group \(3\) must divide num_experts \(8\)"),
        ({"n_group": 2, "topk_group": 3}, r"topk_group \(3\) is above n_group \(2\)"),
    ],
)
def test_bad_moe_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        _tiny("qwen3_moe_dllm", **fields)


def test_fused_transformers_layout_is_read(tmp_path):
    torch.manual_seed(0)
    model = build_model(_tiny("qwen3_moe_dllm"))
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    fused = {k: v for k, v in state.items() if ".experts." not in k}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([state[f"{prefix}.{e}.gate_proj.weight"] for e in range(8)])
        up = torch.stack([state[f"{prefix}.{e}.up_proj.weight"] for e in range(8)])
        fused[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{prefix}.down_proj"] = torch.stack(
            [state[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])  # fmt: skip
    save_file(fused, tmp_path / "model.safetensors")
    again = from_pretrained(tmp_path)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


def test_activation_checkpointing_counts_the_load_once_and_keeps_gradients():
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(_tiny("qwen3_moe_dllm", router_aux_loss_coef=0.1)).train()
        model.gradient_checkpointing = checkpointing
        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
        model(ids).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        loads = [b.load.clone() for b in moe_blocks(model)]
        results.append((grads, loads, [b.aux_sum.clone() for b in moe_blocks(model)]))
    (g0, l0, a0), (g1, l1, a1) = results
    assert all(torch.equal(x, y) for x, y in zip(l0, l1)) and l0[0].sum() == 2 * 12 * 2
    assert all(torch.equal(x, y) for x, y in zip(a0, a1)) and a0[0] > 0
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7)


def test_aux_and_z_loss_gradients_equal_the_written_out_losses():
    from unmask.models.moe import SparseMoE

    torch.manual_seed(0)
    cfg = _tiny("qwen3_moe_dllm", router_aux_loss_coef=0.3, router_z_loss_coef=0.2)
    block = SparseMoE(cfg).train()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(1, 10, 64)
    block(x).sum().backward()
    ours = block.gate.weight.grad.clone()
    block.zero_grad()
    block.aux_coef = block.z_coef = 0.0  # the plain output, then the losses by hand
    out = block(x).sum()
    logits = x[0] @ block.gate.weight.T
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(2).indices.reshape(-1), minlength=8).float()
    aux = 0.3 * 8 * ((counts / (10 * 2)) * probs.mean(0)).sum()
    z = 0.2 * logits.logsumexp(-1).square().mean()
    (out + aux + z).backward()
    torch.testing.assert_close(ours, block.gate.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "model_type, fields, message",
    [
        ("qwen3_dllm", {}, r"qwen3_dllm is dense; num_experts \(8\) needs an MoE family"),
        ("qwen3_moe_dllm", {"num_shared_experts": 1}, r"have no shared experts.*llada2_moe"),
        ("llada_moe", {"num_shared_experts": 1}, r"have no shared experts.*llada2_moe"),
    ],
)
def test_experts_a_family_cannot_save_are_refused(model_type, fields, message):
    # a dense family with experts, or shared experts in a transformers MoE layout, would
    # write a folder that transformers reads without them
    with pytest.raises(ValueError, match=message):
        _tiny(model_type, **fields)


# What a LLaDA2.1 folder's config.json carries beyond the fields unmask reads. The 2.1 model
# cards give 2.0's architecture; one public note sourced from LLaDA2.1-mini's config.json
# lists the same fields plus `sliding_window: 4096`, which its remote code leaves inert (no
# `use_sliding_window`). Keys of the remote-code layout unmask does not run ride along too.
LLADA2_1_EXTRA = {"sliding_window": 4096, "moe_router_enable_expert_bias": True,
                  "router_dtype": "fp32", "score_function": "sigmoid",
                  "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                               "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
                  "output_router_logits": False, "use_rmsnorm": True}  # fmt: skip


def test_a_llada2_1_folder_loads_and_saves_unchanged(tmp_path):
    """A LLaDA2.0 folder given LLaDA2.1's extra config keys: loads with the same logits as
    without them, and saving it writes its config.json byte for byte and its weights bit for
    bit."""
    torch.manual_seed(0)
    first = build_model(_tiny("llada2_moe", **LLADA2))
    first.save_pretrained(tmp_path / "v20")
    config = json.loads((tmp_path / "v20" / "config.json").read_text())
    config.pop("unmask", None)  # a folder from the hub has no unmask tag
    source = tmp_path / "v21"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({**config, **LLADA2_1_EXTRA}, indent=2))
    (source / "model.safetensors").write_bytes(
        (tmp_path / "v20" / "model.safetensors").read_bytes()
    )
    loaded = from_pretrained(source)
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids), first(ids))
    loaded.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_bytes() == (source / "config.json").read_bytes()
    a, b = (
        load_file(source / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_logits_are_float32_under_bf16_autocast(score):
    """Under bf16 autocast the router's matmul runs in float32 (autocast would cast
    `x.float()` and the float32 weight back to bf16): logits, scores and the chosen experts
    equal the float32 computation bit for bit; the bf16 matmul autocast would have run
    gives other logits (what the test tells apart)."""
    extra = {"router_score": "sigmoid"} if score == "sigmoid" else {}
    router = Router(_tiny("qwen3_moe_dllm", **extra))
    torch.manual_seed(4)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(32, 64).to(torch.bfloat16)  # the bf16 residual stream
    with torch.autocast("cpu", dtype=torch.bfloat16):
        experts, weights, logits = router(x)
        bf16_logits = torch.nn.functional.linear(x.float(), router.weight.float())
    want = x.float() @ router.weight.T
    assert logits.dtype == torch.float32 and torch.equal(logits, want)
    assert bf16_logits.dtype == torch.bfloat16 and not torch.equal(bf16_logits.float(), want)
    scores = want.softmax(-1) if score == "softmax" else want.sigmoid()
    chosen = scores.topk(2, dim=-1)
    assert torch.equal(experts, chosen.indices)
    picked = chosen.values / (chosen.values.sum(-1, keepdim=True) + 1e-20)
    assert torch.equal(weights, picked if score == "sigmoid" else chosen.values)


class StackCasts:
    """Counts the casts (`aten._to_copy`) of the given tensors' storages to bfloat16 made
    inside it (a TorchDispatchMode: what autograd and the module code dispatch)."""

    def __init__(self, stacks):
        from torch.utils._python_dispatch import TorchDispatchMode

        storages = {s.untyped_storage().data_ptr() for s in stacks}
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if (func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
                        and args[0].untyped_storage().data_ptr() in storages):  # fmt: skip
                    counter.count += 1
                return out

        self.count, self.mode = 0, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


MOE_RUN = {"model": {"model_type": "llada_moe", "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32}}  # fmt: skip


@pytest.mark.parametrize("family", ["llada_moe", "diffusion_gemma"])
def test_expert_stacks_are_cast_once_a_step_with_the_plain_paths_losses_and_grads(
    tiny_config, tmp_path, monkeypatch, family
):
    """Two steps of two micro-batches under bf16 autocast over float32 masters: each expert
    stack is cast to bf16 once a step (2 layers x 3 stacks for llada_moe; 2 x 2 for
    diffusion_gemma, whose micro-batch runs the experts in 5 layer passes: the encoder's
    first layer, the self-conditioning and the decoder pass over both), where a cast per
    pass made 2 (micro-batches) x that many; the losses and every parameter after the steps
    equal the plain path's bit for bit."""
    import contextlib

    from conftest import TINY_GEMMA, deep_update

    import unmask.train.step as step_module
    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    tree = deep_update(TINY_GEMMA if family == "diffusion_gemma" else MOE_RUN,
                       {"train": {"bf16": True, "gradient_accumulation_steps": 2}})  # fmt: skip
    results = []
    for cached in (True, False):
        if not cached:  # the plain path: a cast at every use
            monkeypatch.setattr(step_module, "step_casts", contextlib.nullcontext)
        tree["train"]["output_dir"] = str(tmp_path / str(cached))
        trainer = Trainer(load_config(tiny_config(tree, name=f"{cached}.yaml")))
        stacks = [p for n, p in trainer.model.named_parameters() if "experts." in n
                  and "shared" not in n and p.ndim == 3]  # fmt: skip
        assert len(stacks) == (6 if family == "llada_moe" else 4)
        losses, counts = [], []
        for _ in range(2):
            batches = [next(trainer.loader) for _ in range(2)]
            with StackCasts(stacks) as casts:
                stats = trainer.train_step(batches)
            trainer.step += 1
            losses.append(float(stats["loss"]))
            counts.append(casts.count)
        results.append((losses, counts, dict(trainer.model.named_parameters())))
    (losses, counts, params), (plain_losses, plain_counts, plain_params) = results
    passes = 1 if family == "llada_moe" else 5 / 2  # layer passes a micro-batch, per layer
    assert counts == [len(stacks)] * 2
    assert plain_counts == [int(2 * passes * len(stacks))] * 2
    assert losses == plain_losses
    for name, p in params.items():
        assert torch.equal(p, plain_params[name]), name


def test_router_gradients_are_float32_eager_and_compiled():
    """The router's two gradient matmuls run in float32 too, eager and under torch.compile
    (which traces the backward of an autocast-off region under the forward's autocast: a
    plain `F.linear` there ran them in bf16), with equal gradients both ways."""
    from unmask.models.moe import router_logits
    from unmask.train.audit import MatmulAudit

    torch.manual_seed(5)
    weight = torch.randn(8, 64, requires_grad=True)
    x = torch.randn(32, 64).to(torch.bfloat16)
    compiled = torch.compile(router_logits, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (router_logits, compiled):
        xs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = fn(xs, weight)
        assert logits.dtype == torch.float32
        with MatmulAudit() as audit:
            grad_x, grad_w = torch.autograd.grad(logits.square().sum(), [xs, weight])
        assert [r.dtype for r in audit.records] == [torch.float32] * 2
        assert grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
        grads.append((grad_x, grad_w))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
