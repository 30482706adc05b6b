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


SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA = {"model_type": "diffusion_gemma", "num_hidden_layers": 4, "head_dim": 16,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "diffusion_gemma": {"sliding_window": 8, "canvas_length": 4,
                             "layer_types": [SLIDING, FULL, SLIDING, FULL]}}  # fmt: skip
"""A tiny DiffusionGemma with both kinds of layer in the encoder's non-last layers."""


def gemma_call(model, g: torch.Generator, rows: int, length: int, grad: bool = True):
    """One `uniform` call (models/diffusion_gemma.py forward) under bf16 autocast: left
    padding, positions, self-conditioning rows and scored positions drawn per call."""
    prompt = torch.randint(4, 100, (rows, length), generator=g)
    canvas = torch.randint(4, 100, (rows, 4), generator=g)
    real = torch.arange(length) >= torch.randint(0, length - 2, (rows, 1), generator=g)
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    targets = torch.where(torch.rand(rows, 4, generator=g) < 0.7, canvas, -100)
    condition = torch.rand(rows, generator=g) < 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        return model(prompt, canvas, prompt_mask=real, position_ids=positions,
                     canvas_position_ids=positions[:, -1:] + 1 + torch.arange(4),
                     self_condition=condition, targets=targets,
                     target_weights=(targets != -100).float())  # fmt: skip


def test_compiled_diffusion_gemma_layers_are_whole_graphs_equal_to_eager(request):
    """Each layer compiled as the trainer does (train.torch_compile: fullgraph, the
    recompile limit raised to `compiled_layer_graphs`): no graph break; over 6 training
    steps at the trainer's fixed row length (rows of data.packing_length tokens, canvases
    of canvas_length) whose padding, self-conditioning rows and scored positions differ, no
    graph after the first step (7 graphs: the encoder's sliding and full layers and its
    keys-only last layer with gradients, the decoder's two kinds with and without);
    evaluation (no gradients, other batch sizes) and rows of other lengths add graphs, then
    none. The experts run the grouped GEMM (`auto`: the loop path reads each expert's count
    to the host, a graph break). Losses equal eager's (measured bit for bit; bounded by
    1e-6 relative); gradients within 5e-3 of each parameter's gradient norm: the compiled
    backward rounds its bf16 intermediates elsewhere than eager's (measured at most 2.1e-3
    over 10 steps, below bf16's 2^-8 = 3.9e-3)."""
    torch._dynamo.reset()
    counters.clear()
    eager = tiny_model(0, attn_implementation="sdpa", **GEMMA).train()
    compiled = tiny_model(0, attn_implementation="sdpa", **GEMMA).train()
    limit = compiled.compiled_layer_graphs()
    patch = torch._dynamo.config.patch(recompile_limit=limit)  # as the trainer sets it
    patch.__enter__()
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    for layer in compiled.model.layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    graphs = []
    for step in range(6):
        losses = []
        for model in (eager, compiled):
            loss = gemma_call(model, torch.Generator().manual_seed(step), 8, 20)
            loss.backward()
            losses.append(loss.detach())
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch.allclose(losses[1], losses[0], rtol=1e-6, atol=0), step
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:  # bf16 rounding: within 2^-8 of each gradient's norm
                error = (b.grad - a.grad).norm() / a.grad.norm().clamp(min=1e-12)
                assert error <= 5e-3, (step, name, error.item())
        eager.zero_grad(set_to_none=True)
        compiled.zero_grad(set_to_none=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] == graphs[-1] == 7, graphs
    compiled.eval()
    g = torch.Generator().manual_seed(100)
    for rows in (16, 5):  # evaluation: other batch sizes, no gradients
        gemma_call(compiled, g, rows, 20, grad=False)
    compiled.train()
    for length in (12, 16):  # rows of other lengths
        gemma_call(compiled, g, 8, length).backward()
    settled = counters["stats"]["unique_graphs"]
    for length in (13, 10, 20):
        gemma_call(compiled, g, 8, length).backward()
    assert counters["stats"]["unique_graphs"] == settled <= limit, (settled, limit)
    assert not counters["graph_break"], dict(counters["graph_break"])


@torch._dynamo.config.patch(recompile_limit=8)  # restored afterwards
def test_the_trainer_compiles_diffusion_gemma_layers_whole(tmp_path):
    """train.torch_compile on a diffusion_gemma: every layer compiled (its dense sdpa masks
    trace whole, whatever attn_implementation), the recompile limit raised to the
    family's bound (nothing is traced before the first step)."""
    import yaml
    from conftest import TINY, deep_update

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    tree = deep_update(TINY, {"model": GEMMA, "diffusion": {"objective": "uniform"},
                              "train": {"torch_compile": True,
                                        "output_dir": str(tmp_path / "run")}})  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
    trainer = Trainer(load_config(tmp_path / "run.yaml"))
    layers = list(trainer.model.model.layers)
    assert len(layers) == 4 and all(layer._compiled_call_impl is not None for layer in layers)
    assert torch._dynamo.config.recompile_limit == trainer.model.compiled_layer_graphs() == 20
