"""Cross-entropy on selected rows only, chunked over the vocabulary.

The masked-diffusion losses need logits only at masked positions. Running the LM head
on those rows alone, and never holding a (rows x vocab) float32 matrix for more than
one chunk at a time, keeps a 150k vocabulary from dominating activation memory. The
backward pass recomputes each chunk's logits instead of storing them.

Each pass owns one (row_chunk x vocab_chunk) block, reused for every chunk: the logits
are written into it (`mm(out=)`) and turned into probabilities in place, and the
gradients are written into their outputs by the first chunk's `mm(out=)` and accumulated
by `addmm_`. A fresh block per elementwise op costs a page-faulting allocation each: on
CPU at vocabulary 151,936 and hidden 256 that made the loss 1.16x slower on an idle core
and up to 1.5x under load.

Under tensor parallelism the head arrives split by vocabulary rows (a DTensor): both
functions then run on the rank's own rows and assemble the log-sum-exp over the tp ranks
(the vocab-parallel section below), equal to the replicated head within float rounding
(tests/integration/test_vocab_parallel.py).

Precision: the head's three GEMMs (the logits, the hidden rows' and the head's gradients)
run in the compute dtype, autocast's (bf16 under train.bf16) or else the hidden rows', with
float32 outputs and accumulation; the log-sum-exp, the softmax and every sum are float32.
On a GPU that is tensor cores with fp32 accumulation (`torch.mm(..., out_dtype=float32)`,
15x the CUDA-core float32 rate on an H100); where that form is missing (a CPU) a bf16 GEMM's
bf16 result is widened, as transformers' models compute their logits. The head's gradient
is accumulated and returned in float32 (the master weights' dtype), the hidden rows' in
their dtype. tests/unit/test_loss.py pins the bf16 path to the float32 one.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from unmask.dtensor import is_dtensor
from unmask.host import HostCopy

#: A target of -100 means "no loss here" (the masked-only loss reads only the other rows);
#: the same value torch's cross_entropy ignores by default.
IGNORE_INDEX = -100


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _block(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous (rows, cols) view of the front of a flat buffer."""
    return buffer[: rows * cols].view(rows, cols)


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's GEMMs take: autocast's where it is on, else the hidden rows'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


_WIDE_OUTPUT: dict[torch.device, bool] = {}


