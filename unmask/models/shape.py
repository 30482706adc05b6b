"""A family's shape: the one declaration of its block that parallelism, the planner and the
FLOP count read, so that none of them spells out a family's module names or formulas.

Each `Family` (models/families.py) carries a `ModelShape`. What reads it:

- tensor parallelism (parallel/tensor.py) splits each layer by `TensorPlan`: which linears
  are column- and row-parallel, which modules' first input enters replicated, the per-head
  norms, the norms sequence parallelism shards, and the architecture fields the degree must
  divide;
- the pipeline (parallel/pipeline_plan.py) cuts the layers by `layer_matmul_params` and
  `attention_width` (`layer_costs`) and runs each stage through the model's own
  `hidden_states` over the stage's layers (`StagedModel`, no copy of the forward);
- the MFU (train/mfu.py) counts the attention term with `attention_width`;
- the memory model (plan/memory_models.py) is the walk the shape names (`memory_model`): the
  decoder's uses its formulas for the decoder block (`activation_formula` True) and otherwise
  measures what a layer saves for backward by running the model on the meta device (no
  storage, no compute); a canvas decoder's (DiffusionGemma) reads `prompt_kv`; a family
  from another package may register its own.

The model a family builds (models/build.py `register_family`) keeps the layout these paths
name: the layers at `model.layers`, the embedding at `model.embed_tokens`, the final norm at
`model.norm`, the head at `lm_head` (HF's layout, which every native family has).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class TensorPlan:
    """How tensor parallelism splits one layer (names relative to the layer), Megatron's
    way: column-parallel linears split their outputs, row-parallel ones their inputs (their
    outputs summed over the tp ranks); each module in `inputs` takes its first positional
    input (the hidden states) as one replicated DTensor, so the gradients of the linears
    that read it are summed once per module (the value: how many positional inputs the
    module's forward takes)."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    inputs: Mapping[str, int]
    per_head_norms: tuple[str, ...] = ()
    """Norms over each head's features (B, L, heads, head_dim) that see a rank's heads."""
    sequence_norms: tuple[str, ...] = ()
    """The norms sequence parallelism runs on each rank's share of the tokens."""
    divides: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads",
                                "intermediate_size")  # fmt: skip
    """Architecture (ModelConfig) fields the tp degree must divide; a dotted name is a field
    of a sub-section (``diffusion_gemma.num_global_key_value_heads``), and a None value (a
    field that defaults to another, listed too) is not checked."""
    vocab_parallel: bool = True
    """The embedding and LM head split by vocabulary rows (parallel/tensor.py
    `shard_vocabulary`); False keeps them replicated on the tp ranks."""
    replicated_experts: bool = False
    """The layers' routers and expert stacks stay whole on every tp rank (each rank routes
    the same replicated hidden states and runs every expert on them; FSDP2 shards them over
    the data-parallel ranks), so an MoE family with this plan runs under tensor parallelism
    without expert parallelism (parallel/expert.py `check_moe_request`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))


NATIVE_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""LoRA's "all-linear" on the native decoder: every linear layer of its blocks (the LM head
stays frozen: the masked-only loss reads its weight directly)."""


