"""QK-clip (optim.qk_clip_threshold): the clip against megatron-core 0.16's
``SelfAttention.clip_qk`` / ``_clip_linear_qkv`` (megatron/core/transformer/attention.py,
called on unmask's weights laid out as its interleaved linear_qkv), the captured max logit
against an explicit max(q . k / sqrt(d)) per head for every attention backend, the
trainer's wiring, and the option's checks (docs/muon.md)."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from pydantic import ValidationError

from unmask.errors import InputError
from unmask.models.attention import AttentionMask, attend, build_attention_mask
from unmask.models.transformer import Attention, apply_rotary
from unmask.optim import OptimConfig
from unmask.optim.qk_clip import clip_factors, scale_head_rows_
from unmask.train.qk_clip import QKClip, build_qk_clip

pytestmark = pytest.mark.usefixtures("one_thread")

#: (query heads, key/value heads, head dim): MHA, GQA with 2 and 3 query heads per group
SHAPES = {"mha": (4, 4, 8), "gqa": (4, 2, 16), "gqa3": (6, 2, 8)}
THRESHOLD = 10.0


def megatron_clip(q, k, v, max_logits, heads, kv_heads, head_dim, alpha, threshold):
    """megatron-core's SelfAttention.clip_qk on linear_qkv built from q/k/v (per query
    group g: its query heads' rows, its key head's rows, its value head's rows), the
    result split back into q and k. The method reads only these attributes of `self`."""
    mc = pytest.importorskip("megatron.core.transformer.attention")
    groups, per = kv_heads, heads // kv_heads
    qkv = torch.cat([q.view(groups, per * head_dim, -1), k.view(groups, head_dim, -1),
                     v.view(groups, head_dim, -1)], dim=1).reshape(-1, q.shape[1])  # fmt: skip
    self = SimpleNamespace(
        config=SimpleNamespace(qk_clip=True, qk_clip_alpha=alpha, qk_clip_threshold=threshold),
        core_attention=SimpleNamespace(current_max_attn_logits=max_logits.clone()),
        num_attention_heads_per_partition=heads,
        num_query_groups_per_partition=groups,
        query_projection_size=heads * head_dim,
        kv_projection_size=kv_heads * head_dim,
        linear_qkv=SimpleNamespace(weight=torch.nn.Parameter(qkv.clone())),
    )
    self._clip_linear_qkv = lambda w: mc.SelfAttention._clip_linear_qkv(self, w)
    mc.SelfAttention.clip_qk(self)
    out = self.linear_qkv.weight.data.view(groups, (per + 2) * head_dim, -1)
    new_q = out[:, : per * head_dim].reshape(heads * head_dim, -1)
    new_k = out[:, per * head_dim : (per + 1) * head_dim].reshape(kv_heads * head_dim, -1)
    return new_q, new_k


def _logits(heads: int, seed: int) -> torch.Tensor:
    """Per-head max logits, some above THRESHOLD (up to 8x), some below, one negative."""
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(heads, generator=g) * 8 * THRESHOLD
    values[0] = THRESHOLD / 2
    values[-1] = -3.0 if heads > 4 else values[-1]
    return values


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_clip_equals_megatron_core(shape, alpha):
    """The model's q_proj / k_proj after QKClip.after_step equal megatron-core's clip of
    the same weights and max logits, layer by layer (2 layers, different logits)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    model = tiny_model(0, hidden_size=24, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim)  # fmt: skip
    clip = QKClip(model, THRESHOLD, alpha, torch.device("cpu"))
    want = []
    for index, layer in enumerate(clip.layers):
        logits = _logits(heads, index)
        layer.qk_logits.copy_(logits)
        q, k, v = (p.weight.detach().clone() for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        want.append(megatron_clip(q, k, v, logits, heads, kv_heads, head_dim, alpha, THRESHOLD))
    v_before = [layer.v_proj.weight.detach().clone() for layer in clip.layers]
    stats = clip.after_step()
    for layer, (q, k), v in zip(clip.layers, want, v_before):
        # within an ulp (CPU pow rounds by the length of the tensor it runs on: the
        # vectorized body and the scalar tail differ), not bit for bit
        assert (layer.q_proj.weight - q).abs().max() <= 1e-6
        assert (layer.k_proj.weight - k).abs().max() <= 1e-6
        assert torch.equal(layer.v_proj.weight, v)
        assert torch.isneginf(layer.qk_logits).all()  # the capture starts over
    logits = torch.stack([_logits(heads, i) for i in range(len(clip.layers))])
    grouped = logits.view(len(clip.layers), kv_heads, -1).amax(-1)
    assert stats["qk_max_logit"].item() == logits.max().item()
    assert stats["qk_clipped_heads"].item() == (grouped > THRESHOLD).sum() * (heads // kv_heads)


def test_clip_lowers_each_groups_logit_to_the_threshold():
    """Without norms or biases, the clipped logits of every over-threshold group are
    eta * the old ones: its max becomes tau; groups under it keep their weights."""
    heads, kv_heads, d = 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(heads * d, 16, generator=g), torch.randn(kv_heads * d, 16, generator=g)
    x = torch.randn(10, 16, generator=g)

    def max_logits(q, k):
        qh, kh = (x @ q.T).view(10, heads, d), (x @ k.T).view(10, kv_heads, d)
        kh = kh.repeat_interleave(heads // kv_heads, dim=1)
        return torch.einsum("ihd,jhd->hij", qh, kh).amax(dim=(1, 2)) / math.sqrt(d)

    before = max_logits(q, k)
    tau = float(before.view(kv_heads, -1).amax(1).min() + before.max()) / 2  # one group over
    query, key, clipped = clip_factors(before, kv_heads, tau, 0.5)
    assert clipped.tolist().count(True) == 1
    scale_head_rows_(q, query, d)
    scale_head_rows_(k, key, d)
    after = max_logits(q, k).view(kv_heads, -1).amax(1)
    grouped = before.view(kv_heads, -1).amax(1)
    assert torch.allclose(after, torch.where(clipped, torch.tensor(tau), grouped), rtol=1e-5)


# --- the capture ---------------------------------------------------------------------------


def explicit_max_logits(layer: Attention, x, cos, sin, keep: torch.Tensor | None):
    """max over (row, query, key) of q . k / sqrt(d) per query head, written out: the
    projections, q/k norm and RoPE as Attention.forward does them, no softmax, no chunks;
    keep (B, L, L) bool: the pairs that may attend (None: all)."""
    b, length, _ = x.shape
    d = layer.head_dim
    with torch.no_grad():
        q = layer.q_norm(layer.q_proj(x).view(b, length, -1, d)).transpose(1, 2)
        k = layer.k_norm(layer.k_proj(x).view(b, length, -1, d)).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        out = []
        for h in range(q.shape[1]):
            scores = torch.einsum("bid,bjd->bij", q[:, h].double(), k[:, h].double()) / math.sqrt(d)
            if keep is not None:
                scores = scores.masked_fill(~keep, -math.inf)
            out.append(scores.max())
    return torch.stack(out)


def _doc_ids(b: int, length: int) -> torch.Tensor:
    """Packed rows: 3 documents in row 0, 2 in row 1, one of which comes back (varlen's
    several runs of one document)."""
    ids = torch.zeros(b, length, dtype=torch.long)
    ids[0, 5:11], ids[0, 11:] = 1, 2
    ids[1, 4:9] = 1
    return ids


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "flex"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shape", ["mha", "gqa"])
def test_captured_max_logit_equals_explicit(backend, packed, shape):
    """Training forwards through every backend record max(q . k / sqrt(d)) per head (masked
    pairs of packed rows left out) within 1e-5; the running max over two forwards."""
    heads, kv_heads, head_dim = SHAPES[shape]
    model = tiny_model(3, hidden_size=32, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim,
                       attn_implementation=backend)  # fmt: skip
    if backend == "flex" and not hasattr(torch.nn.attention, "flex_attention"):
        pytest.skip("no flex attention")
    clip = QKClip(model, THRESHOLD, 0.5, torch.device("cpu"))
    seen: list = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: seen.append((m, args)))
             for layer in clip.layers]  # fmt: skip
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]
    doc_ids = _doc_ids(2, 16) if packed else None
    model.train()
    for ids in batches:
        if backend == "flex":  # no backward on CPU: grad mode on, nothing requires grad
            model.requires_grad_(False)
            model.hidden_states(ids, doc_ids=doc_ids)
        else:
            model(ids, doc_ids=doc_ids, targets=ids).float().mean().backward()
    for hook in hooks:
        hook.remove()
    keep = None if doc_ids is None else doc_ids[:, :, None] == doc_ids[:, None, :]
    for layer in clip.layers:
        calls = [args for m, args in seen if m is layer]
        want = torch.stack([explicit_max_logits(layer, x, cos, sin, keep)
                            for x, cos, sin, *_ in calls]).amax(0)  # fmt: skip
        assert (layer.qk_logits.double() - want).abs().max() <= 1e-5, backend