def _wide_output(a: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether torch multiplies a's dtype into out's wider one on a's device (the
    `out_dtype` form of mm / addmm: CUDA's bf16 and fp16 GEMMs), tried once per device on a
    small product and checked against the widened one."""
    if a.device.type == "cpu" or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (a.device, a.dtype, out.dtype)
    if key not in _WIDE_OUTPUT:
        x = torch.arange(48, device=a.device).reshape(6, 8).to(a.dtype) / 7
        try:
            got = torch.mm(x, x.T, out_dtype=out.dtype)
            acc = torch.addmm(got.clone(), x, x.T, out_dtype=out.dtype)
            want = x.to(out.dtype) @ x.T.to(out.dtype)
            _WIDE_OUTPUT[key] = bool(torch.allclose(got, want, rtol=1e-3)
                                     and torch.allclose(acc, 2 * want, rtol=1e-3))  # fmt: skip
        except (RuntimeError, TypeError):
            _WIDE_OUTPUT[key] = False
    return _WIDE_OUTPUT[key]


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = True) -> None:
    """out = a @ b when first, else out += a @ b; a and b in the compute dtype, out in the
    accumulation dtype (float32): no temporary of out's size where the GEMM writes float32
    itself."""
    if a.dtype == out.dtype:
        if first:
            torch.mm(a, b, out=out)
        else:
            out.addmm_(a, b)
    elif _wide_output(a, out):
        if first:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
        else:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    elif first:
        out.copy_(a @ b)
    else:
        out.add_(a @ b)


def _logits_into(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out = h @ w.T (h (R, H), w (C, H) in the compute dtype) stored in out's float32."""
    _mm_into(out, h, w.T)
    return out


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_chunk, row_chunk, compute):
        # hidden (N, H), weight (V, H), targets (N,) -> loss (N,) float32; the GEMMs in
        # `compute` (module doc: Precision)
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(compute, torch.float32)
        buffer = hidden.new_empty(min(n, row_chunk) * min(v, vocab_chunk), dtype=acc)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        hidden_c, weight_c = hidden.to(compute), weight.to(compute)
        for r0, r1 in _chunks(n, row_chunk):
            h = hidden_c[r0:r1]
            # online logsumexp over vocabulary chunks: running max and sum of exp(x - max)
            run_max = torch.full((r1 - r0,), float("-inf"), dtype=acc, device=hidden.device)
            run_sum = torch.zeros(r1 - r0, dtype=acc, device=hidden.device)
            for v0, v1 in _chunks(v, vocab_chunk):
                logits = _logits_into(_block(buffer, r1 - r0, v1 - v0), h, weight_c[v0:v1])
                new_max = torch.maximum(run_max, logits.amax(dim=1))
                run_sum.mul_(torch.exp(run_max - new_max))
                run_sum.add_(logits.sub_(new_max[:, None]).exp_().sum(dim=1))
                run_max = new_max
            lse[r0:r1] = run_max + run_sum.log()
        target_logit = (hidden_c.to(acc) * weight_c[targets].to(acc)).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.vocab_chunk, ctx.row_chunk, ctx.compute = vocab_chunk, row_chunk, compute
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunks = (ctx.vocab_chunk, ctx.row_chunk)
        want_weight = ctx.needs_input_grad[1]  # a frozen head (LoRA): less
        grad_hidden, grad_weight = _chunked_gradients(
            hidden, weight, targets, lse, grad_loss, *chunks, want_weight,
            want_hidden=ctx.needs_input_grad[0], compute=ctx.compute,
        )  # fmt: skip
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunked_gradients(hidden, weight, targets, lse, grad_loss, vocab_chunk: int,
                       row_chunk: int, want_weight: bool, start: int = 0,
                       want_hidden: bool = True, compute: torch.dtype | None = None):  # fmt: skip
    """The gradients of the per-row cross-entropy from its log-sum-exp (the hidden rows'
    unless not want_hidden, the head's when want_weight; None for the others), in the
    accumulation dtype: d loss_i / d logits_ij = softmax_ij - [j == target_i], out of one
    (rows x chunk) block per chunk with the target's -1 folded into it. weight holds the
    vocabulary rows [start, start + V) (all of them, or a tensor-parallel rank's share: its
    targets elsewhere get no -1 here). The GEMMs in `compute` (None: hidden's dtype)."""
    acc = lse.dtype
    compute = hidden.dtype if compute is None else compute
    hidden, weight = hidden.to(compute), weight.to(compute)
    n, v = hidden.shape[0], weight.shape[0]
    grad_loss = grad_loss.to(acc)
    grad_hidden = grad_weight = None
    if want_hidden:
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
    if want_weight:
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    buffer = hidden.new_empty(min(n, row_chunk) * max(min(v, vocab_chunk), 1), dtype=acc)
    for r0, r1 in _chunks(n, row_chunk):
        h = hidden[r0:r1]
        g_rows = grad_loss[r0:r1, None]
        t_rows = targets[r0:r1]
        for v0, v1 in _chunks(v, vocab_chunk):
            w = weight[v0:v1]
            probs = _logits_into(_block(buffer, r1 - r0, v1 - v0), h, w)
            probs.sub_(lse[r0:r1, None]).exp_().mul_(g_rows)
            hit, cols = _owned(t_rows, start + v0, v1 - v0)  # a mask, not indices: no sync
            probs.scatter_add_(1, cols[:, None], torch.where(hit[:, None], -g_rows, 0.0))
            probs_c = probs.to(compute)
            if want_hidden:
                _mm_into(grad_hidden[r0:r1], probs_c, w, first=v0 == 0)
            if want_weight:
                _mm_into(grad_weight[v0:v1], probs_c.T, h, first=r0 == 0)
    return grad_hidden, grad_weight