@dataclass(frozen=True)
class ModelShape:
    """The declaration of a family's blocks (module docstring). `tensor` None: the family
    cannot be split by tensor parallelism (a transformers encoder); `staged` False: it has
    no `StagedModel` forward, so no pipeline; `activation_formula`: plan/memory.py's
    formulas describe its layers (the decoder block of models/transformer.py), else the
    planner measures them on the meta device; `trains` False: no objective drives its
    forward yet (it loads, saves and computes logits), so `unmask train` and `unmask plan`
    refuse it in one line; `plans` False: `unmask plan` (and `activation_checkpointing:
    auto`, which asks the planner) cannot model its step yet and refuses it in one line;
    `canvas_decoder` True: a prompt encoder and a canvas decoder without a [MASK] token
    (DiffusionGemma), trained only by objectives that say so (diffusion/registry.py
    `ObjectiveSpec.canvas_decoder`: `uniform`), and those train no other family;
    `recompute` False: its layers do not recompute under activation checkpointing (the
    trainer refuses it, `auto` and the planner choose none); `lora_linear`: the modules
    LoRA's "all-linear" adapts (a tuple of module names, or one regex over full module
    names, as peft reads them; "all-linear": transformers' own choice)."""

    name: str
    tensor: TensorPlan | None = None
    staged: bool = True
    activation_formula: bool = False
    trains: bool = True
    plans: bool = True
    canvas_decoder: bool = False
    recompute: bool = True
    lora_linear: str | tuple[str, ...] = NATIVE_LINEAR
    memory_model: str = "decoder"
    """The walk `unmask plan` prices its training step's memory with, by name
    (plan/memory_models.py `MEMORY_MODELS`): "decoder" (a stack of layers over each
    micro-batch: the formulas, or the layers' traced saves), "canvas" (an encoder pass and
    decoder passes over a canvas); a family from another package registers its own walk
    (plan/memory_models.py `register_memory_model`) and names it here, with no edit of plan/."""

    def canvas_length(self, arch) -> int:
        """Tokens of the canvas a canvas decoder's passes run over (`canvas_decoder`), which
        the planner's step reads; 0 for a family without one."""
        return 0

    def attention_width(self, arch) -> int:
        """Query heads x head dim: the width of the attention scores' matmuls."""
        return arch.num_attention_heads * arch.resolved_head_dim

    def attention_params(self, arch) -> int:
        """Weights of one layer's q, k, v and o projections."""
        kv = arch.num_key_value_heads * arch.resolved_head_dim
        return 2 * arch.hidden_size * self.attention_width(arch) + 2 * arch.hidden_size * kv

    def mlp_params(self, arch, index: int) -> int:
        """Matmul weights one token uses in layer `index`'s MLP: a gated MLP's 3 h I, or an
        MoE layer's router, top-k experts and shared experts."""
        hidden = arch.hidden_size
        if arch.num_experts and arch.is_moe_layer(index):
            inner = arch.resolved_moe_intermediate_size
            return (arch.num_experts * hidden + arch.num_experts_per_tok * 3 * inner * hidden
                    + 3 * hidden * inner * arch.num_shared_experts)  # fmt: skip
        return 3 * hidden * arch.intermediate_size

    def call_flops(self, flops, arch, args: tuple, kwargs: dict, context: int = 1):
        """Model FLOPs (forward + backward) of one training call of the model with `args` /
        `kwargs`, counted with `flops` (train/mfu.py FlopModel) and `arch` (the model's
        ModelConfig): the decoder's call,
        `model(input_ids (B, L), ..., targets=)`, its LM head on the target rows (every
        token without targets). `context`: the context-parallel degree (a call's rows are
        its slice of each row, which attends over the whole row)."""
        ids = args[0] if args else kwargs["input_ids"]
        rows, length = ids.shape[0], ids.shape[1]
        targets = kwargs.get("targets")
        head = rows * length if targets is None else (targets != -100).sum().double()
        return flops.step_flops(rows * length, length * context, head)

    def layer_matmul_params(self, arch, index: int) -> int:
        """Matmul weights one token uses in layer `index` (its active ones)."""
        return self.attention_params(arch) + self.mlp_params(arch, index)


def matmul_flops(matmul_params: int, tokens, attention_width: int, layers: int, pairs):
    """Forward + backward FLOPs of a decoder's matmuls: 6 per matmul weight and token
    (forward 2, backward 4) and 12 per layer, attention width (heads x head_dim) and (query,
    key) pair that attention scores (Q K^T and A V, 2 each forward, x3 with the backward).
    The one formula the MFU (train/mfu.py FlopModel), the pipeline's split
    (parallel/pipeline_plan.py `layer_costs`) and the families' `call_flops` read: `pairs` is
    tokens x row length for full attention, a document mask's pairs for what a masked kernel
    executes; one layer's cost per token is `matmul_flops(its params, 1, width, 1, length)`."""
    return 6 * matmul_params * tokens + 12 * layers * attention_width * pairs


def recomputes(checkpointing: bool | int, index: int) -> bool:
    """Whether layer `index` (its index in the whole model) recomputes its activations in
    backward under `gradient_checkpointing` = `checkpointing`: True every layer, an int n
    every n-th (0, n, 2n, ...: selective), False none. The one rule the model's forward
    (models/transformer.py) and the planner's memory and traffic (plan/memory.py,
    plan/traffic.py) read. The index is global, not the position within a pipeline rank, so
    the layers that recompute are the model's, whatever the layout cuts."""
    if isinstance(checkpointing, bool):
        return checkpointing
    return checkpointing > 0 and index % checkpointing == 0