def test_capture_with_an_explicit_mask_and_under_autocast():
    """An explicit (B, 1, L, L) mask (block diffusion) is honoured as sdpa sees it, and a
    bf16 autocast forward is captured from its bf16 q and k in float32."""
    model = tiny_model(1, attn_implementation="sdpa")
    clip = QKClip(model, THRESHOLD, 0.5, torch.device("cpu"))
    layer = clip.layers[0]
    seen = []
    hook = layer.register_forward_pre_hook(lambda m, args: seen.append(args))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    keep = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(1)) > 0.5
    keep |= torch.eye(12, dtype=torch.bool)
    model.train()
    model(ids, attention_mask=keep, targets=ids).float().mean().backward()
    hook.remove()
    x, cos, sin, *_ = seen[0]
    want = explicit_max_logits(layer, x, cos, sin, keep[:, 0])
    assert (layer.qk_logits.double() - want).abs().max() <= 1e-5
    layer.qk_logits.fill_(-math.inf)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, targets=ids).float().mean().backward()
    assert torch.isfinite(layer.qk_logits).all()


def test_no_capture_outside_training_forwards():
    """Evaluation (eval mode, or no grad) and sampling forwards record nothing; off by
    default (qk_logits None) nothing is computed."""
    model = tiny_model(0)
    layer = next(m for m in model.modules() if isinstance(m, Attention))
    assert layer.qk_logits is None
    ids = torch.randint(0, 128, (2, 8))
    model.train()
    model(ids, targets=ids)  # off: nothing to record into
    clip = QKClip(model, THRESHOLD, 0.5, torch.device("cpu"))
    with torch.no_grad():
        model(ids, targets=ids)
    model.eval()
    model(ids, targets=ids)
    assert all(torch.isneginf(m.qk_logits).all() for m in clip.layers)