class _WeightedCrossEntropy(torch.autograd.Function):
    """sum_i c_i CE_i with both gradients computed in the forward (the output is a scalar,
    so the backward only scales them by the incoming gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, coef, block_rows, compute):
        # hidden (N, H), weight (V, H), targets (N,), coef (N,) -> 0-d float32; the GEMMs
        # in `compute` (module doc: Precision)
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(compute, torch.float32)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = grad_weight = None
        if want_hidden:
            grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
        if want_weight:
            grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device)
        hidden_c, weight_c = hidden.to(compute), weight.to(compute)
        buffer = hidden.new_empty(min(n, block_rows) * v, dtype=acc)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for r0, r1 in _chunks(n, block_rows):
            h = hidden_c[r0:r1]
            t_rows = targets[r0:r1, None]
            c = coef[r0:r1].to(acc)
            logits = _logits_into(_block(buffer, r1 - r0, v), h, weight_c)  # (R, V)
            row_max = logits.amax(dim=1)
            target_logit = logits.gather(1, t_rows).squeeze(1)
            probs = logits.sub_(row_max[:, None]).exp_()  # unnormalized, in place
            sums = probs.sum(dim=1)
            total += (c * (row_max + sums.log() - target_logit)).sum()
            # d (c_i CE_i) / d logits_ij = c_i (softmax_ij - [j == target_i])
            probs.mul_((c / sums)[:, None]).scatter_add_(1, t_rows, -c[:, None])
            probs_c = probs.to(compute)
            if want_hidden:
                _mm_into(grad_hidden[r0:r1], probs_c, weight_c)
            if want_weight:
                _mm_into(grad_weight, probs_c.T, h, first=r0 == 0)
        ctx.grads = (grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        hidden_dtype, weight_dtype = ctx.dtypes
        g = grad_total.to(torch.float32)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(g).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(g).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


# ---------------------------------------------------------------- vocab-parallel LM head
#
# Under tensor parallelism the LM head is a DTensor split by vocabulary rows over the tp
# ranks (parallel/tensor.py). Each rank computes the logits of its own ids only, for the
# same (replicated) hidden rows; the log-sum-exp is assembled with two all-reduces over the
# tp group per row block (Megatron's formulation): the max over ranks of the local row max,
# then the sum of the local exp-sums rescaled to that max, with each row's target logit
# (held by one rank, 0 on the others) summed in the same all-reduce. The backward's
# gradient of the hidden rows is a sum over the ranks' vocabulary shards: one all-reduce;
# the head's gradient is each rank's own rows, with no collective. No rank ever holds
# logits for the whole vocabulary: blocks are 1/tp of the replicated path's (rows chosen
# as the replicated path would, columns split over the ranks).


class VocabShard(NamedTuple):
    """This rank's rows [start, start + len(weight)) of a vocab-parallel LM head."""

    weight: torch.Tensor  # the local rows (V_local, H): DTensor.to_local, in the graph
    start: int
    vocab: int  # the whole vocabulary V
    group: dist.ProcessGroup
    ranks: int


