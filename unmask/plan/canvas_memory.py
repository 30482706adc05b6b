"""The memory walk of a canvas decoder's step: the "canvas" memory model
(plan/memory_models.py), DiffusionGemma under `uniform`.

A canvas decoder runs its stack once per pass (the encoder over the row, a decoder pass
without gradients over the canvas when self-conditioning, the decoder pass with them), so
its step is traced whole (`traced_canvas_bytes`: the objective's call under
FakeTensorMode, each layer's saves per pass and those around the layers) and walked by
`canvas_memory_terms`, which reads the prompt keys the layers keep from the shape
(`prompt_kv`). The state, the gathered units, the activation gradients' dtype and Muon's
step are plan/memory.py's, as the decoder walk counts them.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from unittest import mock

import torch

from unmask.models.build import _no_init, build_model
from unmask.models.config import ModelConfig
from unmask.models.moe import step_casts
from unmask.models.shape import ModelShape
from unmask.plan.memory import (
    GroupedMatmulShapes,
    MemoryTerms,
    StepShape,
    expert_stack_numel,
    gathered_units,
    grad_bytes_by_unit,
    muon_step_bytes,
    state_bytes,
)
from unmask.plan.shards import ShardedModel

_CANVAS_SAVES: dict[tuple, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
"""traced_canvas_bytes' results by (arch_json, rows, length, self_condition, bf16, autocast)
(the architecture's JSON names its family, so its shape)."""


def traced_canvas_bytes(family: ModelShape, arch_json: str, rows: int, length: int,
                        self_condition: bool, bf16: bool,
                        autocast: bool) -> tuple[tuple[int, ...], tuple[int, ...], int]:  # fmt: skip
    """`trace_canvas_bytes`, once per architecture and step shape (`family`: the resolved
    model's shape declaration, `ShardedModel.shape`, whose `training_call` is traced)."""
    key = (arch_json, rows, length, self_condition, bf16, autocast)
    if key not in _CANVAS_SAVES:
        _CANVAS_SAVES[key] = trace_canvas_bytes(family, *key)
    return _CANVAS_SAVES[key]


def trace_canvas_bytes(family: ModelShape, arch_json: str, rows: int, length: int,
                       self_condition: bool, bf16: bool,
                       autocast: bool) -> tuple[tuple[int, ...], tuple[int, ...], int]:  # fmt: skip
    """What one training call of a canvas decoder (the `uniform` objective's, the shape's
    `training_call`) saves for backward over `rows` rows of `length` prompt tokens and a
    canvas: (each layer's saves in the encoder pass, each layer's in the decoder pass with
    gradients, the saves outside the layers: embeddings, self-conditioning, final norm,
    the LM head on the canvas and the loss). The model's own forward under FakeTensorMode
    with saved-tensor hooks, as `traced_layer_bytes` (each storage once, parameters left
    out); the first decoder pass runs under no_grad and saves nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    arch = ModelConfig.model_validate_json(arch_json)
    with FakeTensorMode(), _no_init():
        model = build_model(arch)
        if bf16 and not autocast:  # FSDP2's mixed precision: the parameters in bfloat16
            for param in model.parameters():  # (the tied head is the embedding: once)
                param.data = param.data.to(torch.bfloat16)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        layers = list(model.model.layers)
        totals = {True: [0] * len(layers), False: [0] * len(layers)}  # encoder pass: True
        around = [0]
        where: dict = {"layer": None, "encoder": True}
        seen: set[int] = set()

        def enter(index: int):
            return lambda module, args: where.__setitem__("layer", index)

        handles = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(layers)]
        handles += [layer.register_forward_hook(lambda *a: where.__setitem__("layer", None))
                    for layer in layers]  # fmt: skip
        # the decoder's passes start at the self-conditioning (both decoder passes run it)
        handles.append(model.model.self_conditioning.register_forward_pre_hook(
            lambda module, args: where.__setitem__("encoder", False)))  # fmt: skip

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in params and key not in seen:
                seen.add(key)
                size = t.untyped_storage().nbytes()
                if where["layer"] is None:
                    around[0] += size
                else:
                    totals[where["encoder"]][where["layer"]] += size
            return t

        cast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16 and autocast
                else contextlib.nullcontext())  # fmt: skip
        args, kwargs = family.training_call(arch, rows, length, self_condition)
        # step_casts: the expert stacks' copies made once for every pass (train/step.py)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast, \
                mock.patch.object(torch, "_grouped_mm", GroupedMatmulShapes.apply), \
                step_casts():  # fmt: skip
            model(*args, **kwargs)
        for handle in handles:
            handle.remove()
    return tuple(totals[True]), tuple(totals[False]), around[0]


def canvas_saves(model: ShardedModel, shape: StepShape) -> tuple[list[int], list[int], int]:
    """(each layer's saves in the encoder pass, in the decoder pass with gradients, the saves
    around the layers) of one micro-batch on this rank: `traced_canvas_bytes` (measured),
    plus what the trace on one process cannot see (modelled): under expert parallelism the
    received rows' regrouping order and its inverse (16 k bytes a token and MoE pass, as
    `moe_mlp_bytes`), and under bf16 across ranks autocast's bfloat16 copies of this rank's
    expert stacks, which FSDP2 leaves at float32 (once a step: models/moe.py step_casts)."""
    arch = model.model_config
    sharded = model.layout.world_size > 1
    casts = shape.bf16 and not sharded  # one process: autocast over float32 masters
    encoder, decoder, around = traced_canvas_bytes(model.shape, arch.model_dump_json(), shape.rows,
                                                   shape.length, shape.self_condition,
                                                   shape.bf16, casts)  # fmt: skip
    encoder, decoder = list(encoder), list(decoder)
    if any(s.expert_parallel for s in model.shards):
        per_pass = 16 * arch.num_experts_per_tok
        copies = 2 * expert_stack_numel(model) if shape.bf16 and sharded else 0
        for index in range(len(decoder)):  # copies made once a step (models/moe.py
            if index < len(encoder) - 1:  # step_casts): at a layer's first pass; the
                encoder[index] += per_pass * shape.rows * shape.length + copies
                decoder[index] += per_pass * shape.rows * shape.canvas
            else:  # encoder's last layer runs no MLP
                decoder[index] += per_pass * shape.rows * shape.canvas + copies
    return encoder, decoder, around


def canvas_gradient_bytes(model: ShardedModel, shape: StepShape, tokens: int) -> int:
    """Activation gradients alive at once in one layer's backward over `tokens` tokens (a
    pass's), in the matmul dtype: the residual's (h) beside the widest MLP step: the
    experts' (`activation_gradient_bytes`'s k x max(3 h, h + 4 I_moe)) or the dense MLP's
    gate, up, product and GELU (4 I)."""
    arch = model.model_config
    b = 2 if shape.bf16 else 4
    h, k, inner = arch.hidden_size, arch.num_experts_per_tok, arch.resolved_moe_intermediate_size
    width = max(k * max(3 * h, h + 4 * inner), 4 * arch.intermediate_size)
    return tokens * (width + h) * b


def prompt_kv_gradient_bytes(model: ShardedModel, shape: StepShape) -> list[int]:
    """Per layer: the gradients of the prompt keys and values the decoder's backward makes
    for the encoder's (the kept ones: the whole row on full layers, the last
    sliding_window - 1 tokens on sliding ones), held until the encoder's backward reads
    them; in the matmul dtype."""
    arch = model.model_config
    b = 2 if shape.bf16 else 4
    out = []
    for index in range(arch.num_hidden_layers):
        kept, kv_heads, head_dim = model.shape.prompt_kv(arch, index, shape.length)
        out.append(2 * shape.rows * kept * kv_heads * head_dim * b)
    return out


def canvas_memory_terms(model: ShardedModel, shape: StepShape) -> MemoryTerms:
    """The memory walk of a canvas decoder's step (models/shape.py DiffusionGemmaShape: the
    encoder over the row, a decoder pass without gradients over the canvas when
    self-conditioning, the decoder with gradients, the LM head on the canvas over the whole
    vocabulary in float32). The saves are `canvas_saves`'s; the walk, on top of the
    parameters and the optimizer state, takes the most of:

    - the first decoder pass: the encoder's saves, its float32 logits (B, C, V; `F` below)
      becoming the capped logits (three at once);
    - the forward's end: every save, the first pass's logits (the signal, held by the
      forward until it returns), two more F as the second pass's logits are capped and the
      loss is made, the root gathered (and under accumulation every unit's unsharded
      float32 gradient);
    - the head's backward: every save, two F of logit gradients, the root gathered with
      its unsharded float32 gradient (the tied embedding's);
    - the decoder's backward of layer i (last to first), then the encoder's: the saves
      below it (the encoder's whole while the decoder's backward runs), the layer's
      activation gradients (`canvas_gradient_bytes`), the prompt keys' and values'
      gradients made so far (`prompt_kv_gradient_bytes`), and FSDP2's units as in
      `decoder_memory_terms` (this layer gathered with its unsharded float32 gradient and its
      expert stacks' gradients, the next one prefetched, the sharded gradients made);
    - the optimizer step: every gradient and Muon's buffers.

    Without self-conditioning the self-conditioning MLP gets no gradient (no signal runs
    through it), so it has neither gradients nor optimizer state (both made lazily). No
    checkpointing (the family's layers do not recompute), no pipeline."""
    arch = model.model_config
    if not shape.self_condition:
        unused = "model.self_conditioning."
        model = replace(model, shards=[replace(s, optimizer="frozen") if s.name.startswith(unused)
                                       else s for s in model.shards])  # fmt: skip
    params, grads, optim = state_bytes(model)
    encoder, decoder, around = canvas_saves(model, shape)
    saved = sum(encoder) + sum(decoder) + around
    b = 2 if shape.bf16 else 4
    logits = shape.rows * shape.canvas * arch.vocab_size * 4  # one float32 (B, C, V)
    signal = logits if shape.self_condition else 0
    gathered = gathered_units(model, shape)
    root = gathered.pop("root", 0)
    fsdp = bool(gathered)
    names = [f"layer {index}" for index in model.layer_indices]
    layer_grad = grad_bytes_by_unit(model)
    expert_grad = grad_bytes_by_unit(model, experts_only=True)
    accumulated = 0
    if shape.micro_batches > 1 and fsdp:
        accumulated = (sum(gathered.values()) + root) // b * 4
    root_grad = (root // b * 4 if not accumulated else 0) if fsdp else layer_grad.get("root", 0)
    first_pass = sum(encoder) + root + accumulated + (3 * logits if signal else 0)
    forward_end = saved + signal + 2 * logits + root + accumulated
    head_backward = saved + 2 * logits + root + root_grad + accumulated
    kv_grads = prompt_kv_gradient_bytes(model, shape)
    rows_canvas, rows_prompt = shape.rows * shape.canvas, shape.rows * shape.length
    worst_backward = 0
    layer_grads = [layer_grad.get(name, 0) for name in names]
    for encoder_pass in (False, True):
        for i in range(len(names) - 1, -1, -1):
            if encoder_pass:
                below = sum(encoder[: i + 1]) + sum(kv_grads[: i + 1])
                done = sum(layer_grads)  # every layer's gradient made in the decoder's pass
                act = canvas_gradient_bytes(model, shape, rows_prompt)
            else:
                below = sum(encoder) + sum(decoder[: i + 1]) + sum(kv_grads[i:])
                done = sum(layer_grads[i + 1 :])
                act = canvas_gradient_bytes(model, shape, rows_canvas)
            live = below + act + root + root_grad + accumulated
            if fsdp:
                this = gathered.get(names[i], 0)
                prefetched = gathered.get(names[i - 1], 0) if i > 0 else 0
                fresh = 0 if accumulated else this // b * 4
                live += this + prefetched + fresh + expert_grad.get(names[i], 0) + done
            else:  # .grad of the layers done so far, and this one's
                live += done + (layer_grads[i] if not encoder_pass else 0)
            worst_backward = max(worst_backward, live)
    muon = muon_step_bytes(model, shape)
    optimizer_step = grads + muon
    live_peak = max(first_pass, forward_end, head_backward, worst_backward, optimizer_step)
    working = live_peak - saved if live_peak > saved else 0
    experts = sum(state_bytes(model, experts_only=True))
    expert_working = 0
    if optimizer_step == live_peak:
        expert_working = muon - muon_step_bytes(model, shape, experts=False)
    return MemoryTerms(params, grads, optim, round(saved), round(working),
                       round(params + optim + live_peak), experts, expert_working)  # fmt: skip
