"""Peak memory of the masked-only chunked loss vs. the naive full-logits loss (CPU).

Both compute sum over masked tokens of -log softmax(h W^T)[target] and its gradients
w.r.t. the hidden states and the LM head, one forward + backward each, in one run:

  naive:  logits = h @ W^T for all B*L rows, (B, L, V) float32, then
          F.cross_entropy(..., ignore_index=-100, reduction="sum").
  masked: chunked_cross_entropy(h[masked], W, targets[masked]) summed: the LM head runs
          on masked rows only, one (row_chunk x vocab_chunk) block at a time, and the
          backward recomputes each block instead of storing logits.
  fused:  weighted_cross_entropy(h[masked], W, targets[masked], ones), what the trainer
          runs: both gradients computed in the forward, one (rows x V) block of as many
          elements per row chunk, the head's logits computed once instead of twice.

How peak memory is measured: torch.profiler with profile_memory=True records every
allocation and free made by PyTorch's CPU allocator while it runs (including the
autograd engine's buffers in backward), each with the allocator's running total. The
peak is the maximum of that running total, relative to the start of the measurement
(inputs and weights allocated before are not counted; gradients of them are). This is
tensor memory, not process RSS, so it is not blurred by the Python heap or by freed
pages the OS has not taken back.

Run: python benchmarks/masked_loss_memory.py   (writes benchmarks/results/masked_loss_memory.md)
     python benchmarks/masked_loss_memory.py --quick   (small sizes; prints, writes nothing)
"""

import argparse
import time

import torch
import torch.nn.functional as F
from common import RESULTS, publish
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from unmask.diffusion.loss import chunked_cross_entropy, weighted_cross_entropy

REPORT = RESULTS / "masked_loss_memory.md"


def naive_loss(hidden, weight, targets):
    logits = hidden @ weight.T  # (B, L, V)
    return F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )


def masked_loss(hidden, weight, targets, vocab_chunk=8192, row_chunk=4096):
    sel = targets != -100
    return chunked_cross_entropy(hidden[sel], weight, targets[sel], vocab_chunk, row_chunk).sum()


def fused_loss(hidden, weight, targets, vocab_chunk=8192, row_chunk=4096):
    sel = targets != -100
    ones = torch.ones(int(sel.sum()))
    return weighted_cross_entropy(hidden[sel], weight, targets[sel], ones, vocab_chunk, row_chunk)


def _allocations(node, out):
    if node.tag == _EventType.Allocation:
        out.append((node.start_time_ns, node.extra_fields.alloc_size))
    for child in node.children:
        _allocations(child, out)


def peak_bytes(fn) -> tuple[int, float, object]:
    """(peak tensor bytes allocated while fn runs, seconds, fn's result)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    events = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        _allocations(root, events)
    total = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        total += size
        peak = max(peak, total)
    return peak, seconds, result


def forward_backward(loss_fn, hidden, weight, targets):
    def run():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        loss = loss_fn(h, w, targets)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    return run


def measure(batch, length, vocab, hidden_size, mask_frac, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    masked = torch.rand(batch, length, generator=g) < mask_frac
    targets = torch.where(masked, ids, torch.full_like(ids, -100))
    naive_peak, naive_s, (naive_l, naive_gh, naive_gw) = peak_bytes(
        forward_backward(naive_loss, hidden, weight, targets)
    )
    chunk_peak, chunk_s, (chunk_l, chunk_gh, chunk_gw) = peak_bytes(
        forward_backward(masked_loss, hidden, weight, targets)
    )
    fused_peak, fused_s, (fused_l, fused_gh, fused_gw) = peak_bytes(
        forward_backward(fused_loss, hidden, weight, targets)
    )
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return {
        "shape": f"{batch}x{length}, V={vocab}, H={hidden_size}",
        "masked": int(masked.sum()),
        "naive_mib": naive_peak / 2**20,
        "chunked_mib": chunk_peak / 2**20,
        "ratio": naive_peak / chunk_peak,
        "naive_s": naive_s,
        "chunked_s": chunk_s,
        "fused_mib": fused_peak / 2**20,
        "fused_ratio": naive_peak / fused_peak,
        "fused_s": fused_s,
        "loss_rel": max(abs(float(x - naive_l)) / abs(float(naive_l)) for x in (chunk_l, fused_l)),
        "grad_rel": max(
            rel(chunk_gh, naive_gh),
            rel(chunk_gw, naive_gw),
            rel(fused_gh, naive_gh),
            rel(fused_gw, naive_gw),
        ),  # fmt: skip
    }


def table(rows) -> str:
    head = (
        "| shape (B x L, V, H) | masked tokens | naive peak MiB | masked-only peak MiB | "
        "ratio naive/masked | fused peak MiB | ratio naive/fused | naive s | masked s | "
        "fused s | loss rel. diff | grad max rel. diff |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['shape']} | {r['masked']} | {r['naive_mib']:.1f} | {r['chunked_mib']:.1f} | "
        f"{r['ratio']:.1f}x | {r['fused_mib']:.1f} | {r['fused_ratio']:.1f}x | "
        f"{r['naive_s']:.2f} | {r['chunked_s']:.2f} | {r['fused_s']:.2f} | "
        f"{r['loss_rel']:.1e} | {r['grad_rel']:.1e} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 50000])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mask-frac", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 x 256 tokens, vocab 8000; writes no results file")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.batch, args.length, args.vocab = 2, 256, [8000]
    torch.manual_seed(0)
    rows = [measure(args.batch, args.length, v, args.hidden, args.mask_frac) for v in args.vocab]
    for r in rows:
        assert r["loss_rel"] < 1e-4 and r["grad_rel"] < 1e-4, f"losses disagree: {r}"
    method = (
        "Peak = max running total of PyTorch CPU allocator bytes recorded by "
        "torch.profiler(profile_memory=True) during one forward+backward, relative to the "
        "start (inputs and weights excluded, their gradients included). Masked-only uses "
        "chunked_cross_entropy with vocab_chunk=8192, row_chunk=4096 (the defaults); fused "
        "is weighted_cross_entropy (gradients in the forward; what the trainer runs) with "
        "the same settings. Times are one run each, on a shared machine: indicative only "
        "(benchmarks/train_step.py times whole steps). "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32."
    )
    text = (
        "# Masked-only chunked loss vs. full-logits loss: peak CPU memory\n\n"
        f"{table(rows)}\n{method}\n"
    )
    publish(text, None if args.quick else REPORT)


if __name__ == "__main__":
    main()
