"""Mixture-of-experts MLPs: a router, experts as stacked 3-D weights, shared experts.

One `SparseMoE` replaces a decoder layer's SwiGLU MLP (`model.layers.N.mlp`) when
`ModelConfig.num_experts > 0` (and the layer is not one of the dense ones). Its state-dict
names are the stacked layout of transformers' MoE models and LLaDA2.0's fused experts:

    mlp.gate.weight               (E, H)     router
    mlp.gate.expert_bias          (E,)       sigmoid routers only: a buffer, not a parameter
    mlp.experts.gate_proj         (E, I, H)  one SwiGLU per expert, stacked
    mlp.experts.up_proj           (E, I, H)
    mlp.experts.down_proj         (E, H, I)
    mlp.shared_experts.{gate,up,down}_proj.weight   num_shared_experts > 0

Hugging Face folders store one matrix per expert; models/moe_layout.py converts.

Routing (per token, fp32): scores = softmax(logits) or sigmoid(logits); the choice of the
top-k experts reads scores + expert_bias (sigmoid) inside the topk_group best of n_group
groups (group score: sum of its top-2 scores); the weights are the chosen unbiased scores,
renormalized when norm_topk_prob (always for sigmoid, as LLaDA2.0), times
routed_scaling_factor.

Tokens are sorted by expert and run as one grouped GEMM (`torch._grouped_mm`) or one matmul
per expert over the same sorted rows (`loop`); `expert_parallel` (parallel/expert.py) sends
the sorted rows to the ranks that own their experts and back.

Balancing, computed over each micro-batch of the whole data-parallel group (`balance_group`)
so the gradients do not depend on the world size: the load-balancing loss
coef * E * sum_e f_e P_e (f_e: share of the micro-batch's routed slots that went to e, P_e:
mean routing probability of e) and the z-loss coef * mean(logsumexp(logits)^2), both added to
the objective's loss through `AuxLossScaler` (their gradients join the backward, scaled by
`aux_loss_scale` = 1 / forwards per step: the gradient-accumulation micro-batches, or under
pipeline parallelism the pipeline's micro-batches, whose stage backward runs it). The load
of every expert is summed over the step (`load`) for the metrics and for the aux-loss-free
bias update (`update_expert_bias`), which the optimizer runs once per step
(`attach_moe_training`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from unmask.dtensor import is_dtensor
from unmask.models.config import ModelConfig
from unmask.models.fused import swiglu


class _Recompute:
    """Whether a checkpointed layer's forward is running again in backward (activation
    checkpointing's recomputation): statistics of a forward must count once. Set by
    `recomputing()`, the context torch.utils.checkpoint enters around the recomputation
    (`checkpoint_contexts`); a plain Python flag, which torch.compile reads as a constant
    and guards on (one graph for the forward, one for the recomputation), where asking
    autograd whether a backward is running would break the compiled graph."""

    active = False


@contextlib.contextmanager
def recomputing():
    before = _Recompute.active
    _Recompute.active = True
    try:
        yield
    finally:
        _Recompute.active = before


@contextlib.contextmanager
def _checkpointed_forward():
    before = _StepCasts.checkpointed
    _StepCasts.checkpointed = True
    try:
        yield
    finally:
        _StepCasts.checkpointed = before


@contextlib.contextmanager
def _checkpointed_recomputation():
    with recomputing(), _checkpointed_forward():
        yield


def checkpoint_contexts():
    """torch.utils.checkpoint's `context_fn`: around the forward and the recomputation a
    flag that keeps the step's cast copies out of the checkpointed layer (`expert_stack`),
    and `recomputing()` around the recomputation."""
    return _checkpointed_forward(), _checkpointed_recomputation()


def _in_backward() -> bool:
    return _Recompute.active


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; in backward the auxiliary loss gets gradient `scale`, so it joins
    the objective's loss without the objective knowing (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def float32_region(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on `device` where it is on: a router's logits in float32 under bf16
    autocast, which casts a linear's float32 inputs to bf16 (`.float()` alone is undone), so
    the choice of experts would follow bf16-rounded logits. A no-op elsewhere."""
    if device.type != "meta" and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class _Float32Linear(torch.autograd.Function):
    """x @ weight.T in float32 with autocast off, its two gradient matmuls too: a router's
    logits. A Function of its own because torch.compile traces the backward of an
    autocast-off region under the forward's autocast, which ran those two in bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf, wf = x.float(), weight.float()
        ctx.save_for_backward(xf, wf)
        ctx.dtypes = (x.dtype, weight.dtype)
        with float32_region(x.device):
            return F.linear(xf, wf)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xf, wf = ctx.saved_tensors
        grad_x = grad_w = None
        with float32_region(grad.device):
            grad = grad.float()
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ wf).to(ctx.dtypes[0])
            if ctx.needs_input_grad[1]:
                grad_w = (grad.T @ xf).to(ctx.dtypes[1])
        return grad_x, grad_w


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, H) @ weight (E, H).T in float32, forward and backward, under autocast too
    (`float32_region`): the choice of experts follows float32 logits."""
    return _Float32Linear.apply(x, weight)


