"""chunked_cross_entropy (masked-only LM head) against F.cross_entropy on full logits,
weighted_cross_entropy (gradients in the forward) against the plain path, and the
full-logits loss (`model.loss_implementation: full`) against the chunked one."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from unmask.diffusion.loss import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    full_cross_entropy,
    weighted_cross_entropy,
)
from unmask.parallel.pipeline import PipelineModel
from unmask.parallel.pipeline_plan import LayerCosts, plan_pipeline

N, H, V = 13, 8, 50


def inputs(dtype=torch.float32, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    return hidden, weight, targets


def reference(hidden, weight, targets):
    logits = hidden.float() @ weight.float().T  # (N, V)
    return F.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize("vocab_chunk,row_chunk", [(50, 13), (7, 4), (16, 5), (1, 1), (64, 100)])
def test_forward_and_grad_match_full_logits(vocab_chunk, row_chunk):
    hidden, weight, targets = inputs()
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(1))
    loss = chunked_cross_entropy(hidden, weight, targets, vocab_chunk, row_chunk)
    ref = reference(hidden, weight, targets)
    assert loss.dtype == torch.float32 and loss.shape == (N,)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((loss * upstream).sum(), [hidden, weight])
    ref_grads = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_repeated_targets_accumulate_weight_grad():
    hidden, weight, _ = inputs()
    targets = torch.full((N,), 3)
    loss = chunked_cross_entropy(hidden, weight, targets, 16, 4)
    ref = reference(hidden, weight, targets)
    gw = torch.autograd.grad(loss.sum(), weight)[0]
    torch.testing.assert_close(gw, torch.autograd.grad(ref.sum(), weight)[0], rtol=1e-5, atol=1e-5)


def test_empty_selection_keeps_graph():
    hidden, weight, targets = inputs(n=0)
    loss = chunked_cross_entropy(hidden, weight, targets, 16, 4)
    assert loss.shape == (0,)
    gh, gw = torch.autograd.grad(loss.sum(), [hidden, weight])
    assert gh.shape == (0, H) and torch.equal(gw, torch.zeros(V, H))


def test_bf16_close_to_fp32():
    hidden, weight, targets = inputs(torch.bfloat16)
    loss = chunked_cross_entropy(hidden, weight, targets, 16, 4)
    assert loss.dtype == torch.float32
    ref = reference(hidden.detach(), weight.detach(), targets)  # fp32 from the same bf16 values
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=5e-2)
    gh, gw = torch.autograd.grad(loss.sum(), [hidden, weight])
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    rh, rw = torch.autograd.grad(reference(h32, w32, targets).sum(), [h32, w32])
    torch.testing.assert_close(gh.float(), rh, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(gw.float(), rw, rtol=5e-2, atol=5e-2)


def test_weighted_masked_loss_matches_full_vocabulary_cross_entropy():
    """The MDLM use: (B, L) positions, some rows with no masked token, per-row weights 1/t;
    the chunked loss on the masked rows (several row and vocabulary chunks, targets on
    chunk edges) against F.cross_entropy on full logits, loss and both gradients."""
    g = torch.Generator().manual_seed(2)
    batch, length, vocab_chunk = 4, 9, 7  # V = 50: 8 chunks, the last one short
    hidden = torch.randn(batch, length, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (batch, length), generator=g)
    targets[0, :4] = torch.tensor([0, 6, 7, V - 1])  # first and last id of chunks
    masked = torch.rand(batch, length, generator=g) < 0.6
    masked[1] = False  # a row with nothing masked
    masked[0, :4] = True
    row_weight = 1.0 / torch.tensor([0.3, 0.5, 0.9, 0.05])

    def total(loss_rows):
        return (loss_rows * row_weight[:, None].expand_as(masked)[masked]).sum()

    ours = total(chunked_cross_entropy(hidden[masked], weight, targets[masked], vocab_chunk, 5))
    logits = hidden @ weight.T  # (B, L, V)
    full = F.cross_entropy(logits.flatten(0, 1), targets.masked_fill(~masked, -100).flatten(),
                           ignore_index=-100, reduction="none").view(batch, length)  # fmt: skip
    ref = (full * row_weight[:, None]).sum()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(ours, [hidden, weight])
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(grads[0][1], torch.zeros(length, H))  # the unmasked row: no gradient


def test_frozen_head_gets_no_gradient_and_hidden_grad_is_unchanged():
    """A frozen LM head (LoRA) skips the head's gradient; the hidden states' is the same."""
    hidden, weight, targets = inputs()
    frozen = weight.detach()
    loss = chunked_cross_entropy(hidden, frozen, targets, 7, 4)
    (gh,) = torch.autograd.grad(loss.sum(), [hidden])
    (ref,) = torch.autograd.grad(reference(hidden, frozen, targets).sum(), [hidden])
    torch.testing.assert_close(gh, ref, rtol=1e-5, atol=1e-5)
    assert frozen.grad is None


# -- weighted_cross_entropy: sum_i c_i CE_i with the gradients computed in the forward -------


def plain_weighted(hidden, weight, targets, coef):
    return (chunked_cross_entropy(hidden, weight, targets, 7, 5) * coef).sum()


@pytest.mark.parametrize("vocab_chunk,row_chunk", [(50, 13), (7, 4), (1, 1), (64, 100)])
def test_weighted_loss_and_grads_equal_the_plain_path(vocab_chunk, row_chunk):
    """Rows per block = row_chunk * vocab_chunk // V: one row, several blocks, all rows."""
    hidden, weight, targets = inputs()
    coef = torch.rand(N, generator=torch.Generator().manual_seed(2))
    coef[3] = 0.0  # a masked row whose weight is 0 contributes nothing
    fused = weighted_cross_entropy(hidden, weight, targets, coef, vocab_chunk, row_chunk)
    plain = plain_weighted(hidden, weight, targets, coef)
    assert fused.dtype == torch.float32 and fused.shape == ()
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(fused * 3.0, [hidden, weight])  # the incoming gradient scales
    ref_grads = torch.autograd.grad(plain * 3.0, [hidden, weight])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_weighted_loss_with_a_frozen_head_or_bf16_or_no_rows():
    hidden, weight, targets = inputs()
    coef = torch.rand(N, generator=torch.Generator().manual_seed(3))
    frozen = weight.detach()
    fused = weighted_cross_entropy(hidden, frozen, targets, coef)
    (g,) = torch.autograd.grad(fused, [hidden])
    (r,) = torch.autograd.grad(plain_weighted(hidden, frozen, targets, coef), [hidden])
    torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    hb, wb, _ = inputs(torch.bfloat16)
    fused = weighted_cross_entropy(hb, wb, targets, coef)
    grads = torch.autograd.grad(fused, [hb, wb])
    ref_grads = torch.autograd.grad(plain_weighted(hb, wb, targets, coef), [hb, wb])
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16]
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)
    empty = weighted_cross_entropy(hidden[:0], weight, targets[:0], coef[:0])
    assert float(empty.detach()) == 0.0 and empty.requires_grad
    with torch.no_grad():  # no gradient wanted: the forward-only path, same number
        torch.testing.assert_close(
            weighted_cross_entropy(hidden, weight, targets, coef),
            plain_weighted(hidden, weight, targets, coef),
        )


