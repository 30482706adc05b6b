"""MuonAdamW: parity with torch.optim.Muon + AdamW, routing, dtypes, checkpoints, schedules."""

import copy
import io
import logging

import pytest
import torch
from conftest import TINY_MODEL, newton_schulz_calls, tiny_model
from pydantic import ValidationError
from torch import nn

from unmask.errors import InputError
from unmask.optim import MuonAdamW, OptimConfig, build_optimizer, lr_scale, route_parameters
from unmask.optim import updates as updates_module
from unmask.optim.newton_schulz import orthogonalize

VOCAB = 64
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
#: the tiny model's fields here (2 layers unless a test says otherwise)
QWEN = {"vocab_size": VOCAB, "intermediate_size": 48, "num_attention_heads": 2,
        "num_key_value_heads": 1}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def _qwen(layers: int = 2, tied: bool = False, seed: int = 0) -> nn.Module:
    return tiny_model(seed, **QWEN, num_hidden_layers=layers, tie_word_embeddings=tied)


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (2, 12), generator=g),
            torch.randint(0, VOCAB, (2, 12), generator=g),
        )
        for _ in range(n)
    ]


def _loss(model: nn.Module, batch) -> torch.Tensor:
    ids, targets = batch
    return model(ids, targets=targets).float().mean()