@runtime_checkable
class StagedModel(Protocol):
    """What a pipeline stage calls: the model's own forward over some of its layers, and
    on the last stage the model's own head loss."""

    def hidden_states(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, kv_cache=None, *,
                      layers=None, first: bool = True,
                      last: bool = True) -> torch.Tensor: ...  # fmt: skip

    def weighted_head_loss(self, hidden: torch.Tensor, targets: torch.Tensor,
                           target_weights: torch.Tensor, vocab_chunk: int = 8192, *,
                           fused: bool = True, selected=None) -> torch.Tensor: ...  # fmt: skip


DECODER_TENSOR_PLAN = TensorPlan(
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
             "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    inputs={"self_attn": 5, "mlp": 1},  # attention: (x, cos, sin, mask, cache)
    per_head_norms=("self_attn.q_norm", "self_attn.k_norm"),
    sequence_norms=("input_layernorm", "post_attention_layernorm"),
)  # fmt: skip

DECODER = ModelShape("decoder", DECODER_TENSOR_PLAN, activation_formula=True)
"""The native decoder block (models/transformer.py DecoderLayer): pre-norm GQA attention
and a gated MLP or a mixture of experts."""

WRAPPED = ModelShape("transformers", tensor=None, staged=False, lora_linear="all-linear")
"""A transformers masked-LM class run as it is (models/hf_wrapped.py): no tensor or
pipeline parallelism."""