def test_native_model_target_weights_equal_the_weighted_per_token_losses():
    """model(..., target_weights=w) is sum(w * model(..., targets)) with every parameter's
    gradient the same (tied head: the embedding gets both of its gradients)."""
    model = tiny_model(vocab_size=97, tie_word_embeddings=True)
    ids = torch.randint(0, 97, (2, 12))
    targets = torch.where(torch.rand(2, 12) < 0.5, ids, -100)
    w = torch.rand(2, 12)
    fused = model(ids, targets=targets, target_weights=w)
    grads = torch.autograd.grad(fused, list(model.parameters()))
    plain = (model(ids, targets=targets) * w).sum()
    ref_grads = torch.autograd.grad(plain, list(model.parameters()))
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_full_cross_entropy_is_torchs_on_the_whole_logits():
    """full_cross_entropy: the logits of every position, float32 cross_entropy, 0 where
    there is no target, shaped like the targets."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (2, 5), generator=g)
    targets[0, 1] = targets[1, 4] = IGNORE_INDEX
    got = full_cross_entropy(hidden, weight, targets)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    want = F.cross_entropy((hidden @ weight.T).reshape(10, V), targets.reshape(10),
                           reduction="none").reshape(2, 5)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[0, 1] == 0 and got[1, 4] == 0


@pytest.mark.parametrize("tied", [True, False])
def test_full_loss_implementation_equals_the_chunked_path(tied):
    """model.loss_implementation full (the whole logits) and chunked (the default) give
    the same weighted loss, per-token losses and every parameter's gradient in float32."""
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    targets = torch.where(torch.rand(2, 12) < 0.5, ids, -100)
    w = torch.where(targets != -100, torch.rand(2, 12), 0.0)
    results = {}
    for impl in ("chunked", "full"):
        model = tiny_model(vocab_size=97, tie_word_embeddings=tied, loss_implementation=impl)
        loss = model(ids, targets=targets, target_weights=w)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results[impl] = (loss, grads, model(ids, targets=targets))
    (loss, grads, tokens), (ref_loss, ref_grads, ref_tokens) = results["full"], results["chunked"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tokens, ref_tokens, rtol=1e-6, atol=1e-6)
    assert bool((tokens[targets == -100] == 0).all())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_full_loss_under_bf16_autocast_rounds_the_logits():
    """Under bf16 autocast both paths run the head's GEMM in bfloat16 (the full path as
    transformers' and torchtitan's; the chunked path too, on a CPU widening the bf16
    product, loss.py Precision): equal but for the order of the log-sum-exp's float32
    sums, and both off the float32 path by the logits' rounding only."""
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    targets = torch.where(torch.rand(2, 12) < 0.5, ids, -100)
    w = torch.where(targets != -100, 1.0, 0.0)
    losses = {}
    for impl in ("chunked", "full"):
        model = tiny_model(vocab_size=97, loss_implementation=impl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[impl] = model(ids, targets=targets, target_weights=w)
        losses[impl + " float32"] = model(ids, targets=targets, target_weights=w)
    torch.testing.assert_close(losses["full"], losses["chunked"], rtol=1e-6, atol=0)
    assert losses["chunked"] != losses["chunked float32"]  # rounded
    torch.testing.assert_close(losses["chunked"], losses["chunked float32"], rtol=1e-2, atol=0)


def test_pipeline_last_stage_full_loss_equals_the_chunked_path():
    """The pipeline's last stage (parallel/pipeline.py StageModule) takes the same
    loss_implementation: its weighted loss and gradients equal the chunked stage's, with
    the head's gradients made in the forward (1F1B's fused loss) or in the backward
    (GPipe's chunked one)."""
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(6))
    targets = torch.where(torch.rand(2, 12) < 0.5, ids, -100)
    w = torch.where(targets != -100, torch.rand(2, 12), 0.0)
    results = {}
    for schedule in ("1f1b", "gpipe"):
        plan = plan_pipeline(1, schedule, 1, 1, None, LayerCosts((1.0, 1.0), 0.0, 0.0), 2)
        for impl in ("chunked", "full"):
            model = tiny_model(vocab_size=97, tie_word_embeddings=False,
                               loss_implementation=impl)  # fmt: skip
            (stage,) = PipelineModel(model, plan, 0).stages
            loss = stage(ids, targets=targets, target_weights=w)
            results[schedule, impl] = (loss, torch.autograd.grad(loss, list(model.parameters())))
    reference = results["1f1b", "chunked"]
    for key in (("1f1b", "full"), ("gpipe", "chunked"), ("gpipe", "full")):
        torch.testing.assert_close(results[key][0], reference[0], rtol=1e-6, atol=1e-6)
        for g, r in zip(results[key][1], reference[1]):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_zero_bubble_stage_makes_each_gradient_once():
    """Zero bubble's last stage through a linear layer and the fused loss: the loss makes
    the head's and the hidden rows' gradients in its forward (3 x 2 N H V FLOPs: the
    logits, then both gradients), the input pass (one autograd backward while the stage's
    BackwardPass defers) only the layer's input gradient, the weight pass (what it
    deferred, `take()`) only the layer's weight gradient; together the same gradients, bit
    for bit, as one plain backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from unmask.diffusion.backward import BackwardPass
    from unmask.models.fused import linear

    class MatmulFlops(TorchDispatchMode):  # torch's FlopCounterMode leaves out addmm_
        def __init__(self):
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("mm", "addmm", "addmm_"):
                first, second = args[-2], args[-1]
                self.total += 2 * first.shape[0] * first.shape[1] * second.shape[1]
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    n, h, v = 24, 16, 96
    x0 = torch.randn(n, h, generator=g)
    a0, w0 = torch.randn(h, h, generator=g) / 4, torch.randn(v, h, generator=g) / 4
    targets = torch.randint(0, v, (n,), generator=g)
    coef = torch.rand(n, generator=g)

    def stage(holder):
        x = x0.clone().requires_grad_(True)
        a, w = a0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        hidden = torch.tanh(linear(x, a, None, holder) if holder else x @ a.T)
        return x, a, w, weighted_cross_entropy(hidden, w, targets, coef, 32, 8)

    x, a, w, loss = stage(None)
    loss.backward()
    plain = (x.grad, a.grad, w.grad)
    holder = BackwardPass()
    with MatmulFlops() as forward:
        x, a, w, loss = stage(holder)
    holder.deferring = True
    with MatmulFlops() as first:
        loss.backward()
    holder.deferring = False
    assert x.grad is not None and a.grad is None and w.grad is not None
    weight_pass = holder.take()
    with MatmulFlops() as second:
        weight_pass()
    for got, want in zip((x.grad, a.grad, w.grad), plain):
        assert torch.equal(got, want)
    head, layer = 2 * n * h * v, 2 * n * h * h
    assert [forward.total, first.total, second.total] == [3 * head + layer, layer, layer]
    assert holder.take() is not weight_pass  # taken once: the next take has nothing


def test_a_micro_batch_without_targets_leaves_gradients_that_later_ones_add_into():
    """A micro-batch with no masked rows (0 targets) still gives the head a gradient, zeros
    of its own, into which the next micro-batch's is added in place: the sum of both
    equals one backward of all rows. (An expanded scalar there made torch's own split
    backward fail: "more than one element of the written-to tensor refers to a single
    memory location".)"""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(40, 8, generator=g) / 4).requires_grad_(True)
    rows = torch.randn(6, 8, generator=g)
    targets = torch.randint(0, 40, (6,), generator=g)
    for n in (0, 6):  # the empty micro-batch first
        x = rows[:n].clone().requires_grad_(True)
        chunked_cross_entropy(x, w, targets[:n]).sum().backward()
        if n == 0:
            assert w.grad is not None and w.grad.stride() == (8, 1) and not w.grad.any()
    reference = w.detach().clone().requires_grad_(True)
    F.cross_entropy(rows @ reference.T, targets, reduction="sum").backward()
    torch.testing.assert_close(w.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_the_head_under_bf16_autocast_runs_bf16_gemms_with_float32_results():
    """Under bf16 autocast the fused loss's three GEMMs take bf16 (the logits and both
    gradients; the master weight float32, so its gradient is float32 too), the loss and
    gradients equal the float32 path's within bf16 rounding."""
    from unmask.train.audit import MatmulAudit

    g = torch.Generator().manual_seed(7)
    n, h, v = 300, 32, 97  # rows in three blocks of the smallest multiple
    hidden0 = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight0 = torch.randn(v, h, generator=g) / 4
    targets = torch.randint(0, v, (n,), generator=g)
    coef = torch.rand(n, generator=g)
    results = {}
    for precision in ("bfloat16", "float32"):
        hidden = hidden0.clone().requires_grad_(True)
        weight = weight0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            with MatmulAudit() as audit:
                loss = weighted_cross_entropy(hidden.float() if precision == "float32"
                                              else hidden, weight, targets, coef, 128, 1)  # fmt: skip
        loss.backward()
        assert set(audit.flops_by_dtype()) == {getattr(torch, precision)}
        assert audit.total == 3 * 2 * n * h * v
        assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
        results[precision] = (loss, hidden.grad.float(), weight.grad)
    for got, want in zip(results["bfloat16"], results["float32"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_row_blocks_of_the_fused_loss_are_multiples_of_128_where_they_fit():
    from unmask.diffusion.loss import loss_block_rows

    budget = 4096 * 8192  # the default row_chunk x vocab_chunk
    assert loss_block_rows(126_464, budget) == 256  # LLaDA: 265 rows fit
    assert loss_block_rows(152_064, budget) == 128  # Dream: 220
    assert loss_block_rows(500_000, budget) == 67  # fewer than 128 fit: as many as fit
    assert loss_block_rows(128, budget) == budget // 128


def test_cuda_takes_larger_loss_blocks_and_the_cpu_keeps_its_own():
    """The fused loss's block on CUDA: up to 2^28 logits (2048 rows at LLaDA's vocabulary
    where the CPU's 4096 x 8192 gives 256), at most an eighth of the free memory at 6 bytes
    a logit, never fewer than the CPU's; the CPU's is row_chunk x vocab_chunk as before."""
    from unmask.diffusion.loss import loss_block_elements, loss_block_rows

    budget = 4096 * 8192
    assert loss_block_elements("cpu", budget) == budget
    assert loss_block_rows(126_464, loss_block_elements("cpu", budget)) == 256
    roomy = loss_block_elements("cuda", budget, free_bytes=120 << 30)
    assert roomy == 1 << 28 == loss_block_elements("cuda:1", budget, free_bytes=1 << 40)
    assert loss_block_rows(126_464, roomy) == 2048  # LLaDA
    assert loss_block_rows(152_064, roomy) == 1664  # Dream: 1765 fit
    tight = loss_block_elements("cuda", budget, free_bytes=4 << 30)
    assert tight == (4 << 30) // 48 and loss_block_rows(126_464, tight) == 640
    assert loss_block_elements("cuda", budget, free_bytes=1 << 30) == budget  # never fewer


@pytest.mark.parametrize("row_chunk", [1, 7, 128])
def test_the_fused_loss_and_its_grads_do_not_depend_on_the_block_rows(row_chunk):
    """Blocks of 1, 7 and 128 rows against one block of all 300 (vocab_chunk = V: rows per
    block = row_chunk): the loss and both gradients equal within float32 rounding (the
    sums over blocks are reordered, so not bit for bit)."""
    g = torch.Generator().manual_seed(5)
    n, vocab = 300, 50
    hidden = torch.randn(n, H, generator=g).requires_grad_()
    weight = torch.randn(vocab, H, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.rand(n, generator=g)
    results = []
    for rows in (row_chunk, n):
        loss = weighted_cross_entropy(hidden, weight, targets, coef, vocab, rows)
        results.append((loss, *torch.autograd.grad(loss, [hidden, weight])))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