def _train(model: nn.Module, opts, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss = _loss(model, batch)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _names(named) -> set[str]:
    return {n for n, _ in named}


def _qwen_names(layers: int) -> tuple[set[str], set[str]]:
    """(Muon matrices, norm weights) of a qwen3_dllm with `layers` layers."""
    muon, norms = set(), {"model.norm.weight"}
    for i in range(layers):
        pre = f"model.layers.{i}"
        muon |= {f"{pre}.self_attn.{m}.weight" for m in ATTN}
        muon |= {f"{pre}.mlp.{m}.weight" for m in MLP}
        norms |= {f"{pre}.self_attn.q_norm.weight", f"{pre}.self_attn.k_norm.weight"}
        norms |= {f"{pre}.input_layernorm.weight", f"{pre}.post_attention_layernorm.weight"}
    return muon, norms


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_parity_with_torch_muon_and_adamw(adjust_lr, fused):
    """Configured like torch.optim.Muon (jordan, bf16 NS, lerp momentum, Nesterov), five
    steps equal torch.optim.Muon on every Muon matrix and torch.optim.AdamW on the rest,
    bit for bit (same operations in the same order; batched NS equals per-matrix NS); the
    AdamW side through the fused kernel equals torch.optim.AdamW(fused=True), the plain one
    torch's default (for-loop) path."""
    ours = _qwen(layers=3)
    ref = copy.deepcopy(ours)
    init = {n: p.detach().clone() for n, p in ours.named_parameters()}
    lr, wd, betas = 0.02, 0.1, (0.9, 0.95)
    opt = MuonAdamW(
        ours,
        lr=lr,
        weight_decay=wd,
        betas=betas,
        adjust_lr=adjust_lr,
        momentum_style="ema",
        ns_coefficients="jordan",
        ns_dtype="bfloat16",
        fused=fused,
        verbose=False,
    )
    muon_names, norm_names = _qwen_names(3)
    assert _names(opt.routing.muon) == muon_names
    named = dict(ref.named_parameters())
    t_muon = torch.optim.Muon(
        [named[n] for n, _ in opt.routing.muon],
        lr=lr,
        weight_decay=wd,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn=adjust_lr,
    )
    t_adamw = torch.optim.AdamW(
        [
            {"params": [named[n] for n, _ in opt.routing.adamw_decay], "weight_decay": wd},
            {"params": [named[n] for n in norm_names], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
        eps=1e-8,
        fused=fused,
    )
    batches = _batches(5)
    _train(ours, [opt], batches)
    _train(ref, [t_muon, t_adamw], batches)
    for name, p in ours.named_parameters():
        q = named[name]
        assert not torch.equal(p, init[name]), f"{name} never moved"
        rel = ((p - q).norm() / q.norm()).item()
        assert torch.equal(p, q), f"{name}: relative difference {rel:.2e}"


def test_lr_scale_matches_torch():
    adjust = getattr(torch.optim._muon, "_adjust_lr", None)
    if adjust is None:
        pytest.skip("torch.optim._muon._adjust_lr not available")
    for shape in [(64, 256), (256, 64), (48, 48)]:
        for fn in ("original", "match_rms_adamw"):
            assert 0.02 * lr_scale(shape, fn) == adjust(0.02, fn, torch.Size(shape))
    assert lr_scale((3, 100, 400), "match_rms_adamw") == 0.2 * 20.0  # experts: last two dims
    assert lr_scale((7, 9), "none") == 1.0


# ----------------------------------------------------------------------------- routing


def test_routing_qwen3():
    model = _qwen(layers=2)
    r = route_parameters(model)
    muon, norms = _qwen_names(2)
    assert _names(r.muon) == muon
    assert _names(r.adamw_decay) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert _names(r.adamw_no_decay) == norms
    assert r.frozen == []


def test_routing_tied_embeddings():
    model = _qwen(layers=2, tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    r = route_parameters(model)
    muon, norms = _qwen_names(2)
    assert _names(r.muon) == muon
    assert _names(r.adamw_decay) == {"model.embed_tokens.weight"}
    assert r.reasons["model.embed_tokens.weight"] == "embedding (tied)"
    assert _names(r.adamw_no_decay) == norms


def test_routing_gpt2_conv1d():
    import transformers

    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    r = route_parameters(model)
    muon, no_decay = set(), {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    for i in range(2):
        pre = f"transformer.h.{i}"
        for mod in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            muon.add(f"{pre}.{mod}.weight")  # Conv1D (in, out) matrices
            no_decay.add(f"{pre}.{mod}.bias")
        no_decay |= {f"{pre}.{ln}.{w}" for ln in ("ln_1", "ln_2") for w in ("weight", "bias")}
    assert _names(r.muon) == muon
    assert _names(r.adamw_decay) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert _names(r.adamw_no_decay) == no_decay


def test_routing_peft_lora():
    peft = pytest.importorskip("peft")
    import transformers

    cfg = transformers.Qwen3Config(**(TINY_MODEL | QWEN), head_dim=16)
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, lora)
    r = route_parameters(model)
    expected = set()
    for i in range(2):
        pre = f"base_model.model.model.layers.{i}"
        for mod in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            expected |= {f"{pre}.{mod}.lora_{ab}.default.weight" for ab in "AB"}
    assert r.muon == [] and r.adamw_no_decay == []
    assert _names(r.adamw_decay) == expected
    assert set(r.frozen) == {n for n, p in model.named_parameters() if not p.requires_grad}
    frozen_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = MuonAdamW(model, lr=1e-2, verbose=False)
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen_before.items())
    b_name = next(n for n in expected if "lora_B" in n)
    assert params[b_name].abs().sum() > 0  # lora_B starts at zero and moved


class _Custom(nn.Module):
    """Roles by module type with names that the name rules would not catch."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 32)
        self.experts = nn.Parameter(torch.randn(4, 32, 16))
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.tok.weight
        self.conv = nn.Conv2d(2, 2, 3)
        self.scale = nn.Parameter(torch.ones(()))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_routing_by_module_role():
    r = route_parameters(_Custom())
    assert _names(r.muon) == {"proj.weight", "experts"}
    assert _names(r.adamw_decay) == {"tok.weight", "conv.weight"}
    assert _names(r.adamw_no_decay) == {"proj.bias", "ln.weight", "ln.bias", "conv.bias", "scale"}
    assert set(r.frozen) == {"frozen.weight", "frozen.bias"}
    # Named parameters only: a weight listed under two names is still seen as tied.
    named = route_parameters(_Custom().named_parameters(remove_duplicate=False))
    assert "tok.weight" in _names(named.adamw_decay)


def test_routing_overrides():
    muon, _ = _qwen_names(2)
    layer0 = {n for n in muon if ".layers.0." in n}
    r = route_parameters(_qwen(), muon_exclude=[r"layers\.0\."])
    assert _names(r.muon) == muon - layer0
    assert _names(r.adamw_decay) == layer0 | {"model.embed_tokens.weight", "lm_head.weight"}
    assert "model.layers.0.input_layernorm.weight" in _names(r.adamw_no_decay)
    r = route_parameters(_qwen(), muon_include=[r"^lm_head"])
    assert _names(r.muon) == muon | {"lm_head.weight"}
    # muon_include is checked before muon_exclude.
    r = route_parameters(_qwen(), muon_include=[r"layers\.0\.mlp"], muon_exclude=[r"mlp"])
    assert "model.layers.0.mlp.up_proj.weight" in _names(r.muon)
    assert "model.layers.1.mlp.up_proj.weight" in _names(r.adamw_decay)
    with pytest.raises(InputError, match="2-D"):
        route_parameters(_qwen(), muon_include=["norm"])
    with pytest.raises(InputError, match="not a valid regex"):
        route_parameters(_qwen(), muon_exclude=["(unclosed"])


def test_split_is_logged_once_and_silent_in_a_plain_loop(capsys, caplog):
    """The split goes through logging (logger unmask.optim.muon, INFO): nothing on stdout
    or stderr in a loop that configured no logging, one record when INFO is on."""
    capsys.readouterr()
    MuonAdamW(_qwen(layers=2))
    assert capsys.readouterr() == ("", "")
    with caplog.at_level(logging.INFO, logger="unmask.optim.muon"):
        MuonAdamW(_qwen(layers=2), verbose=True)
        MuonAdamW(_qwen(layers=2), verbose=False)
    (record,) = [r for r in caplog.records if r.name == "unmask.optim.muon"]
    out = record.getMessage()
    assert out.startswith("MuonAdamW parameter split:")
    assert "muon                14 tensors" in out
    assert "adamw (decay)        2 tensors" in out
    assert "adamw (no decay)     9 tensors" in out
    assert "per head" not in out


# ------------------------------------------------------------------------ step details


def test_same_shape_matrices_run_as_one_batch():
    model = _qwen(layers=2)
    with newton_schulz_calls() as calls:
        _train(model, [MuonAdamW(model, verbose=False)], _batches(1))
    # q/o (32x32), k/v (16x32), gate/up (48x32), down (32x48): four calls for 14 matrices.
    assert sorted(calls) == [(2, 32, 48), (4, 16, 32), (4, 32, 32), (4, 48, 32)]


def test_batched_newton_schulz_equals_one_matrix_per_call_bit_for_bit(monkeypatch):
    """Same-shape matrices stacked into one NS call (the default bound) against one call per
    matrix (a bound of one element): every parameter after two steps is equal bit for bit
    on a CPU, with 4 NS calls a step instead of 14."""
    import unmask.optim.muon as muon_module

    results = []
    for bound in (muon_module.NS_BATCH_NUMEL, 1):
        monkeypatch.setattr(muon_module, "NS_BATCH_NUMEL", bound)
        model = _qwen(layers=2)
        with newton_schulz_calls() as calls:
            _train(model, [MuonAdamW(model, verbose=False)], _batches(2))
        results.append(({n: p.detach().clone() for n, p in model.named_parameters()}, calls))
    (batched, batched_calls), (single, single_calls) = results
    assert len(batched_calls) == 2 * 4 and len(single_calls) == 2 * 14
    assert all(shape[0] == 1 or len(shape) == 2 for shape in single_calls)
    assert batched.keys() == single.keys()
    assert all(torch.equal(batched[n], single[n]) for n in batched)


def test_an_8b_slices_mlp_matrices_share_newton_schulz_calls():
    """The 4-layer LLaDA-8B slice of the GPU benchmark (hidden 4096, MLP 12288), stepped on
    the meta device: its 28 Muon matrices take 4 NS calls a step (16 attention matrices in
    one, the 8 gate/up ones in two, the 4 down ones in one), where a bound of 2^26 elements
    made 16 (each 50M-element MLP matrix alone)."""
    params = []
    for layer in range(4):
        for name, shape in (("q", (4096, 4096)), ("k", (4096, 4096)), ("v", (4096, 4096)),
                            ("o", (4096, 4096)), ("gate", (12288, 4096)),
                            ("up", (12288, 4096)), ("down", (4096, 12288))):  # fmt: skip
            p = nn.Parameter(torch.empty(shape, device="meta"))
            p.grad = torch.empty(shape, device="meta")
            params.append((f"model.layers.{layer}.mlp.{name}_proj.weight", p))
    with newton_schulz_calls() as calls:
        MuonAdamW(params, verbose=False).step()
    assert calls == [(16, 4096, 4096), (5, 12288, 4096), (3, 12288, 4096), (4, 4096, 12288)]


def test_expert_stack_orthogonalized_per_expert():
    w = nn.Parameter(torch.randn(4, 24, 40))
    w0 = w.detach().clone()
    opt = MuonAdamW([("experts", w)], lr=0.1, nesterov=False, verbose=False)
    w.grad = torch.randn(4, 24, 40)
    opt.step()
    step = orthogonalize(w.grad, "jordan").mul(0.1 * lr_scale((24, 40), "match_rms_adamw"))
    torch.testing.assert_close(w.detach(), w0 - step, rtol=1e-6, atol=1e-7)


def test_params_without_grad_are_skipped():
    model = _qwen(layers=1)
    opt = MuonAdamW(model, lr=1e-2, verbose=False)
    frozen_now = model.model.layers[0].mlp.up_proj.weight
    before = frozen_now.detach().clone()
    _loss(model, _batches(1)[0]).backward()
    frozen_now.grad = None
    model.model.norm.weight.grad = None
    opt.step()
    assert torch.equal(frozen_now, before)
    assert frozen_now not in opt.state and model.model.norm.weight not in opt.state


def test_momentum_styles_agree():
    """sum (mu M + G) and ema (lerp) differ by a factor NS normalizes away."""
    results = []
    for style in ("sum", "ema"):
        model = _qwen(layers=1)
        opt = MuonAdamW(model, lr=1e-2, momentum_style=style, ns_dtype="float32", verbose=False)
        _train(model, [opt], _batches(3))
        results.append(torch.cat([p.flatten() for _, p in opt.routing.muon]).detach())
    assert ((results[0] - results[1]).norm() / results[1].norm()) < 1e-5


@pytest.mark.parametrize("ns", ["bfloat16", "float16", "float32", "gram"])
def test_float32_model_trains(ns):
    model = _qwen(layers=2)
    dtype, coeffs = ("bfloat16", "gram") if ns == "gram" else (ns, "jordan")
    opt = MuonAdamW(model, lr=1e-2, ns_dtype=dtype, ns_coefficients=coeffs, verbose=False)
    batch = _batches(1)
    losses = _train(model, [opt], batch * 8)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    buf = opt.state[model.model.layers[0].mlp.up_proj.weight]["momentum_buffer"]
    assert buf.dtype == torch.float32


@pytest.mark.parametrize("ns", ["bfloat16", "float16", "float32"])
def test_bfloat16_model_trains(ns):
    model = _qwen(layers=2).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MuonAdamW(model, lr=1e-2, weight_decay=0.1, ns_dtype=ns, verbose=False)
    losses = _train(model, [opt], _batches(1) * 4)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert not torch.equal(p, before[name]), name
        for value in opt.state[p].values():
            if value.ndim:  # momentum and moments stay fp32; step is a scalar
                assert value.dtype == torch.float32


def _fixed_grad_steps(model: nn.Module, opt, steps: int = 5) -> None:
    """`steps` optimizer steps on fixed random gradients (1e-3 to 10 in scale), so two
    optimizers differ only by their own rounding, not through the model."""
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p in model.parameters():
            scale = 10.0 ** torch.randint(-3, 2, (), generator=g).item()
            p.grad = torch.randn(p.shape, generator=g) * scale
        opt.step()


@pytest.mark.parametrize("which", ["torch.optim.AdamW", "MuonAdamW"])
def test_fused_adamw_equals_the_plain_path_within_a_few_ulp(which):
    """torch's fused AdamW kernel (what build_optimizer and MuonAdamW use on CPU and CUDA)
    against the plain per-operation path, five steps on the same gradients: not bitwise (the
    kernel orders the arithmetic differently), at most 4 float32 ulp of the largest entry
    of each parameter (observed: 1 ulp). Muon matrices take the same path either way."""
    fused, plain = _qwen(layers=2), _qwen(layers=2)

    def build(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
        if which == "torch.optim.AdamW":
            return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        return MuonAdamW(model, lr=1e-2, weight_decay=0.1, fused=fused, verbose=False)

    _fixed_grad_steps(fused, build(fused, True))
    _fixed_grad_steps(plain, build(plain, False))
    eps = torch.finfo(torch.float32).eps
    moved = 0
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        assert (p - q).abs().max() <= 4 * eps * q.abs().max(), name
        moved += not torch.equal(p, q)
    assert moved > 0  # the two paths are really different code


def test_build_optimizer_takes_the_fused_kernel_and_old_states_load_unfused():
    model = _qwen(layers=1)
    assert build_optimizer(OptimConfig(), model).defaults["fused"] is True
    opt = build_optimizer(OptimConfig(name="muon"), model)
    assert all(g["fused"] for g in opt.param_groups)
    assert not MuonAdamW(model, verbose=False).defaults["fused"]  # the class: bit-exact path
    saved = opt.state_dict()
    for group in saved["param_groups"]:  # a checkpoint from before the option
        del group["fused"]
    opt.load_state_dict(saved)
    assert not any(g["fused"] for g in opt.param_groups)  # resumes bit-equal to how it ran


# ---------------------------------------------------------------- checkpoints, schedule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(dtype):
    kwargs = dict(lr=1e-2, muon_lr=2e-2, weight_decay=0.1, verbose=False)
    base = _qwen(layers=2, tied=True).to(dtype)
    batches = _batches(5)
    straight = copy.deepcopy(base)
    _train(straight, [MuonAdamW(straight, **kwargs)], batches)

    first = copy.deepcopy(base)
    opt = MuonAdamW(first, **kwargs)
    _train(first, [opt], batches[:3])
    blob = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)

    resumed = _qwen(layers=2, tied=True, seed=123).to(dtype)
    resumed.load_state_dict(saved["model"])
    opt2 = MuonAdamW(resumed, **kwargs)
    opt2.load_state_dict(saved["optim"])
    for p in resumed.parameters():
        for value in opt2.state[p].values():
            if value.ndim:
                assert value.dtype == torch.float32
    _train(resumed, [opt2], batches[3:])
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_owner_plan_cache_is_empty_after_construction_and_copies():
    """The DTensor path's plan cache is not optimizer state: a deep copy (or unpickled
    optimizer) gets a fresh, empty one instead of losing the attribute."""
    opt = MuonAdamW(_qwen(layers=1), verbose=False)
    assert opt.owner_plans == {}
    opt.owner_plans["stale"] = None
    assert copy.deepcopy(opt).owner_plans == {}


def test_lambda_lr_scales_muon_and_adamw_groups():
    model = _qwen(layers=1)
    opt = MuonAdamW(model, lr=1e-3, muon_lr=2e-2, verbose=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    lrs = {
        ("muon" if g["use_muon"] else "adamw", g["weight_decay"]): g["lr"] for g in opt.param_groups
    }
    assert lrs[("muon", 0.0)] == 2e-2 * 0.5 and lrs[("adamw", 0.0)] == 1e-3 * 0.5
    scheduled = _qwen(layers=1)
    opt = MuonAdamW(scheduled, lr=1e-3, muon_lr=2e-2, verbose=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    plain = _qwen(layers=1)
    opt_plain = MuonAdamW(plain, lr=1e-3 * 0.5, muon_lr=2e-2 * 0.5, verbose=False)
    for batch in _batches(2):
        _train(scheduled, [opt], [batch])
        sched.step()
        _train(plain, [opt_plain], [batch])
    for p, q in zip(scheduled.parameters(), plain.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------ config


def test_build_optimizer_adamw_groups():
    model = _qwen(layers=2)
    opt = build_optimizer(OptimConfig(weight_decay=0.1, learning_rate=3e-4), model)
    assert type(opt) is torch.optim.AdamW
    decay, no_decay = opt.param_groups
    muon, norms = _qwen_names(2)
    assert set(decay["param_names"]) == muon | {"model.embed_tokens.weight", "lm_head.weight"}
    assert set(no_decay["param_names"]) == norms
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["lr"]) == (0.1, 0.0, 3e-4)


def test_build_optimizer_muon():
    cfg = OptimConfig(
        name="muon",
        learning_rate=1e-3,
        muon_lr=0.02,
        ns_coefficients="gram",
        ns_dtype="float16",
        adjust_lr="original",
        muon_exclude=[r"layers\.0\."],
    )
    opt = build_optimizer(cfg, _qwen(layers=2))
    assert isinstance(opt, MuonAdamW)
    group = next(g for g in opt.param_groups if g["use_muon"])
    assert (group["lr"], group["ns_coefficients"], group["ns_dtype"]) == (0.02, "gram", "float16")
    assert group["adjust_lr"] == "original"
    assert all(".layers.1." in n for n in group["param_names"])


def test_optim_config_validation():
    assert all(f.description for f in OptimConfig.model_fields.values())
    for bad in (
        {"learning_rat": 1e-3},
        {"learning_rate": -1.0},
        {"momentum": 1.0},
        {"warmup_steps": 2.5},
        {"ns_coefficients": "newton"},
        {"muon_include": ["(unclosed"]},
        {"ns_steps": 0},
    ):
        with pytest.raises(ValidationError):
            OptimConfig(**bad)
    assert OptimConfig(warmup_steps=0.1).warmup_steps == 0.1


def test_auto_ns_dtype_resolution(monkeypatch):
    """ns_dtype auto: bfloat16 on an accelerator or a CPU with native bf16 matmuls (read from
    torch's cpuinfo flags), float32 on any other CPU; resolved once, at construction."""
    assert updates_module.auto_ns_dtype("cuda", False)[0] == "bfloat16"
    assert updates_module.auto_ns_dtype("cpu", True)[0] == "bfloat16"
    assert updates_module.auto_ns_dtype("cpu", False) == (
        "float32",
        "the CPU has no native bfloat16 matmuls (no AVX512_BF16/AMX)",
    )
    cpu = torch._C._cpu
    for flags, native in (
        ({"avx512_bf16": True, "amx_bf16": False}, True),
        ({"avx512_bf16": False, "amx_bf16": True}, True),
        ({"avx512_bf16": False, "amx_bf16": False, "avx512_f": True}, False),
        ({}, False),  # another architecture: no x86 flags
    ):
        monkeypatch.setattr(cpu, "_get_cpu_capability", lambda flags=flags: flags)
        assert updates_module.cpu_has_native_bf16() is native, flags
    monkeypatch.delattr(cpu, "_get_cpu_capability")  # a torch without it
    assert updates_module.cpu_has_native_bf16() is False

    import unmask.optim.muon as muon_module

    for native, dtype in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(muon_module, "cpu_has_native_bf16", lambda native=native: native)
        opt = build_optimizer(OptimConfig(name="muon"), _qwen(layers=1))
        assert {g["ns_dtype"] for g in opt.param_groups} == {dtype}
        assert opt.ns_dtype_choice == updates_module.auto_ns_dtype("cpu", native)
    given = MuonAdamW(_qwen(layers=1), ns_dtype="float16", verbose=False)
    assert given.ns_dtype_choice == ("float16", "as given")
    assert OptimConfig().ns_dtype == "auto"


def test_bad_constructor_arguments():
    model = _qwen(layers=1)
    for bad in (
        {"adjust_lr": "spectral"},
        {"ns_coefficients": "newton"},
        {"ns_dtype": "float64"},
        {"momentum_style": "nesterov"},
        {"momentum": 1.5},
        {"lr": -1.0},
    ):
        with pytest.raises(InputError):
            MuonAdamW(model, verbose=False, **bad)
    frozen = _qwen(layers=1).requires_grad_(False)
    with pytest.raises(InputError, match="no trainable"):
        MuonAdamW(frozen, verbose=False)


def test_the_docs_first_layer_sentence_is_what_routing_does():
    """docs/muon.md: a first layer that is a plain nn.Linear goes to Muon (only embeddings
    and the output layer are AdamW's by role), and its muon_exclude keeps it on AdamW."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "muon.md").read_text()
    assert 'is a 2-D matrix\nand goes to Muon; `muon_exclude=[r"^0\\."]` keeps it on AdamW' in doc
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))  # fmt: skip
    assert _names(route_parameters(model).muon) == {"0.weight", "2.weight"}
    kept = route_parameters(model, muon_exclude=[r"^0\."])
    assert _names(kept.muon) == {"2.weight"} and "0.weight" in _names(kept.adamw_decay)
