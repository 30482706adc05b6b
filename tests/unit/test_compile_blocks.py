"""torch.compile of whole decoder blocks (parallel/fsdp.py compile_blocks, fullgraph=True):
dense and MoE blocks, with and without activation checkpointing, trace to whole graphs (no
graph break) and compile once over 20 training steps whose masked counts and packed
document layouts differ (no recompile after the first step); the MoE block's load counts
once per forward, its recomputation in backward left out. aot_eager: the graphs dynamo
captures, without a C++ compiler's minutes (what the CPU can check; a GPU runs inductor).
Under bf16 autocast, the trainer's GPU setting (the grouped GEMM's meta function takes bf16
inputs only)."""

import pytest
import torch
import torch._dynamo
from conftest import tiny_model
from torch._dynamo.utils import counters

from unmask.models.moe import moe_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = {"model_type": "llada_moe", "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32}  # fmt: skip


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ac", "full-ac"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_compiled_blocks_are_whole_graphs_that_compile_once(kind, checkpointing):
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(0, attn_implementation="sdpa", **(MOE if kind == "moe" else {})).train()
    model.gradient_checkpointing = checkpointing
    for layer in model.model.layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    graphs = []
    for _ in range(20):
        ids = torch.randint(0, 100, (2, 24), generator=g)
        docs = torch.zeros(2, 24, dtype=torch.long)
        docs[:, int(torch.randint(1, 23, (1,), generator=g)) :] = 1  # a packed row's cut
        share = float(torch.rand(1, generator=g))  # masked counts differ step to step
        targets = torch.where(torch.rand(2, 24, generator=g) < share, ids, -100)
        weights = torch.rand(2, 24, generator=g)
        for block in moe_blocks(model):
            block.load.zero_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, doc_ids=docs, targets=targets, target_weights=weights)
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
        for block in moe_blocks(model):  # counted once, recomputation or not
            assert block.load.sum().item() == 2 * 24 * MOE["num_experts_per_tok"]
    assert not counters["graph_break"], dict(counters["graph_break"])
    expected = 2 if (kind == "moe" and checkpointing) else 1  # + the recomputation's graph
    assert graphs[0] == graphs[-1] == expected, graphs
