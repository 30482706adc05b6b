"""Cross-entropy on selected rows only, chunked over the vocabulary.

The masked-diffusion losses need logits only at masked positions. Running the LM head
on those rows alone, and never holding a (rows x vocab) float32 matrix for more than
one chunk at a time, keeps a 150k vocabulary from dominating activation memory. The
backward pass recomputes each chunk's logits instead of storing them.
"""

import torch

#: A target of -100 means "no loss here" (the masked-only loss reads only the other rows);
#: the same value torch's cross_entropy ignores by default.
IGNORE_INDEX = -100


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_chunk, row_chunk):
        # hidden (N, H), weight (V, H), targets (N,) -> loss (N,) float32
        n, v = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        for r0, r1 in _chunks(n, row_chunk):
            h = hidden[r0:r1]
            running = torch.full((r1 - r0,), float("-inf"), dtype=acc, device=hidden.device)
            for v0, v1 in _chunks(v, vocab_chunk):
                logits = (h @ weight[v0:v1].to(h.dtype).T).to(acc)
                running = torch.logaddexp(running, torch.logsumexp(logits, dim=-1))
            lse[r0:r1] = running
        target_logit = (hidden * weight[targets].to(hidden.dtype)).to(acc).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.vocab_chunk, ctx.row_chunk = vocab_chunk, row_chunk
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        grad_loss = grad_loss.to(acc)
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for r0, r1 in _chunks(hidden.shape[0], ctx.row_chunk):
            h = hidden[r0:r1]
            g_rows = grad_loss[r0:r1, None]
            for v0, v1 in _chunks(weight.shape[0], ctx.vocab_chunk):
                w = weight[v0:v1].to(h.dtype)
                probs = torch.exp((h @ w.T).to(acc) - lse[r0:r1, None]) * g_rows
                grad_hidden[r0:r1] += probs @ w.to(acc)
                grad_weight[v0:v1] += probs.T @ h.to(acc)
        grad_hidden -= grad_loss[:, None] * weight[targets].to(acc)
        grad_weight.index_add_(0, targets, -grad_loss[:, None] * hidden.to(acc))
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None


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
    (row_chunk x vocab_chunk) block instead of (N x V).
    """
    if hidden.shape[0] == 0:
        return hidden.sum(-1) * 0 + weight.sum() * 0  # keeps both in the graph
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, vocab_chunk, row_chunk)
