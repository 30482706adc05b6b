"""Per-head Muon (optim.muon_per_head) against torch.optim.Muon on each head's rows, and the
routing rules for LoRA factors, MoE routers, the expert bias and q/k norm scales pinned on
tiny models (docs/muon.md)."""

import copy

import pytest
import torch
from conftest import newton_schulz_calls, tiny_model
from torch import nn

from unmask.errors import InputError
from unmask.optim import MuonAdamW, OptimConfig, build_optimizer, route_parameters
from unmask.optim.routing import PER_HEAD_SUFFIXES

VOCAB = 64
#: tiny attention shapes: MHA, GQA (2 query heads per key/value head), and heads taller
#: than the hidden size (each head's slice is transposed inside Newton-Schulz)
SHAPES = {
    "mha": {"num_attention_heads": 4, "num_key_value_heads": 4},  # head_dim 32 / 4 = 8
    "gqa": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "tall": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 48},
}
#: MuonAdamW configured like torch.optim.Muon (+ torch.optim.AdamW on the rest)
LIKE_TORCH = dict(momentum_style="ema", ns_coefficients="jordan", ns_dtype="bfloat16")

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(shape: str, layers: int = 2, seed: int = 0) -> nn.Module:
    return tiny_model(seed, vocab_size=VOCAB, intermediate_size=48, num_hidden_layers=layers,
                      **SHAPES[shape])  # fmt: skip


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2, 12), generator=g),
             torch.randint(0, VOCAB, (2, 12), generator=g)) for _ in range(n)]  # fmt: skip


def _backward(model: nn.Module, batch) -> None:
    ids, targets = batch
    model(ids, targets=targets).float().mean().backward()


def _per_head_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(PER_HEAD_SUFFIXES)]


class TorchPerHead:
    """The reference: torch.optim.Muon on every Muon matrix, except that each q/k/v matrix
    is replaced by one leaf parameter per head (its rows), and torch.optim.AdamW on the
    rest, with MuonAdamW's groups. After backward each head gets its rows of the
    gradient; after the step the heads are written back into the model's matrix."""

    def __init__(self, model: nn.Module, routing, head_dims: dict[str, int], *, lr, wd, betas,
                 adjust_lr):  # fmt: skip
        named = dict(model.named_parameters())
        self.model, self.heads = model, []
        whole = []
        for name, _ in routing.muon:
            if name not in head_dims:
                whole.append(named[name])
                continue
            weight, dim = named[name], head_dims[name]
            for start in range(0, weight.shape[0], dim):
                rows = slice(start, start + dim)
                self.heads.append((weight, rows, nn.Parameter(weight.detach()[rows].clone())))
        heads = [h for _, _, h in self.heads]
        self.muon = torch.optim.Muon(whole + heads, lr=lr, weight_decay=wd, momentum=0.95,
                                     nesterov=True, adjust_lr_fn=adjust_lr)  # fmt: skip
        self.adamw = torch.optim.AdamW(
            [{"params": [named[n] for n, _ in routing.adamw_decay], "weight_decay": wd},
             {"params": [named[n] for n, _ in routing.adamw_no_decay], "weight_decay": 0.0}],
            lr=lr, betas=betas, eps=1e-8,
        )  # fmt: skip

    def step(self) -> None:
        for weight, rows, head in self.heads:
            head.grad = weight.grad[rows].clone()
        self.muon.step()
        self.adamw.step()
        with torch.no_grad():
            for weight, rows, head in self.heads:
                weight[rows] = head
        for weight, _, _ in self.heads:
            weight.grad = None
        self.muon.zero_grad(set_to_none=True)
        self.adamw.zero_grad(set_to_none=True)


