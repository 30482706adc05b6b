"""Context-parallel forward and backward of the native model on real gloo processes.

usage: torchrun --nproc_per_node=CP context_worker.py OUT_DIR
Every rank builds the same tiny model and batch (`CASES`), takes its slice of each row and
runs the per-token losses and their backward with context parallelism; rank 0 saves, per
case, the whole rows' losses (gathered) and the gradients summed over the ranks to
OUT_DIR/CASE.pt, for the test to compare with one process (`reference`).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: conftest.py

from conftest import tiny_model  # noqa: E402

from unmask.models.transformer import DiffusionTransformer  # noqa: E402
from unmask.parallel.context import ContextShard, heads_to_seq, seq_to_heads  # noqa: E402
from unmask.parallel.mesh import end_process  # noqa: E402

LENGTH = 24
#: name -> (heads, kv heads, packed rows (doc ids), attention backend)
CASES = {
    "gqa_packed_sdpa": (4, 2, True, "sdpa"),
    "kv_repeat_packed_sdpa": (4, 1, True, "sdpa"),
    "gqa_full_sdpa": (4, 2, False, "sdpa"),
    "gqa_packed_flex": (4, 2, True, "flex"),
    "gqa_packed_varlen": (4, 2, True, "varlen"),
    "kv_repeat_packed_varlen": (4, 1, True, "varlen"),
}


def make_model(heads: int, kv_heads: int, backend: str) -> DiffusionTransformer:
    return tiny_model(vocab_size=64, intermediate_size=48, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=8,
                      attn_implementation=backend)  # fmt: skip


def make_batch(packed: bool) -> dict:
    """Two rows; packed: documents of 5, 11 and 8 tokens (one crosses the cp boundary)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, LENGTH), generator=gen)
    targets = torch.where(torch.rand(2, LENGTH, generator=gen) < 0.5, ids, -100)
    batch = {"input_ids": ids, "targets": targets}
    if packed:
        doc = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 11, 8]))
        batch["doc_ids"] = torch.stack([doc, doc.flip(0)])
    return batch


def run_case(model, batch: dict, shard: ContextShard | None) -> dict:
    """Per-token losses (B, L) of the whole rows and the gradients of their sum (none for
    flex: it has no backward on CPU)."""
    cols = slice(None) if shard is None else shard.local(LENGTH)
    model.context_parallel = shard
    backward = model.config.attn_implementation != "flex"
    with torch.set_grad_enabled(backward):
        losses = model(batch["input_ids"][:, cols], doc_ids=_cols(batch.get("doc_ids"), cols),
                       targets=batch["targets"][:, cols])  # fmt: skip
    if backward:
        losses.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if shard is not None:
        losses = shard.gather_tokens(losses.detach())
        for g in grads.values():
            dist.all_reduce(g, group=shard.group)
    return {"losses": losses.detach(), "grads": grads}


def _cols(x, cols):
    return None if x is None else x[:, cols]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    shard = ContextShard.from_mesh(mesh)
    results = {}
    for name, (heads, kv, packed, backend) in CASES.items():
        results[name] = run_case(make_model(heads, kv, backend), make_batch(packed), shard)
    # the two all-to-alls on their own: heads of every token, then back
    torch.manual_seed(2)
    whole = torch.randn(2, 4, LENGTH, 8)  # (B, H, L, D), the same on every rank
    by_heads = seq_to_heads(whole[:, :, shard.local(LENGTH)], shard)
    heads = 4 // cp
    results["seq_to_heads"] = {
        "equal": torch.equal(by_heads, whole[:, shard.rank * heads : (shard.rank + 1) * heads]),
        "round_trip": torch.equal(heads_to_seq(by_heads, shard), whole[:, :, shard.local(LENGTH)]),
    }
    flags = torch.tensor([float(v) for v in results["seq_to_heads"].values()])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    results["seq_to_heads"] = dict(zip(("equal", "round_trip"), flags.bool().tolist()))
    if shard.rank == 0:
        torch.save(results, out / f"cp{cp}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process(0)