class DiffusionGemmaShape(ModelShape):
    """DiffusionGemma's layers (models/diffusion_gemma.py): sliding-window and full-attention
    layers of different head sizes (full ones without v_proj), each with a dense gated MLP
    and a mixture of experts side by side. Per-layer weights count each layer's own
    attention; the attention width is the mean over the layers (the MFU and the pipeline
    multiply it by the layer count). Counted as the decoder's pass over a canvas (the
    encoder runs the same weights over the prompt). A training step's call and passes
    (`training_call`, `passes`) are what the planner traces and prices."""

    def _attention(self, arch, index: int) -> tuple[int, int]:
        """(query width, weights of q, k, v and o) of layer `index`."""
        sliding, head_dim, kv_heads = arch.diffusion_gemma.layer_shape(arch, index)
        width = arch.num_attention_heads * head_dim
        kv = kv_heads * head_dim * (2 if sliding else 1)  # full layers: V is the normed K
        return width, 2 * arch.hidden_size * width + arch.hidden_size * kv

    def attention_width(self, arch) -> int:
        widths = [self._attention(arch, i)[0] for i in range(arch.num_hidden_layers)]
        return round(sum(widths) / len(widths))

    def attention_params(self, arch) -> int:
        weights = [self._attention(arch, i)[1] for i in range(arch.num_hidden_layers)]
        return round(sum(weights) / len(weights))

    def mlp_params(self, arch, index: int) -> int:
        """The dense MLP (3 h I), the router (E h) and the top-k experts (3 h I_moe each)."""
        hidden, inner = arch.hidden_size, arch.resolved_moe_intermediate_size
        return (3 * hidden * arch.intermediate_size + arch.num_experts * hidden
                + arch.num_experts_per_tok * 3 * inner * hidden)  # fmt: skip

    def layer_matmul_params(self, arch, index: int) -> int:
        return self._attention(arch, index)[1] + self.mlp_params(arch, index)

    def canvas_length(self, arch) -> int:
        return arch.diffusion_gemma.canvas_length

    def prompt_kv(self, arch, index: int, length: int) -> tuple[int, int, int]:
        """(prompt tokens whose keys and values layer `index` keeps for the decoder, its
        key/value heads, its head dim) for a prompt of `length` tokens: the whole prompt on a
        full-attention layer, its last sliding_window - 1 tokens on a sliding one (the
        canvas's memory walk, plan/canvas_memory.py `prompt_kv_gradient_bytes`)."""
        sliding, head_dim, kv_heads = arch.diffusion_gemma.layer_shape(arch, index)
        kept = min(length, arch.diffusion_gemma.sliding_window - 1) if sliding else length
        return kept, kv_heads, head_dim

    def training_call(self, arch, rows: int, length: int,
                      self_condition: bool) -> tuple[tuple, dict]:  # fmt: skip
        """(args, kwargs) of one training call of the model as the `uniform` objective makes
        it (diffusion/uniform.py): `rows` prompts of `length` tokens (the row, left-padded:
        `prompt_mask`), canvases of `canvas_length` tokens after them, `self_condition` (B,)
        bool when diffusion.self_conditioning_prob > 0 (the first decoder pass then runs on
        every row), the targets and their weights; made in the current device and tensor
        mode (the planner's meta device and FakeTensorMode: only the shapes are read)."""
        canvas = arch.diffusion_gemma.canvas_length
        long = torch.long
        kwargs = {"prompt_mask": torch.ones(rows, length, dtype=torch.bool),
                  "position_ids": torch.zeros(rows, length, dtype=long),
                  "canvas_position_ids": torch.zeros(rows, canvas, dtype=long),
                  "self_condition": torch.ones(rows, dtype=torch.bool) if self_condition else None,
                  "targets": torch.zeros(rows, canvas, dtype=long),
                  "target_weights": torch.ones(rows, canvas)}  # fmt: skip
        args = (torch.zeros(rows, length, dtype=long), torch.zeros(rows, canvas, dtype=long))
        return args, kwargs

    def passes(self, arch, length: int, self_condition: bool) -> list[tuple[int, int, bool]]:
        """The shared stack's passes of one training call, in order, as (tokens per row,
        layers with a mixture of experts run, with gradients): the encoder over the row
        (every layer's MLP but the last's: of the last layer only its keys and values are
        read), the first decoder pass over the canvas without gradients (with
        self-conditioning), the decoder over the canvas with them."""
        canvas, layers = arch.diffusion_gemma.canvas_length, arch.num_hidden_layers
        out = [(length, layers - 1, True)]
        if self_condition:
            out.append((canvas, layers, False))
        return out + [(canvas, layers, True)]

    def call_flops(self, flops, arch, args: tuple, kwargs: dict, context: int = 1):
        """A training call `model(prompt (B, P), canvas (B, C), ..., self_condition=)` (the
        `uniform` objective's), forward and backward: the encoder over the prompt (every
        layer but the last, of which it needs only the keys and values the decoder reads);
        the decoder over the canvas (every matmul weight a token uses, N, but the
        self-conditioning MLP's when no signal is given), its queries over the prompt's
        keys and the canvas's; the LM head (the tied embedding, the whole vocabulary) on
        every canvas position. Attention is counted over every key (the encoder's causal
        half and sliding windows not taken off, as the decoder's count takes no document
        mask off). With `self_condition`: a first decoder pass without the signal, forward
        only, on every row, and the second pass's signal (softmax @ embedding, forward and
        the embedding's gradient, and the self-conditioning MLP) on every row, zero on the
        rows it does not condition. tests/integration/test_uniform_train.py holds it to
        torch's FlopCounterMode. A call with pictures (`images`) adds the vision tower's and
        projector's (`flops.tower`: models/diffusion_gemma_vision.py `tower_flops`)."""
        prompt = args[0] if args else kwargs["input_ids"]
        canvas = args[1] if len(args) > 1 else kwargs.get("canvas_ids")
        if canvas is None:  # a plain call: the decoder's count
            return super().call_flops(flops, arch, args, kwargs, context)
        text = self._text_call_flops(flops, arch, prompt, canvas, kwargs)
        tower, images = getattr(flops, "tower", None), kwargs.get("images")
        if tower is None or images is None:
            return text
        return text + tower.call_flops(images)  # the pictures through the vision tower

    def _text_call_flops(self, flops, arch, prompt, canvas, kwargs: dict):
        """`call_flops` of the shared stack, the self-conditioning and the head."""
        rows, p, c = prompt.shape[0], prompt.shape[1], canvas.shape[1]
        n, width = flops.matmul_params, flops.attention_width
        last = arch.num_hidden_layers - 1
        sliding, head_dim, kv_heads = arch.diffusion_gemma.layer_shape(arch, last)
        kv = arch.hidden_size * kv_heads * head_dim * (2 if sliding else 1)
        n_encoder = sum(self.layer_matmul_params(arch, i) for i in range(last)) + kv
        # the encoder's attention: every layer's queries but the last's
        encoder = matmul_flops(n_encoder, rows * p, width, last, rows * p * p)
        head = flops.head_params * rows * c
        attention = matmul_flops(0, 0, width, flops.layers, rows * c * (p + c))
        signal = 3 * arch.hidden_size * arch.intermediate_size  # self-conditioning's MLP
        if kwargs.get("self_condition") is None:  # no signal: no self-conditioning MLP
            return encoder + 6 * (n - signal) * rows * c + attention + 6 * head
        first = 2 * (n - signal) * rows * c + attention / 3 + 2 * head  # forward only
        # the second pass with the signal (softmax @ embedding: forward, and the embedding's
        # gradient) on every row, zero where a row is not conditioned
        return encoder + first + 6 * n * rows * c + attention + 6 * head + 4 * head