# ------------------------------------------------------------- parity with torch per head


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_per_head_muon_equals_torch_muon_on_each_heads_rows(shape, adjust_lr):
    """Five steps of MuonAdamW(per_head=True) equal torch.optim.Muon applied to each head's
    rows of q/k/v as a matrix of its own (and to the other Muon matrices whole), with
    torch.optim.AdamW on the rest: bit for bit on every parameter."""
    ours = _model(shape)
    ref = copy.deepcopy(ours)
    init = {n: p.detach().clone() for n, p in ours.named_parameters()}
    lr, wd, betas = 0.02, 0.1, (0.9, 0.95)
    opt = MuonAdamW(ours, lr=lr, weight_decay=wd, betas=betas, adjust_lr=adjust_lr,
                    per_head=True, verbose=False, **LIKE_TORCH)  # fmt: skip
    head_dims = {n: d for n, d in ((n, opt.head_dims.get(p)) for n, p in ours.named_parameters())
                 if d}  # fmt: skip
    assert sorted(head_dims) == sorted(_per_head_names(ours))
    torch_opt = TorchPerHead(ref, opt.routing, head_dims, lr=lr, wd=wd, betas=betas,
                             adjust_lr=adjust_lr)  # fmt: skip
    for batch in _batches(5):
        _backward(ours, batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _backward(ref, batch)
        torch_opt.step()
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert not torch.equal(p, init[name]), f"{name} never moved"
        diff = (p - named[name]).abs().max().item()
        assert torch.equal(p, named[name]), f"{name}: max abs difference {diff:.2e}"


def test_per_head_changes_only_q_k_v_and_batches_heads():
    """Off, every matrix is orthogonalized whole (the existing tests pin that path); on,
    q/k/v are not, the other matrices step exactly as before, and every head of every
    q/k/v matrix is one matrix of one batched NS call of (head_dim, hidden) slices."""
    whole, split = _model("gqa"), _model("gqa")
    batch = _batches(1)[0]
    opt_whole = MuonAdamW(whole, ns_dtype="float32", verbose=False)
    opt_split = MuonAdamW(split, ns_dtype="float32", per_head=True, verbose=False)
    assert opt_whole.head_dims == {}
    _backward(whole, batch)
    opt_whole.step()
    _backward(split, batch)
    with newton_schulz_calls() as calls:
        opt_split.step()
    per_head = set(_per_head_names(split))
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        assert torch.equal(a, b) != (name in per_head), name
    # 2 layers x (4 query + 2 key + 2 value heads) of (16, 32): one call of 16 matrices
    assert (16, 16, 32) in calls
    assert sum(c[0] for c in calls if c[-2:] == (16, 32)) == 16


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_head_dim_comes_from_the_model(shape):
    """The head dim is the attention module's (unmask's and transformers' attention keep
    head_dim): k/v under GQA split into the key/value heads; build_optimizer passes
    optim.muon_per_head; the routing table says each split."""
    model = _model(shape)
    cfg = model.config
    opt = build_optimizer(OptimConfig(name="muon", muon_per_head=True), model)
    names = {p: n for n, p in model.named_parameters()}
    split = {names[p]: d for p, d in opt.head_dims.items()}
    assert sorted(split) == sorted(_per_head_names(model))
    assert set(split.values()) == {cfg.resolved_head_dim}
    params = dict(model.named_parameters())
    for name, dim in split.items():
        heads = params[name].shape[0] // dim
        kv = name.endswith(("k_proj.weight", "v_proj.weight"))
        assert heads == (cfg.num_key_value_heads if kv else cfg.num_attention_heads)
        assert f"per head ({heads} x {dim} x {cfg.hidden_size})" in opt.routing.reasons[name]
    assert build_optimizer(OptimConfig(name="muon"), model).head_dims == {}


def test_head_dim_per_layer_diffusion_gemma():
    """DiffusionGemma's full-attention layers have their own head dim (global_head_dim) and
    no v_proj: each layer is split by its own attention module's head_dim."""
    model = tiny_model(model_type="diffusion_gemma", vocab_size=VOCAB, num_attention_heads=2,
                       num_key_value_heads=1, diffusion_gemma={"global_head_dim": 32})  # fmt: skip
    opt = MuonAdamW(model, per_head=True, verbose=False)
    modules = dict(model.named_modules())
    dims = {n: opt.head_dims[p] for n, p in model.named_parameters() if p in opt.head_dims}
    assert sorted(dims) == sorted(_per_head_names(model))
    for name, dim in dims.items():
        assert dim == modules[name.rsplit(".", 2)[0]].head_dim
    assert len(set(dims.values())) == 2  # both head dims are present


def test_head_dim_without_a_model_and_refusals():
    model = _model("gqa", layers=1)
    named = list(model.named_parameters())
    with pytest.raises(InputError, match="needs the head dim"):
        MuonAdamW(named, per_head=True, verbose=False)
    opt = MuonAdamW(named, per_head=True, head_dim=16, verbose=False)
    assert sorted(opt.head_dims.values()) == [16, 16, 16]
    with pytest.raises(InputError, match="head_dim=8 was given, but .*head_dim is 16"):
        MuonAdamW(model, per_head=True, head_dim=8, verbose=False)
    with pytest.raises(InputError, match="head dim 12 does not divide the 64 rows"):
        MuonAdamW(named, per_head=True, head_dim=12, verbose=False)


def test_a_copy_and_a_state_dict_keep_the_split():
    model = _model("mha", layers=1)
    opt = MuonAdamW(model, per_head=True, verbose=False)
    _backward(model, _batches(1)[0])
    opt.step()
    copied = copy.deepcopy(opt)
    params = [p for g in copied.param_groups for p in g["params"]]
    assert len(copied.head_dims) == 3
    assert all(any(p is q for q in params) for p in copied.head_dims)
    fresh = MuonAdamW(model, per_head=True, verbose=False)
    fresh.load_state_dict(opt.state_dict())  # the split is the construction's, not saved
    assert fresh.head_dims == opt.head_dims


# ----------------------------------------------------------------------- routing rules


def _routes(model: nn.Module) -> dict[str, str]:
    routing = route_parameters(model)
    out = {n: "muon" for n, _ in routing.muon}
    out |= {n: "adamw (decay)" for n, _ in routing.adamw_decay}
    out |= {n: "adamw (no decay)" for n, _ in routing.adamw_no_decay}
    out |= dict.fromkeys(routing.frozen, "frozen")
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe_dllm", "llada2_moe", "diffusion_gemma"])
def test_moe_router_weights_go_to_adamw_with_decay(model_type):
    """Every parameter of an MoE router (``is_moe_router``) and of its submodules: AdamW.
    Matrices with decay (qwen3_moe/llada2 ``mlp.gate.weight``, DiffusionGemma's
    ``router.proj.weight``, an nn.Linear inside its router), 1-D scales without."""
    model = tiny_model(model_type=model_type, vocab_size=VOCAB)
    routing, routes = route_parameters(model), _routes(model)
    routers = [m for m in model.modules() if getattr(m, "is_moe_router", False)]
    assert routers
    matrices = 0
    for router in routers:
        for p in router.parameters():
            name = next(n for n, q in model.named_parameters() if q is p)
            if p.ndim >= 2:
                matrices += 1
                assert routes[name] == "adamw (decay)", name
                assert routing.reasons[name] == "MoE router"
            else:
                assert routes[name] == "adamw (no decay)", name
    assert matrices == model.config.num_hidden_layers


def test_expert_bias_is_a_buffer_no_optimizer_steps():
    """llada2_moe's sigmoid router: the expert bias is a buffer, in no optimizer group;
    optimizer steps leave it as it is (the load rule, update_expert_bias, moves it)."""
    model = tiny_model(model_type="llada2_moe", vocab_size=VOCAB)
    biases = {n: b for n, b in model.named_buffers() if n.endswith("gate.expert_bias")}
    assert len(biases) == model.config.num_hidden_layers
    assert not any("expert_bias" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for b in biases.values():
            b.normal_()
    before = {n: b.clone() for n, b in biases.items()}
    opt = MuonAdamW(model, per_head=True, verbose=False)
    in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(b) in in_groups for b in biases.values())
    _backward(model, _batches(1)[0])
    opt.step()
    assert all(torch.equal(biases[n], before[n]) for n in biases)


@pytest.mark.parametrize("model_type", ["qwen3_dllm", "llada_moe"])
def test_qk_norm_scales_go_to_adamw_without_decay(model_type):
    """q_norm/k_norm weights: AdamW without weight decay, per head (Qwen3: head_dim
    features) or over the whole projection (OLMoE / llada_moe)."""
    model = tiny_model(model_type=model_type, vocab_size=VOCAB)
    routes = _routes(model)
    norms = [n for n in routes if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * model.config.num_hidden_layers
    assert all(routes[n] == "adamw (no decay)" for n in norms)


def test_lora_factors_go_to_adamw_with_decay():
    """model.lora: true: every LoRA factor (A and B) to AdamW with decay, the base weights
    frozen (out of the optimizer), nothing on Muon; per-head Muon then splits nothing."""
    pytest.importorskip("peft")
    from unmask.models import ModelConfig, build_model
    from unmask.models.lora import apply_lora

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, lora=True, lora_r=4)  # fmt: skip
    torch.manual_seed(0)
    model = apply_lora(build_model(cfg), cfg)
    routes = _routes(model)
    lora = [n for n in routes if ".lora_" in n]
    assert len(lora) == 2 * 7 * 2  # layers x linear layers x (A, B)
    assert all(routes[n] == "adamw (decay)" for n in lora)
    assert all(routes[n] == "frozen" for n in routes if ".lora_" not in n)
    opt = MuonAdamW(model, per_head=True, verbose=False)
    assert opt.head_dims == {} and not any(g["use_muon"] for g in opt.param_groups)


def test_the_split_summary_lists_the_per_head_matrices():
    """The start-up summary (the trainer prints it) says which matrices per-head Muon
    splits and the rows of one head."""
    opt = MuonAdamW(_model("gqa"), ns_dtype="float32", per_head=True, verbose=False)
    line = opt.routing.summary().splitlines()[-1]
    assert line == "  muon per head        6 tensors (k_proj, q_proj, v_proj; heads of 16 rows)"
    whole = MuonAdamW(_model("gqa"), ns_dtype="float32", verbose=False)
    assert "per head" not in whole.routing.summary()