class Router(nn.Module):
    """Linear router (E x H) with the routing rules of the module docstring."""

    is_moe_router = True  # optim/routing.py: AdamW, not Muon

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.score = cfg.router_score
        self.norm_topk_prob = cfg.norm_topk_prob or cfg.router_score == "sigmoid"
        self.scaling = cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.router_score == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, H) -> experts (T, k) long, weights (T, k) float32, logits (T, E) float32."""
        logits = router_logits(x, self.weight)  # autocast would run it in bf16
        if self.score == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.n_group > 1:
            choice = self._group_limited(choice)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling, logits

    def _group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """choice (T, E) with the experts outside each token's topk_group best groups at -inf."""
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
        keep = group_scores.topk(self.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~mask[..., None], float("-inf")).view(tokens, -1)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-token routing probabilities (T, E) for the balancing loss: softmax scores, or
        sigmoid scores normalized to sum 1 (DeepSeek-V3's sequence-wise loss)."""
        if self.score == "softmax":
            return logits.softmax(dim=-1)
        scores = logits.sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes torch._grouped_mm takes (float64 raises: "Expected mat_a to be Float32, ...")."""


def grouped_mm_fits(*sizes: int, dtype: torch.dtype) -> bool:
    """torch._grouped_mm takes `dtype` and rows of these sizes (row strides that are
    multiples of 16 bytes)."""
    item = torch.empty((), dtype=dtype).element_size()
    return (hasattr(torch, "_grouped_mm") and dtype in GROUPED_MM_DTYPES
            and all(s * item % 16 == 0 for s in sizes))  # fmt: skip


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous (grouped_mm's CPU backward refuses the
    expanded gradients a `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def local_experts(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stack: the tensor itself, or under expert parallelism
    (parallel/expert.py) the local part of a DTensor sharded on the expert dim, whose
    gradient stays a partial sum over the replicas (reduced once per optimizer step)."""
    if not is_dtensor(weight):
        return weight
    from torch.distributed.tensor import Partial, Replicate  # imported already: a DTensor

    grad = [Partial() if isinstance(pl, Replicate) else pl for pl in weight.placements]
    return weight.to_local(grad_placements=grad)


class _StepCasts:
    """The expert stacks' copies in autocast's dtype made in this optimizer step
    (`step_casts`): id(parameter) -> ((version, dtype), copy, parameter);
    None outside a step. `checkpointed`: inside a checkpointed layer's forward."""

    copies: dict | None = None
    checkpointed = False


@contextlib.contextmanager
def step_casts():
    """Within it, each float32 expert stack is cast to autocast's dtype once, not once per
    pass (`expert_stack`). train/step.py holds it around a step's forwards and backwards:
    DiffusionGemma's uniform objective runs the experts three times a micro-batch (the
    encoder, the self-conditioning pass, the decoder), and every micro-batch of gradient
    accumulation again, each a copy of every stack under autocast over float32 masters.
    The copies go at its exit, before the optimizer changes the masters."""
    before = _StepCasts.copies
    _StepCasts.copies = {}
    try:
        yield
    finally:
        _StepCasts.copies = before


class _SharedCast(torch.autograd.Function):
    """`source.to(copy.dtype)` whose value is `copy` (made once): one node per use, whose
    backward is the cast's (the gradient in the source's dtype), so the source's gradient
    is the float32 sum of each use's gradient, as with a cast per use."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = source.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def expert_stack(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of an expert stack (`local_experts`) in `dtype`. Inside
    `step_casts` the copy of a parameter whose dtype differs is made once and reused while
    the parameter is unchanged (its version counter and the dtype are the key: nothing
    changes the masters within a step, the optimizer runs after it),
    gradients flowing to it through `_SharedCast`; the losses and gradients equal a cast per
    use bit for bit (tests/unit/test_moe.py). A plain cast outside a step, for a tensor that
    is not a parameter (LoRA's adapted stack), inside a checkpointed layer (whose copies are
    freed after its forward and made again in its recomputation: the step's copies would
    hold every layer's at once) and under torch.compile (the graph makes its own)."""
    local = local_experts(param)
    if torch.compiler.is_compiling():  # first: a compiled graph reads no step state
        return local.to(dtype)
    copies = _StepCasts.copies
    if (local.dtype == dtype or copies is None or _StepCasts.checkpointed
            or not isinstance(param, nn.Parameter)):  # fmt: skip
        return local.to(dtype)
    key = (local._version, dtype)
    entry = copies.get(id(param))
    if entry is None or entry[0] != key:
        entry = (key, local.detach().to(dtype), param)  # the parameter kept: id stays its
        copies[id(param)] = entry
    if torch.is_grad_enabled() and local.requires_grad:
        return _SharedCast.apply(local, entry[1])
    return entry[1]


class Experts(nn.Module):
    """`num_local` SwiGLU experts as stacked weights, applied to rows sorted by expert."""

    def __init__(self, cfg: ModelConfig, num_local: int | None = None) -> None:
        super().__init__()
        experts = cfg.num_experts if num_local is None else num_local
        hidden, inner = cfg.hidden_size, cfg.resolved_moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.implementation = cfg.moe_implementation

    @property
    def num_local(self) -> int:
        return self.gate_proj.shape[0]

    def uses_grouped_mm(self, dtype: torch.dtype) -> bool:
        if self.implementation == "loop":
            return False
        inner, hidden = self.gate_proj.shape[1:]
        fits = grouped_mm_fits(inner, hidden, dtype=dtype)
        if self.implementation == "grouped_mm" and not fits:
            raise ValueError(
                "moe_implementation grouped_mm needs float32, bfloat16 or float16 weights and "
                "hidden_size and moe_intermediate_size whose rows are multiples of 16 bytes "
                f"(torch._grouped_mm; here {dtype}); use loop or auto"
            )
        return fits

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, H) rows sorted by local expert, counts (num_local,) rows per expert ->
        (N, H) each row through its expert."""
        stacks = (self.gate_proj, self.up_proj, self.down_proj)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            gate, up, down = (expert_stack(w, dtype) for w in stacks)  # once a step
        else:
            gate, up, down = (local_experts(w) for w in stacks)
            x = x.to(gate.dtype)
        if self.uses_grouped_mm(x.dtype):
            offsets = counts.cumsum(0).to(torch.int32)
            x = _ContiguousGrad.apply(x)
            hidden = swiglu(
                torch._grouped_mm(x, gate.transpose(1, 2), offs=offsets),
                torch._grouped_mm(x, up.transpose(1, 2), offs=offsets),
            )
            return torch._grouped_mm(hidden, down.transpose(1, 2), offs=offsets)
        return self.loop(x, counts.tolist(), gate, up, down)

    @staticmethod
    def loop(x, counts: list[int], gate, up, down) -> torch.Tensor:
        """The sorted-token loop: one matmul per expert over its contiguous rows."""
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            rows = x[start : start + count]
            start += count
            hidden = swiglu(rows @ gate[expert].T, rows @ up[expert].T)
            outputs.append(hidden @ down[expert].T)
        return torch.cat(outputs) if outputs else x.new_zeros(0, down.shape[1])


class SharedExperts(nn.Module):
    """The always-on SwiGLU (LLaDA2.0's `shared_experts`; HF Linear names)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared experts): the MLP of an MoE decoder layer."""

    # its routed expert stacks, (E, ., .) parameters, as paths from this module: what expert
    # parallelism splits on the expert dim (parallel/expert.py) and LoRA's `experts` adapts
    # (models/lora.py); every expert module declares its own (DiffusionGemma's `Experts`)
    expert_stacks = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.aux_coef = cfg.router_aux_loss_coef
        self.z_coef = cfg.router_z_loss_coef
        self.bias_rate = cfg.expert_bias_update_rate
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        # (inner, hidden) of one expert, kept here: under LoRA on the expert stacks peft
        # wraps `experts`, whose stacks are then not attributes of the wrapper
        self.expert_shape = (cfg.resolved_moe_intermediate_size, cfg.hidden_size)
        inner = cfg.resolved_moe_intermediate_size * cfg.num_shared_experts
        self.shared_experts = SharedExperts(cfg.hidden_size, inner) if inner else None
        # set by the trainer (parallel/expert.py, attach_moe_training)
        self.expert_parallel = None  # an ExpertShard: experts live on several ranks
        self.balance_group = None  # data-parallel process group the balancing spans
        self.aux_loss_scale = 1.0  # 1 / forwards (micro-batches) per optimizer step
        self.register_buffer("load", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("aux_sum", torch.zeros(()), persistent=False)

    def active_matmul_params(self) -> int:
        """Matmul weights one token uses (router + its top-k experts; MFU counts these)."""
        inner, hidden = self.expert_shape
        return self.num_experts * hidden + self.top_k * 3 * inner * hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights, logits = self.gate(flat)
        chosen = experts.reshape(-1)  # (T k,) the expert of each routed slot
        order = chosen.argsort(stable=True)
        token = order // self.top_k
        counts = expert_counts(chosen[order], self.num_experts)
        rows = flat.index_select(0, token)
        if self.expert_parallel is not None:
            out = self.expert_parallel.run(self.experts, rows, counts)
        else:
            out = self.experts(rows, counts)
        # back to (token, slot) order, each slot weighted, the k slots of a token summed in
        # float32: a gather and a fixed-order sum, where an index_add_ would add the slots
        # with atomics in whatever order they land (bf16 sums that change run to run)
        unsorted = out.index_select(0, order.argsort())  # slot order
        gates = weights.reshape(-1, 1).to(out.dtype)
        y = (unsorted * gates).view(-1, self.top_k, out.shape[-1]).sum(1, dtype=torch.float32)
        y = y.to(out.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        if self.training and torch.is_grad_enabled():
            y = self._balancing(y, counts, logits)
        return y.view(shape).to(x.dtype) if y.dtype != x.dtype else y.view(shape)

    def _balancing(self, y, counts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Record the load; attach the aux and z losses (over the whole balance group)."""
        stats = torch.cat([counts.float(), counts.new_full((1,), logits.shape[0]).float()])
        if self.balance_group is not None and (self.aux_coef or self.z_coef):
            dist.all_reduce(stats, group=self.balance_group)
        if not _in_backward():
            self.load += counts.float()  # this rank's; summed over ranks at the step
        if not (self.aux_coef or self.z_coef):
            return y
        tokens = stats[-1]
        aux = logits.new_zeros(())
        if self.aux_coef:
            share = stats[:-1] / (tokens * self.top_k)  # f_e, no gradient
            probs = self.gate.probabilities(logits).sum(dim=0) / tokens  # this rank's part of P_e
            aux = aux + self.aux_coef * self.num_experts * (share * probs).sum()
        if self.z_coef:
            aux = aux + self.z_coef * logits.logsumexp(dim=-1).square().sum() / tokens
        if not _in_backward():
            self.aux_sum += aux.detach() * self.aux_loss_scale
        return AuxLossScaler.apply(y, aux, self.aux_loss_scale)

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing: bias += rate * sign(mean load - load) (load: the step's,
        summed over micro-batches and ranks)."""
        bias = self.gate.expert_bias
        if bias is None or self.bias_rate == 0:
            return
        bias += self.bias_rate * torch.sign(load.mean() - load).to(bias.dtype)


def expert_counts(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed slots per expert (num_experts,) long, from the slots' experts sorted: each
    expert's end in the sorted list (`searchsorted`) minus its start. No device sync, where
    `bincount` reads its input's maximum back to the host first; exact and deterministic,
    where a float `histc` or atomic counts would not be."""
    bounds = torch.arange(num_experts + 1, device=sorted_experts.device, dtype=sorted_experts.dtype)
    ends = torch.searchsorted(sorted_experts, bounds)
    return ends[1:] - ends[:-1]


def moe_blocks(model: nn.Module) -> list[SparseMoE]:
    """The model's MoE MLPs in layer order ([] for a dense model)."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


@torch.no_grad()
def init_moe_weights(model: nn.Module, std: float) -> None:
    """normal(0, std) for routers and expert stacks, zero expert biases."""
    for block in moe_blocks(model):
        block.gate.weight.normal_(0.0, std)
        if block.gate.expert_bias is not None:
            block.gate.expert_bias.zero_()
        for param in (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj):
            param.normal_(0.0, std)