DIFFUSION_GEMMA_TENSOR_PLAN = TensorPlan(
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
             "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    inputs={"self_attn": 5, "mlp": 1},  # attention: (x, cos, sin, mask, past K/V)
    per_head_norms=("self_attn.q_norm", "self_attn.k_norm"),
    divides=("num_attention_heads", "num_key_value_heads",
             "diffusion_gemma.num_global_key_value_heads", "intermediate_size"),
    vocab_parallel=False,
    replicated_experts=True,
)  # fmt: skip

# DiffusionGemma's "all-linear": the decoder's names, inside the shared stack's layers only
# (its attention and dense MLP; full-attention layers have no v_proj). Not its router
# (`router.proj`: frozen when fine-tuning, diffusion.freeze_router), not the
# self-conditioning MLP outside the layers (`model.self_conditioning.*_proj`, which the names
# alone would match), not the LM head (the tied embedding).
DIFFUSION_GEMMA_LINEAR = (r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj"
                          r"|mlp\.(gate|up|down)_proj)")  # fmt: skip
DIFFUSION_GEMMA = DiffusionGemmaShape("diffusion_gemma", tensor=DIFFUSION_GEMMA_TENSOR_PLAN,
                                     staged=False, canvas_decoder=True, recompute=False,
                                     lora_linear=DIFFUSION_GEMMA_LINEAR,
                                     memory_model="canvas")  # fmt: skip
"""Tensor parallelism (`DIFFUSION_GEMMA_TENSOR_PLAN`, Megatron's split of what this family
allows): attention's q/k/v column-parallel (full layers have no v_proj: V is the k
projection, so it is split with k), o row-parallel, q_norm/k_norm per head over a rank's
heads, and every K/V a rank caches (the encoder's `PromptCache`, read by the decoder) is of
its own heads; the dense MLP's gate/up column-parallel, down row-parallel. The degree must
divide the query heads, the sliding layers' and the full layers' key/value heads (the
26B-A4B: 16, 8, 2, so tp 1 or 2) and the MLP width. The routers and the expert stacks are
not split (`replicated_experts`): every tp rank routes the same replicated hidden states
and runs every expert (FSDP2 shards them over the data-parallel ranks); splitting experts is
expert parallelism's job, and tensor parallelism with expert parallelism stays refused, as
for every MoE family. The tied embedding / LM head (float32 soft-capped logits, its own
`canvas_cross_entropy`) and the self-conditioning MLP stay replicated (`vocab_parallel`
False); no sequence parallelism (no `sequence_norms`). `unmask plan` does not model the tp
split of this family and refuses it in one line.

No pipeline stages (its forward is an encoder pass and a decoder pass, not
`StagedModel`'s `hidden_states`); trained by the `uniform` objective (`canvas_decoder`).

Planned (`plans`; plan/canvas_memory.py `canvas_memory_terms`) as that objective's step runs it:
the encoder over the whole row (data.packing_length, left-padded), a decoder pass without
gradients over the canvas when diffusion.self_conditioning_prob > 0 (on every row), the
decoder with gradients over the canvas, the tied LM head on the canvas over the whole
vocabulary in float32. What is measured and what is modelled:

- measured: the parameter, gradient and optimizer-state shards (the run's own build and
  parallelize code under the fake process group, experts on the ep grid as the other MoE
  families'); the bytes the step saves for backward, layer by layer and pass by pass, by
  running the model's own forward on the objective's call (`training_call`) under
  FakeTensorMode (plan/canvas_memory.py `traced_canvas_bytes`); the FLOPs (`call_flops`, held to
  FlopCounterMode);
- modelled: under expert parallelism the saves a one-process trace cannot see (the
  received rows' regrouping, autocast's bfloat16 copies of the local expert stacks), with
  routing taken as balanced; the working memory (the float32 logits as the head caps them,
  the first pass's logits held as the signal, the logits' and layers' activation
  gradients, the prompt K/V gradients, FSDP2's gathered units and unsharded gradients);
  FSDP2's traffic (each layer gathered before each use, reduce-scattered after each
  backward use) and EP's all-to-alls per pass.

tests/unit/test_plan_diffusion_gemma.py holds a tiny model's plan to a real CPU step (state
and saved bytes exactly, the peak within 15%); the 26B-A4B's numbers on GPUs are not
measured here."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks (``model.model.layers``), or none for other models."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if layers is not None else []
