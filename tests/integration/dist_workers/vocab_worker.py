"""Run under torchrun (gloo, CPU): the vocab-parallel LM head against the replicated one,
and sequence parallelism against plain tensor parallelism.

A tiny decoder is split over a 1-D tp mesh of every rank twice from the same weights: with
its embedding and LM head split by vocabulary rows (the default) and with them replicated.
For each case (untied or tied embeddings, a vocabulary tp divides or not) the per-token
losses (`targets`), the weighted loss sum (`target_weights`: the fused path the trainer's
objectives take) and the logits are compared, and so is every parameter's gradient
(gathered whole). Then the same comparisons for sequence parallelism (norms and residual
stream sharded over the sequence) against plain TP, with rows of a length tp divides and
one it does not (padded). Rank 0 writes {case: {quantity: relative difference (`rel`, `rel_norm`)}}
and the local head rows per rank to OUT.json.

usage: torchrun --nproc_per_node=2 vocab_worker.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: conftest.py

from conftest import tiny_model  # noqa: E402

from unmask.parallel.dims import ParallelDims  # noqa: E402
from unmask.parallel.mesh import end_process  # noqa: E402
from unmask.parallel.tensor import apply_tensor_parallel  # noqa: E402

#: 4 query and 4 key/value heads: tp 2 and 4 split them
CASES = {
    "untied": {"vocab_size": 128},
    "tied": {"vocab_size": 128, "tie_word_embeddings": True},
    "uneven vocab": {"vocab_size": 131},
}


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((whole(got) - want).abs().max() / want.abs().max()).item()


def rel_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (a gradient's relative error, as the families test)."""
    return ((whole(got) - want).norm() / want.norm()).item()


def compare(fields: dict, mesh, vocab_chunk: int, length: int = 16,
            against: dict | None = None, split: dict | None = None) -> dict:  # fmt: skip
    """The model split with `split` (apply_tensor_parallel's keywords; default: the
    vocab-parallel head) against the one split with `against` (default: the replicated
    head), on rows of `length` tokens."""
    fields = {"num_key_value_heads": 4, "num_attention_heads": 4, **fields}
    styles = {True: split or {}, False: {"vocab_parallel": False} if against is None else against}
    models = {vp: apply_tensor_parallel(tiny_model(seed=3, **fields), mesh, **style)
              for vp, style in styles.items()}  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    vocab = fields["vocab_size"]
    ids = torch.randint(0, vocab, (3, length), generator=gen)
    targets = torch.where(torch.rand(3, length, generator=gen) < 0.5, ids, -100)
    weights = torch.rand(3, length, generator=gen)
    doc_ids = torch.tensor([[0] * 6 + [1] * (length - 6), [0] * length,
                            [0] * 9 + [1] * (length - 9)])  # fmt: skip
    out = {}
    grads = {}
    for vp, model in models.items():
        losses = model(ids, doc_ids, targets=targets, vocab_chunk=vocab_chunk)
        losses.sum().backward()
        first = {n: whole(p.grad).clone() for n, p in model.named_parameters()}
        model.zero_grad()
        total = model(ids, doc_ids, targets=targets, target_weights=weights,
                      vocab_chunk=vocab_chunk)  # fmt: skip
        total.backward()
        second = {n: whole(p.grad).clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            logits = model(ids, doc_ids)
        grads[vp] = (losses.detach(), first, total.detach(), second, logits)
    (l1, g1, t1, w1, z1), (l0, g0, t0, w0, z0) = grads[True], grads[False]
    out["token losses"] = rel(l1, l0)
    out["weighted sum"] = rel(t1, t0)
    out["logits"] = rel(z1, z0)
    out["token-loss gradients"] = max(rel_norm(g1[n], g0[n]) for n in g0)
    out["weighted gradients"] = max(rel_norm(w1[n], w0[n]) for n in w0)
    out["gradients, max abs"] = max(rel(g[n], h[n]) for g, h in ((g1, g0), (w1, w0)) for n in g0)
    out["parameters"] = sorted(g0) == sorted(g1)
    head = models[True].lm_head.weight
    out["head rows per rank"] = head.to_local().shape[0]
    out["head is a DTensor"] = type(head).__name__ == "DTensor"
    out["tied"] = head is models[True].model.embed_tokens.weight
    return out


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = ParallelDims(tp=dist.get_world_size()).build_mesh(torch.device("cpu"))["tp"]
    results = {}
    for case, fields in CASES.items():
        # vocab_chunk 16: several vocabulary chunks per rank (the online log-sum-exp)
        results[case] = compare(fields, mesh, vocab_chunk=16)
    # sequence parallelism against plain TP (both vocab-parallel): rows of 16 tokens, and
    # of 15 (padded to 16 inside the model)
    for length in (16, 15):
        results[f"sequence parallel, {length} tokens"] = compare(
            {"vocab_size": 128, "qk_norm": True}, mesh, 16, length, against={},
            split={"sequence_parallel": True})  # fmt: skip
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {c: r.pop("head rows per rank") for c, r in results.items()})
    if dist.get_rank() == 0:
        for case in results:
            results[case]["head rows per rank"] = [r[case] for r in rows]
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process(0)