def test_attend_record_under_context_parallel_heads():
    """Under context parallelism `attend` records the heads the rank attends with, at
    their index among its heads (a stand-in shard that keeps rows whole)."""

    class Shard:
        size, rank = 2, 1

        def attend(self, q, k, v, attention):
            h, kv = q.shape[1] // 2, k.shape[1] // 2
            return attention(q[:, h:], k[:, kv:], v[:, kv:])

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    got = []
    attend(q, k, k, AttentionMask("sdpa", context=Shard()), 0.5,
           record=lambda values, first: got.append((first, values)))  # fmt: skip
    whole = []
    attend(q, k, k, build_attention_mask(None, "sdpa"), 0.5,
           record=lambda values, first: whole.append(values))  # fmt: skip
    assert len(got) == 1 and got[0][0] == 2
    assert torch.equal(got[0][1], whole[0][2:])


# --- the option ----------------------------------------------------------------------------


def test_option_defaults_off_and_refuses_bad_values():
    cfg = OptimConfig()
    assert cfg.qk_clip_threshold is None and cfg.qk_clip_alpha == 0.5
    assert build_qk_clip(cfg, tiny_model(0), torch.device("cpu")) is None
    for bad in ({"qk_clip_threshold": 0}, {"qk_clip_threshold": -5}, {"qk_clip_alpha": 1.5},
                {"qk_clip_alpha": -0.1}):  # fmt: skip
        with pytest.raises(ValidationError):
            OptimConfig(**bad)


def test_refused_in_one_line_for_models_it_cannot_clip():
    cfg = OptimConfig(qk_clip_threshold=50)
    with pytest.raises(InputError, match="model.lora") as err:
        build_qk_clip(cfg, tiny_model(0), torch.device("cpu"), lora=True)
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="native decoder") as err:
        build_qk_clip(cfg, torch.nn.Linear(4, 4), torch.device("cpu"))
    assert "\n" not in str(err.value)