def vocab_shard(weight: torch.Tensor) -> VocabShard | None:
    """The local shard of a head split by vocabulary rows over a 1-D mesh (a DTensor with
    placements (Shard(0),)); None for a plain tensor. Shards follow DTensor's (torch.chunk's)
    split: ceil(V / tp) rows per rank, fewer on the last."""
    if not is_dtensor(weight):
        return None
    from torch.distributed.tensor import Shard  # imported already: a DTensor

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"an LM head DTensor must be split by vocabulary rows over one mesh "
                         f"dim; got placements {weight.placements} on {mesh}")  # fmt: skip
    vocab, ranks = weight.shape[0], mesh.size()
    start = min(mesh.get_local_rank() * -(-vocab // ranks), vocab)
    return VocabShard(weight.to_local(), start, vocab, mesh.get_group(), ranks)


def _owned(targets: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets in [start, start + rows): a mask, the local column of each, clamped)."""
    hit = (targets >= start) & (targets < start + rows)
    return hit, (targets - start).clamp(0, max(rows - 1, 0))


def _global_lse(run_max, run_sum, target_logit, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp over every rank's vocabulary, the target logit) of rows whose local
    running max and exp-sum (relative to that max) and local target logit (0 where another
    rank holds the target) are given: all-reduce max, then one all-reduce sum of both."""
    top = run_max.clone()
    dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
    both = torch.stack([run_sum * torch.exp(run_max - top), target_logit])
    dist.all_reduce(both, group=group)
    return top + both[0].log(), both[1]


def _local_target_logit(hidden, weight, targets, start, acc) -> torch.Tensor:
    """hidden_i . weight[target_i] where this rank holds target_i, else 0 (acc dtype)."""
    hit, cols = _owned(targets, start, weight.shape[0])
    if weight.shape[0] == 0:
        return torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device)
    logit = (hidden * weight[cols].to(hidden.dtype)).to(acc).sum(-1)
    return torch.where(hit, logit, 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, start, group, vocab_chunk, row_chunk, compute):
        # hidden (N, H) the same on every tp rank, weight (V_local, H) this rank's rows
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(compute, torch.float32)
        buffer = hidden.new_empty(min(n, row_chunk) * max(min(v, vocab_chunk), 1), dtype=acc)
        run_max = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
        run_sum = torch.zeros(n, dtype=acc, device=hidden.device)
        hidden_c, weight_c = hidden.to(compute), weight.to(compute)
        for r0, r1 in _chunks(n, row_chunk):
            h, m, s = hidden_c[r0:r1], run_max[r0:r1], run_sum[r0:r1]
            for v0, v1 in _chunks(v, vocab_chunk):
                logits = _logits_into(_block(buffer, r1 - r0, v1 - v0), h, weight_c[v0:v1])
                new_max = torch.maximum(m, logits.amax(dim=1))
                s.mul_(torch.exp(m - new_max))
                s.add_(logits.sub_(new_max[:, None]).exp_().sum(dim=1))
                m.copy_(new_max)
        target_logit = _local_target_logit(hidden_c, weight_c, targets, start, acc)
        lse, target_logit = _global_lse(run_max, run_sum, target_logit, group)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.start, ctx.group, ctx.vocab_chunk, ctx.row_chunk = start, group, vocab_chunk, row_chunk
        ctx.compute = compute
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        # as _ChunkedCrossEntropy.backward on this rank's columns; the hidden rows' gradient
        # is then summed over the ranks
        hidden, weight, targets, lse = ctx.saved_tensors
        want_weight = ctx.needs_input_grad[1]
        grad_hidden, grad_weight = _chunked_gradients(
            hidden,
            weight,
            targets,
            lse,
            grad_loss,
            ctx.vocab_chunk,
            ctx.row_chunk,
            want_weight,
            start=ctx.start,
            compute=ctx.compute,
        )
        dist.all_reduce(grad_hidden, group=ctx.group)
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None


class _VocabParallelWeightedCrossEntropy(torch.autograd.Function):
    """`_WeightedCrossEntropy` on this rank's vocabulary rows: per row block, the local
    logits, the global log-sum-exp (`_global_lse`), then both gradients from the same block;
    the hidden rows' gradient is summed over the ranks once at the end."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, coef, start, group, block_rows, compute):
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(compute, torch.float32)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = grad_weight = None
        if want_hidden:
            grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        if want_weight:
            grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        hidden_c, weight_c = hidden.to(compute), weight.to(compute)
        buffer = hidden.new_empty(min(n, block_rows) * max(v, 1), dtype=acc)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for r0, r1 in _chunks(n, block_rows):
            h = hidden_c[r0:r1]
            hit, cols = _owned(targets[r0:r1], start, v)
            c = coef[r0:r1].to(acc)
            logits = _logits_into(_block(buffer, r1 - r0, v), h, weight_c)  # (R, V_local)
            if v:
                row_max = logits.amax(dim=1)
                target_logit = torch.where(hit, logits.gather(1, cols[:, None]).squeeze(1), 0.0)
            else:
                row_max = torch.full((r1 - r0,), float("-inf"), dtype=acc, device=h.device)
                target_logit = torch.zeros(r1 - r0, dtype=acc, device=h.device)
            top = row_max.clone()
            dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
            probs = logits.sub_(top[:, None]).exp_()  # unnormalized, in place
            both = torch.stack([probs.sum(dim=1), target_logit])
            dist.all_reduce(both, group=group)
            sums, target_logit = both[0], both[1]
            total += (c * (top + sums.log() - target_logit)).sum()
            probs.mul_((c / sums)[:, None])
            if v:
                probs.scatter_add_(1, cols[:, None], torch.where(hit, -c, 0.0)[:, None])
            probs_c = probs.to(compute)
            if want_hidden:
                _mm_into(grad_hidden[r0:r1], probs_c, weight_c)
            if want_weight:
                _mm_into(grad_weight, probs_c.T, h, first=r0 == 0)
        if want_hidden:
            dist.all_reduce(grad_hidden, group=group)
        ctx.grads = (grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = _WeightedCrossEntropy.backward(ctx, grad_total)[:2]
        return grad_hidden, grad_weight, None, None, None, None, None, None


def weighted_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    vocab_chunk: int = 8192,
    row_chunk: int = 4096,
    fused: bool = True,
) -> torch.Tensor:
    """sum_i coef_i * CE_i, 0-d float32: `(coef * chunked_cross_entropy(...)).sum()` with
    one pass over the LM head fewer when gradients are wanted (both are computed in the
    forward; tests/unit/test_loss.py pins them to the plain path). coef (N,) carries no
    gradient. Rows are taken `row_chunk * vocab_chunk // V` at a time (at least one), so
    the block holds as many elements as chunked_cross_entropy's. fused=False: the plain
    path all the same, its gradients made in the backward.
    """
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if hidden.shape[0] == 0 or not needs_grad or not fused:
        losses = chunked_cross_entropy(hidden, weight, targets, vocab_chunk, row_chunk)
        return (losses * coef.detach().to(losses.dtype)).sum()
    elements = loss_block_elements(hidden.device, row_chunk * vocab_chunk)
    block_rows = loss_block_rows(weight.shape[0], elements)
    shard = vocab_shard(weight)
    compute = compute_dtype(hidden)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        if shard is not None:  # the replicated path's rows per block, 1/tp of its columns
            return _VocabParallelWeightedCrossEntropy.apply(
                hidden, shard.weight, targets, coef.detach(), shard.start, shard.group,
                block_rows, compute,
            )  # fmt: skip
        return _WeightedCrossEntropy.apply(hidden, weight, targets, coef.detach(), block_rows,
                                           compute)  # fmt: skip


#: rows of a block of the fused loss are a multiple of this (a GEMM's M tile on a GPU)
BLOCK_ROWS_MULTIPLE = 128

#: logits in a block of the fused loss at the default row_chunk x vocab_chunk (the CPU's)
LOSS_BLOCK = 4096 * 8192

#: logits in a block of the fused loss on a CUDA device, at most: each block reads and
#: writes the whole float32 head gradient (`addmm_`; 2 GiB at vocabulary 126,464 and hidden
#: 4096): 2048 target rows in blocks of 256 rows read and write it 8 times, in one block once.
#: 2^28 logits: a 1 GiB float32 block and its 0.5 GiB bf16 copy, 2048 rows at 126,464.
CUDA_BLOCK_ELEMENTS = 1 << 28

#: ... and at most this share of the device's free memory (6 bytes a logit: the float32
#: block and its copy in the compute dtype)
CUDA_BLOCK_FREE_SHARE = 8

_CUDA_BLOCK: dict[int, int] = {}  # device index -> elements, chosen at the first loss


def loss_block_elements(device: torch.device | str, elements: int,
                        free_bytes: int | None = None) -> int:  # fmt: skip
    """Logits per block of the fused loss on `device`: `elements` (row_chunk x vocab_chunk)
    on a CPU and other devices; on CUDA larger, up to CUDA_BLOCK_ELEMENTS and
    1 / CUDA_BLOCK_FREE_SHARE of the free memory (6 bytes a logit), never below `elements`.
    `free_bytes` None: the device's free memory read at its first call and kept for the
    process, so every step cuts its rows alike (the sums over blocks keep one order)."""
    device = torch.device(device)
    if device.type != "cuda":
        return elements
    if free_bytes is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _CUDA_BLOCK:
            _CUDA_BLOCK[index] = loss_block_elements(
                device, 0, torch.cuda.mem_get_info(index)[0]
            )  # fmt: skip
        return max(elements, _CUDA_BLOCK[index])
    share = free_bytes // (6 * CUDA_BLOCK_FREE_SHARE)
    return max(elements, min(CUDA_BLOCK_ELEMENTS, share))


def loss_block_rows(vocab: int, elements: int) -> int:
    """Rows per block of the fused loss: as many as fit `elements` (rows x vocab) logits,
    rounded down to a multiple of BLOCK_ROWS_MULTIPLE when that many fit (a GEMM's last M
    tile left partly empty wastes its share of the block's work: 265 rows at vocabulary
    126,464 became 256); fewer (at least 1) when the vocabulary leaves room for less."""
    rows = max(1, elements // max(1, vocab))
    if rows < BLOCK_ROWS_MULTIPLE:
        return rows
    return rows - rows % BLOCK_ROWS_MULTIPLE


class SelectedRows:
    """The positions of `targets` (any shape, -100 = no target) that have one, gathered
    without a device sync: their count is copied to the host as soon as the targets exist
    (`HostCopy`; make this before the model's forward, so the copy is done long before the
    loss reads it), and the rows are taken by `nonzero_static` with that count, where
    boolean indexing would wait for the whole forward to learn how many rows it returns."""

    def __init__(self, targets: torch.Tensor):
        self.shape = targets.shape
        self.mask = (targets != IGNORE_INDEX).reshape(-1)
        self._count = HostCopy(self.mask.sum())
        self._index: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return int(self._count.item())

    @property
    def index(self) -> torch.Tensor:
        """(count,) long: the flat positions with a target, in order."""
        if self._index is None:
            size = self.count
            self._index = torch.nonzero_static(self.mask, size=size).squeeze(1)
        return self._index

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """values (*targets.shape, ...) -> (count, ...) at the positions with a target."""
        flat = values.reshape(self.mask.shape[0], *values.shape[len(self.shape) :])
        if flat.requires_grad:  # saves the 1-byte mask, not the 8-byte index (_TakeRows)
            return _TakeRows.apply(flat, self.mask, self.count, self.index)
        return flat.index_select(0, self.index)

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """(count,) values back to their positions: targets.shape, 0 where there is none."""
        flat = torch.zeros(self.mask.shape[0], dtype=rows.dtype, device=rows.device)
        return flat.index_put((self.index,), rows).view(self.shape)


class _TakeRows(torch.autograd.Function):
    """rows = values.index_select(0, index) whose backward rebuilds the index from the mask
    and the host count: what it holds for backward is the boolean mask (one byte a
    position, the same whatever the count), not the index (eight bytes a target row)."""

    @staticmethod
    def forward(ctx, values, mask, count: int, index):
        ctx.save_for_backward(mask)
        ctx.count = count
        return values.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        index = torch.nonzero_static(mask, size=ctx.count).squeeze(1)
        values = grad.new_zeros((mask.shape[0], *grad.shape[1:]))
        return values.index_copy_(0, index, grad), None, None, None


def weighted_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    target_weights: torch.Tensor,
    vocab_chunk: int = 8192,
    implementation: str = "chunked",
    fused: bool = True,
    selected: SelectedRows | None = None,
) -> torch.Tensor:
    """sum_i w_i CE_i over the positions with a target (hidden (..., H), targets and
    target_weights (...), -100 = no target), 0-d float32, by `model.loss_implementation`:
    "full" through the whole logits (`full_cross_entropy`), "chunked" on the target rows
    only (`weighted_cross_entropy`, with `fused`). selected: the targets' `SelectedRows`,
    made before the forward (None: made here, and on a GPU the count read then waits for
    the forward)."""
    if implementation == "full":  # the whole logits, as HF / torchtitan
        losses = full_cross_entropy(hidden, weight, targets)
        return (losses * target_weights.detach().float()).sum()
    selected = SelectedRows(targets) if selected is None else selected
    return weighted_cross_entropy(selected.take(hidden), weight, selected.take(targets),
                                  selected.take(target_weights), vocab_chunk, fused=fused)  # fmt: skip


def full_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Per-position cross-entropy through the whole logits (`model.loss_implementation:
    full`), as transformers' and torchtitan's losses compute it: logits = hidden @
    weight.T for every position in the compute dtype (autocast's, else hidden's), their
    float32 copy, torch's cross_entropy (its log-softmax, (positions x V) float32, saved
    for backward). hidden (..., H), targets (...) with -100 = no loss; returns (...)
    float32, 0 at the positions without a target."""
    logits = F.linear(hidden, weight)
    losses = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                             ignore_index=IGNORE_INDEX, reduction="none")  # fmt: skip
    return losses.view(targets.shape)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_chunk: int = 8192,
    row_chunk: int = 4096,
) -> torch.Tensor:
    """Per-row cross-entropy -log softmax(hidden @ weight.T)[target], float32.

    hidden: (N, H) final hidden states of the rows that need a loss.
    weight: (V, H) the LM head (tied or not); no bias.
    targets: (N,) token ids. Returns (N,) losses; peak extra memory is one
    (row_chunk x vocab_chunk) float32 block instead of (N x V).

    A weight split by vocabulary rows over tp ranks (a DTensor, `vocab_shard`) takes the
    vocab-parallel path: hidden and targets the same on every tp rank, losses too, and each
    rank's block 1/tp of the replicated one (vocab_chunk / tp columns).
    """
    shard = vocab_shard(weight)
    local = weight if shard is None else shard.weight
    if hidden.shape[0] == 0:  # keeps both in the graph, their gradients zeros; (local * 0)
        # makes the head's a tensor of its own where local.sum()'s would be an expanded
        # scalar, which a later micro-batch's gradient could not be added into in place
        return hidden.sum(-1) * 0 + (local * 0).sum()
    compute = compute_dtype(hidden)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        if shard is not None:
            chunk = max(1, vocab_chunk // shard.ranks)
            return _VocabParallelCrossEntropy.apply(
                hidden, shard.weight, targets, shard.start, shard.group, chunk, row_chunk,
                compute,
            )  # fmt: skip
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, vocab_chunk, row_chunk,
                                          compute)  # fmt: skip
