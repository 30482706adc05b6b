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
"""

import torch

#: A target of -100 means "no loss here" (the masked-only loss reads only the other rows);
#: the same value torch's cross_entropy ignores by default.
IGNORE_INDEX = -100


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _block(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous (rows, cols) view of the front of a flat buffer."""
    return buffer[: rows * cols].view(rows, cols)


def _logits_into(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out = h @ w.T in h's dtype, stored in out's (float32) dtype. h (R, H), w (C, H)."""
    w = w.to(h.dtype)
    if h.dtype == out.dtype:
        return torch.mm(h, w.T, out=out)
    return out.copy_(h @ w.T)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """out = a @ b when first, else out += a @ b; no temporary of out's size."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_chunk, row_chunk):
        # hidden (N, H), weight (V, H), targets (N,) -> loss (N,) float32
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        buffer = hidden.new_empty(min(n, row_chunk) * min(v, vocab_chunk), dtype=acc)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        for r0, r1 in _chunks(n, row_chunk):
            h = hidden[r0:r1]
            # online logsumexp over vocabulary chunks: running max and sum of exp(x - max)
            run_max = torch.full((r1 - r0,), float("-inf"), dtype=acc, device=hidden.device)
            run_sum = torch.zeros(r1 - r0, dtype=acc, device=hidden.device)
            for v0, v1 in _chunks(v, vocab_chunk):
                logits = _logits_into(_block(buffer, r1 - r0, v1 - v0), h, weight[v0:v1])
                new_max = torch.maximum(run_max, logits.amax(dim=1))
                run_sum.mul_(torch.exp(run_max - new_max))
                run_sum.add_(logits.sub_(new_max[:, None]).exp_().sum(dim=1))
                run_max = new_max
            lse[r0:r1] = run_max + run_sum.log()
        target_logit = (hidden * weight[targets].to(hidden.dtype)).to(acc).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.vocab_chunk, ctx.row_chunk = vocab_chunk, row_chunk
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss_i / d logits_ij = softmax_ij - [j == target_i]; both grads come out of
        # one (rows x chunk) block per chunk, the target's -1 folded into it
        hidden, weight, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        n, v = hidden.shape[0], weight.shape[0]
        want_weight = ctx.needs_input_grad[1]  # False for a frozen head (LoRA): a third less
        grad_loss = grad_loss.to(acc)
        grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
        grad_weight = None
        if want_weight:
            grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device)
        buffer = hidden.new_empty(min(n, ctx.row_chunk) * min(v, ctx.vocab_chunk), dtype=acc)
        for r0, r1 in _chunks(n, ctx.row_chunk):
            h = hidden[r0:r1]
            h_acc = h.to(acc)
            g_rows = grad_loss[r0:r1, None]
            t_rows = targets[r0:r1]
            for v0, v1 in _chunks(v, ctx.vocab_chunk):
                w = weight[v0:v1]
                probs = _logits_into(_block(buffer, r1 - r0, v1 - v0), h, w)
                probs.sub_(lse[r0:r1, None]).exp_().mul_(g_rows)
                hit = (t_rows >= v0) & (t_rows < v1)  # a mask, not indices: no host sync
                cols = (t_rows - v0).clamp_(0, v1 - v0 - 1)[:, None]
                probs.scatter_add_(1, cols, torch.where(hit[:, None], -g_rows, 0.0))
                _mm_into(grad_hidden[r0:r1], probs, w.to(acc), first=v0 == 0)
                if want_weight:
                    _mm_into(grad_weight[v0:v1], probs.T, h_acc, first=r0 == 0)
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None


class _WeightedCrossEntropy(torch.autograd.Function):
    """sum_i c_i CE_i with both gradients computed in the forward (the output is a scalar,
    so the backward only scales them by the incoming gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, coef, block_rows):
        # hidden (N, H), weight (V, H), targets (N,), coef (N,) -> 0-d float32
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = grad_weight = None
        if want_hidden:
            grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
        if want_weight:
            grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device)
        w_acc = weight.to(acc)
        buffer = hidden.new_empty(min(n, block_rows) * v, dtype=acc)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for r0, r1 in _chunks(n, block_rows):
            h = hidden[r0:r1]
            t_rows = targets[r0:r1, None]
            c = coef[r0:r1].to(acc)
            logits = _logits_into(_block(buffer, r1 - r0, v), h, weight)  # (R, V)
            row_max = logits.amax(dim=1)
            target_logit = logits.gather(1, t_rows).squeeze(1)
            probs = logits.sub_(row_max[:, None]).exp_()  # unnormalized, in place
            sums = probs.sum(dim=1)
            total += (c * (row_max + sums.log() - target_logit)).sum()
            # d (c_i CE_i) / d logits_ij = c_i (softmax_ij - [j == target_i])
            probs.mul_((c / sums)[:, None]).scatter_add_(1, t_rows, -c[:, None])
            if want_hidden:
                torch.mm(probs, w_acc, out=grad_hidden[r0:r1])
            if want_weight:
                _mm_into(grad_weight, probs.T, h.to(acc), first=r0 == 0)
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
        return grad_hidden, grad_weight, None, None, None


def weighted_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    vocab_chunk: int = 8192,
    row_chunk: int = 4096,
) -> torch.Tensor:
    """sum_i coef_i * CE_i, 0-d float32: `(coef * chunked_cross_entropy(...)).sum()` with
    one pass over the LM head fewer when gradients are wanted (both are computed in the
    forward; tests/unit/test_loss.py pins them to the plain path). coef (N,) carries no
    gradient. Rows are taken `row_chunk * vocab_chunk // V` at a time (at least one), so
    the block holds as many elements as chunked_cross_entropy's.
    """
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if hidden.shape[0] == 0 or not needs_grad:
        losses = chunked_cross_entropy(hidden, weight, targets, vocab_chunk, row_chunk)
        return (losses * coef.detach().to(losses.dtype)).sum()
    block_rows = max(1, (row_chunk * vocab_chunk) // weight.shape[0])
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _WeightedCrossEntropy.apply(hidden, weight, targets, coef.detach(), block_rows)


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
    """
    if hidden.shape[0] == 0:
        return hidden.sum(-1) * 0 + weight.sum() * 0  # keeps both in the graph
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, vocab_chunk, row_chunk)
