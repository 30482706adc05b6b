"""Pipeline parallelism of the native decoder with torch.distributed.pipelining.

The decoder's layers are cut into consecutive stages (the embedding with the first, the
final norm and LM head with the last); each rank of the mesh's "pp" dim holds one stage, or
`stages_per_rank` of them (stage s on pp rank s mod pp) for the interleaved schedules. A
step's rows are cut into micro-batches that flow through the stages in the order of torch's
schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble); only hidden states
(B, L, H) travel between ranks.

What the objective computes is unchanged: it is called as usual with a stand-in model
(`ModelCall`) that records the one forward call it makes (noisy ids, document ids,
positions, targets and their weights) and returns a placeholder; the pipeline then runs that
call over the stages, the last stage returning the weighted cross-entropy sum of each
micro-batch. The step's normalizer (the objective's count, summed over micro-batches and
ranks) is known before the forward, so each micro-batch's loss is sum / global count and
the gradients need no rescaling: one global normalization, as without a pipeline.

Every stage gets its micro-batch's side inputs (document ids, positions, an explicit
attention mask; the targets on the last stage) from the same rows every pp rank of a
pipeline reads, so neither they nor the RoPE tables travel.

Zero bubble splits each backward into an input pass and a weight pass. Here the input pass
is one autograd backward in which the stage's linear layers and norms leave their weights'
gradients to the weight pass (`defer_weight_gradients`, diffusion/backward.py), and the
weight pass (torch's `dw_builder` hook) runs just those matmuls: no second walk of the
graph, as torch's own split does. The LM head's loss makes both its gradients in the
forward (`ScheduleSpec.head_loss`), and the last stage's input pass comes right after it.

Mixture-of-experts layers are ordinary layers of a stage (first_k_dense_replace's dense
ones too). Their balancing losses need no help from the last stage: each MoE layer hangs its
aux and z losses on its output (models/moe.py, AuxLossScaler), so the stage's backward,
whatever the schedule, hands them their gradient 1 / forwards per step, the forwards being
the pipeline's micro-batches here (`balancing_notice`: they span the unpipelined run's tokens
when pipeline_microbatches = gradient_accumulation_steps). The expert load is summed over
the step's micro-batches and the stage's data-parallel ranks, and the biases move once per
optimizer step (parallel/expert.py, MoETraining); the logged balancing metrics gather every
stage's layers over the pp group.

Parameter names are the whole model's (`model.layers.5.mlp.up_proj.weight` stays that on
the stage that holds layer 5), so DCP checkpoints reshard across pipeline degrees,
schedules and every other layout.

Without parallel.pipeline_split the layers are cut by estimated cost (`layer_costs`,
`balanced_split`): the forward + backward FLOPs per token of each decoder layer (an MoE
layer's active ones), the embedding with the first stage and the norm, LM head and loss
with the last, so that the stages are as equal as whole layers allow. The trainer and
`unmask plan` both plan with train/setup.py `pipeline_plan`, so the planned split is the
run's. `bubble_formula` is each schedule's idle share with equal stages, which
`schedule_idle` (a replay of an action order with given costs) checks against torch's own
schedules in tests/unit/test_pipeline_plan.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn

from unmask.diffusion.backward import BackwardPass
from unmask.diffusion.loss import SelectedRows, weighted_loss
from unmask.errors import InputError
from unmask.models.build import shape_of
from unmask.models.fused import deferring_linear_forward


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule: everything the trainer, `unmask plan` and the memory model read
    of it, so a schedule is one object (`register_schedule` adds one from outside).

    torch_class: the torch.distributed.pipelining schedule (a class, or its name there).
    multi_stage: several stages per rank (looped: stage s on pp rank s mod pp), so
    parallel.pipeline_stages_per_rank >= 2; else exactly 1.
    head_loss: how the last stage's loss makes the LM head's gradients: "fused" in the
    forward (diffusion/loss.py weighted_cross_entropy: 3 passes over the head, the gradients
    held until the micro-batch's backward, which on the last stage of 1F1B, interleaved 1F1B
    and zero bubble comes right after its forward; zero bubble's input pass hands both over,
    its weight pass has none of the head's work); "chunked" in the backward (the logits
    recomputed there: 4 passes, nothing held), for GPipe, whose forwards all run before its
    backwards, so a forward that makes the head's gradients paces the forward half with work
    of the backward half, and every micro-batch's gradients would wait at once.
    split_backward: the backward runs as an input pass and a weight pass (torch's
    `dw_builder`; zero bubble), which changes the bubble (`bubble_formula`) and keeps FSDP2
    from resharding after the forward.
    forwards_first: every micro-batch's forward runs before any backward (GPipe), so all
    their activations are live at once (`in_flight`)."""

    name: str
    torch_class: str | type
    multi_stage: bool = False
    head_loss: str = "fused"
    split_backward: bool = False
    forwards_first: bool = False

    def schedule_class(self) -> type:
        if isinstance(self.torch_class, str):
            from torch.distributed import pipelining  # lazily, as the stage does

            return getattr(pipelining, self.torch_class)
        return self.torch_class

    def in_flight(self, microbatches: int, degree: int, stages_per_rank: int, rank: int) -> float:
        """Micro-batches whose saved activations are live at once on pp rank `rank`, in
        units of one micro-batch through all of the rank's layers: every forward first (m),
        one stage per rank min(m, p - r) (1F1B's warm-up), several min(m v, (v - 1) p +
        2 (p - 1 - r) + 1) stage-micro-batches of 1/v of the rank's layers each
        (torch.distributed.pipelining's interleaved warm-up counts)."""
        m, p, v, r = microbatches, degree, stages_per_rank, rank
        if self.forwards_first:
            return float(m)
        if v == 1:
            return float(min(m, p - r))
        return min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) / v


#: parallel.pipeline_schedule values, by name
PIPELINE_SCHEDULES: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> None:
    """Add `spec` as a parallel.pipeline_schedule value (ValueError when its name is taken or
    its head_loss is neither "fused" nor "chunked")."""
    if spec.name in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {spec.name!r} is already registered")
    if spec.head_loss not in HEAD_PASSES:
        raise ValueError(f"pipeline schedule {spec.name!r}: head_loss must be one of "
                         f"{sorted(HEAD_PASSES)}, not {spec.head_loss!r}")  # fmt: skip
    PIPELINE_SCHEDULES[spec.name] = spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule `name`; InputError naming the registered ones."""
    spec = PIPELINE_SCHEDULES.get(name)
    if spec is None:
        raise InputError(f"unknown parallel.pipeline_schedule {name!r}; expected one of "
                         f"{list(PIPELINE_SCHEDULES)}")  # fmt: skip
    return spec


#: passes over the head's (rows x vocab) logits per micro-batch, by ScheduleSpec.head_loss
HEAD_PASSES = {"fused": 3, "chunked": 4}

for _spec in (
    ScheduleSpec("gpipe", "ScheduleGPipe", head_loss="chunked", forwards_first=True),
    ScheduleSpec("1f1b", "Schedule1F1B"),
    ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B", multi_stage=True),
    ScheduleSpec(
        "zero_bubble", "ScheduleInterleavedZeroBubble", multi_stage=True, split_backward=True
    ),  # fmt: skip
):
    register_schedule(_spec)


@dataclass(frozen=True)
class LayerCosts:
    """Estimated forward + backward FLOPs per token of the parts a stage can hold: each
    decoder layer, the embedding (first stage) and the final norm + LM head + loss (last
    stage)."""

    layers: tuple[float, ...]
    embedding: float
    head: float

    def stage(self, layers: Sequence[int], first: bool, last: bool) -> float:
        """The cost of a stage holding `layers` (and the embedding / the head)."""
        extra = (self.embedding if first else 0.0) + (self.head if last else 0.0)
        return math.fsum(self.layers[i] for i in layers) + extra


def layer_costs(cfg, length: int, head_share: float, head_loss: str = "fused") -> LayerCosts:
    """The LayerCosts of a native decoder (cfg: its ModelConfig, the architecture) on rows
    of `length` tokens, the LM head running on `head_share` of the tokens (the masked ones:
    the objective's, diffusion/registry.py `head_share`); head_loss: how the schedule's last
    stage makes the head's gradients (`ScheduleSpec.head_loss`).

    Counted as the MFU's FLOPs (train/mfu.py): 6 per matmul weight and token (forward 2,
    backward 4), attention scores 12 x length x heads x head_dim per token and layer; an MoE
    layer's active weights only (router, top-k experts, shared experts); biases and the
    norms inside the layers left out. Beside the layers: the embedding is a lookup, 2 x
    hidden per token (the gather, then the backward's add into its gradient); the final
    norm about 12 x hidden (4 elementwise passes forward, twice that back); per head row,
    2 x (hidden + 1) x vocab per pass over its logits (the matmul, and the softmax's
    elementwise work). The fused loss makes 3 passes (logits, then both gradients, in its
    forward); the chunked one 4 (the logits, then in its backward the logits again and
    both gradients)."""
    shape = shape_of(cfg)  # the family's declaration: its layers' weights and attention
    hidden = cfg.hidden_size
    scores = 12 * shape.attention_width(cfg) * length
    layers = tuple(6.0 * shape.layer_matmul_params(cfg, i) + scores
                   for i in range(cfg.num_hidden_layers))  # fmt: skip
    vocab = cfg.vocab_size
    passes = HEAD_PASSES[head_loss]
    head = 12.0 * hidden + head_share * passes * 2.0 * (hidden + 1) * vocab
    return LayerCosts(layers, 2.0 * hidden, head)


def split_passes(cfg, length: int) -> tuple[float, float, float]:
    """Estimated (forward, input pass, weight pass) FLOPs per token of the decoder's layers
    under zero bubble's split backward, the `passes` of `bubble_formula`: each matmul
    weight 2 in each pass (as `layer_costs` counts its 6), the attention scores (no
    weight) a third of their 12 x width x length in the forward and the rest, their
    backward, in the input pass."""
    scores = 12.0 * shape_of(cfg).attention_width(cfg) * length * cfg.num_hidden_layers
    weights = (math.fsum(layer_costs(cfg, length, 0.0).layers) - scores) / 6
    return 2 * weights + scores / 3, 2 * weights + 2 * scores / 3, 2 * weights


def balanced_split(costs: LayerCosts, stages: int) -> list[int]:
    """Layers per stage (consecutive, at least one each) that make the stages' costs as
    equal as whole layers allow: the smallest largest stage, and among the splits that
    reach it the smallest sum of squared stage costs (so the lightest stage is not left
    lighter than it needs to be). Exact (dynamic programming over the cut points)."""
    n = len(costs.layers)
    if not 1 <= stages <= n:
        raise ValueError(f"{n} layers cannot fill {stages} stages of at least one layer")
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, s: int) -> float:  # stage s holding layers a..b-1
        return (prefix[b] - prefix[a] + (costs.embedding if s == 0 else 0.0)
                + (costs.head if s == stages - 1 else 0.0))  # fmt: skip

    def spans(s: int):  # the (start, end) a stage s may take: room for the other stages
        for end in range(s + 1, n - (stages - 1 - s) + 1):
            for start in range(s, end):
                yield start, end

    inf = float("inf")
    worst = [[inf] * (n + 1) for _ in range(stages + 1)]  # smallest largest stage so far
    worst[0][0] = 0.0
    for s in range(stages):
        for a, b in spans(s):
            worst[s + 1][b] = min(worst[s + 1][b], max(worst[s][a], cost(a, b, s)))
    bound = worst[stages][n] * (1 + 1e-12)
    squares = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    squares[0][0] = 0.0
    for s in range(stages):
        for a, b in spans(s):
            c = cost(a, b, s)
            if c <= bound and squares[s][a] + c * c < squares[s + 1][b]:
                squares[s + 1][b], cut[s + 1][b] = squares[s][a] + c * c, a
    sizes, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        sizes.append(end - start)
        end = start
    return sizes[::-1]


def bubble_formula(schedule: str, degree: int, microbatches: int, stages_per_rank: int = 1,
                   passes: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:  # fmt: skip
    """The share of a step a rank idles under `schedule` with equal stages and free
    communication: (p - 1) / (v m + p - 1) for gpipe, 1F1B and interleaved 1F1B (p ranks,
    v stages per rank, m micro-batches), whatever the forward and backward cost.

    Zero bubble's depends on what its passes cost, `passes` = (forward F, input pass I,
    weight pass W) of a stage's micro-batch: (p - 1) (F + I - W) / (v m (F + I + W) +
    (p - 1) (F + I - W)), ZB-H1's bubble (p - 1)(T_F + T_B - T_W) from the zero-bubble
    paper, with (p - 1) F when W > I (the weight passes then more than fill what the input
    passes leave). Equal passes (the paper's T_F = T_B = T_W) give (p - 1) / (3 v m + p - 1):
    the weight passes fill all of the drain but one forward per rank step. torch's
    ScheduleInterleavedZeroBubble replayed with such costs gives exactly this
    (tests/unit/test_pipeline_plan.py)."""
    p, m, v = degree, microbatches, stages_per_rank
    if not schedule_spec(schedule).split_backward:
        return (p - 1) / (v * m + p - 1)
    forward, input_pass, weight_pass = passes
    drain = (p - 1) * (forward + max(input_pass - weight_pass, 0.0))
    return drain / (v * m * (forward + input_pass + weight_pass) + drain)


def schedule_idle(order: dict[int, list[tuple[int, str, int]]],
                  costs: dict[tuple[int, str], float]) -> float:  # fmt: skip
    """The largest share of the step a rank idles when every rank runs its actions in
    `order` (rank -> [(stage, kind, micro-batch)], kind F forward, B full backward, I input
    pass, W weight pass), each taking costs[(stage, kind)], as soon as what it needs is
    done: a forward the previous stage's forward of its micro-batch; a backward or input
    pass its own forward and the next stage's backward (or input pass); a weight pass its
    input pass. Communication is free. tests/unit/test_pipeline_plan.py replays torch's
    schedules with equal stages against `bubble_formula`; benchmarks/pipeline.py the order
    a run took with each action's measured time."""
    every = {action for actions in order.values() for action in actions}
    done: dict[tuple[int, str, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)

    def needs(stage: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind == "W":
            return [(stage, "I", mb)]
        later = [(stage + 1, k, mb) for k in ("B", "I") if (stage + 1, k, mb) in every]
        return [(stage, "F", mb), *later]

    while len(done) < len(every):
        progressed = False
        for rank, actions in order.items():
            if position[rank] == len(actions):
                continue
            action = actions[position[rank]]
            deps = needs(*action)
            if not all(d in done for d in deps):
                continue
            cost = costs[action[:2]]
            done[action] = clock[rank] = max([clock[rank], *(done[d] for d in deps)]) + cost
            busy[rank] += cost
            position[rank] += 1
            progressed = True
        if not progressed:
            raise ValueError(f"the actions' order cannot run: {order}")
    makespan = max(clock.values())
    return max(1.0 - b / makespan for b in busy.values())


@dataclass(frozen=True)
class PipelinePlan:
    """How the layers are cut and scheduled: `degree` pp ranks, `stages_per_rank` stages
    each, `layers[s]` the decoder layer indices of stage s, `microbatches` per step;
    `costs[s]` stage s's estimated cost (LayerCosts.stage), `by_hand` when the split came
    from parallel.pipeline_split."""

    degree: int
    schedule: str
    stages_per_rank: int
    microbatches: int
    layers: tuple[tuple[int, ...], ...]
    costs: tuple[float, ...] = ()
    by_hand: bool = False

    @property
    def num_stages(self) -> int:
        return self.degree * self.stages_per_rank

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's `ScheduleSpec`."""
        return schedule_spec(self.schedule)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pp rank `pp_rank` holds, in order."""
        return [pp_rank + k * self.degree for k in range(self.stages_per_rank)]

    def owner(self, stage: int) -> int:
        return stage % self.degree

    @property
    def shares(self) -> tuple[float, ...]:
        """Each stage's share of the estimated cost of the whole model."""
        total = math.fsum(self.costs)
        return tuple(c / total for c in self.costs) if total > 0 else ()

    def describe(self) -> str:
        """The start-up line: the schedule, how the layers were split and each stage's
        layers with its share of the estimated cost."""
        parts = []
        shares = self.shares
        for stage, layers in enumerate(self.layers):
            extra = (["embeddings"] if stage == 0 else []) + (
                ["norm + head"] if stage == self.num_stages - 1 else [])  # fmt: skip
            span = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
            share = f" ({100 * shares[stage]:.1f}%)" if shares else ""
            parts.append(f"stage {stage} (pp rank {self.owner(stage)}): "
                         + " + ".join([span, *extra]) + share)  # fmt: skip
        how = ("split by parallel.pipeline_split" if self.by_hand else
               "split by estimated cost")  # fmt: skip
        if shares:
            how += " (share of the forward + backward FLOPs per token)"
        return (f"pipeline: {self.num_stages} stages over {self.degree} ranks, "
                f"{self.schedule}, {self.microbatches} micro-batches per step, {how}; "
                + "; ".join(parts))  # fmt: skip


def plan_pipeline(degree: int, schedule: str, stages_per_rank: int, microbatches: int | None,
                  split: list[int] | None, costs: LayerCosts, rows: int) -> PipelinePlan:  # fmt: skip
    """The stages' layers and the micro-batch count, or a one-line InputError (pure: no
    process group). costs: the model's LayerCosts (`layer_costs`), which cut the layers when
    `split` (parallel.pipeline_split) is None; rows: the rows one pipeline trains on per step
    (a data-parallel rank's rows x gradient_accumulation_steps), which the micro-batches
    cut."""
    num_layers = len(costs.layers)
    multi = schedule_spec(schedule).multi_stage
    key = f"parallel.pipeline_schedule={schedule}"
    single = [n for n, spec in PIPELINE_SCHEDULES.items() if not spec.multi_stage]
    looped = [n for n, spec in PIPELINE_SCHEDULES.items() if spec.multi_stage]
    if multi and stages_per_rank < 2:
        raise InputError(
            f"{key} interleaves several stages per rank; set parallel.pipeline_stages_per_rank "
            f">= 2 (got {stages_per_rank}), or use pipeline_schedule {' or '.join(single)}"
        )
    if not multi and stages_per_rank > 1:
        raise InputError(
            f"{key} runs one stage per rank, not parallel.pipeline_stages_per_rank="
            f"{stages_per_rank}; use {' or '.join(looped)}, or set it to 1"
        )
    stages = degree * stages_per_rank
    what = (f"parallel.pipeline_parallel={degree} x parallel.pipeline_stages_per_rank="
            f"{stages_per_rank} = {stages} stages" if stages_per_rank > 1
            else f"parallel.pipeline_parallel={degree} stages")  # fmt: skip
    if split is None:
        if num_layers < stages:
            lower = "parallel.pipeline_parallel" + (
                " or parallel.pipeline_stages_per_rank" if stages_per_rank > 1 else "")  # fmt: skip
            raise InputError(
                f"model.num_hidden_layers={num_layers} is fewer than the {what}: each stage "
                f"holds at least one layer; lower {lower}"
            )
        sizes = balanced_split(costs, stages)
    else:
        sizes = list(split)
        if len(sizes) != stages or min(sizes) < 1 or sum(sizes) != num_layers:
            raise InputError(
                f"parallel.pipeline_split={sizes} must give {stages} stages ({what}) at least one "
                f"layer each, {num_layers} layers in all (model.num_hidden_layers)"
            )
    m = rows if microbatches is None else microbatches
    if m < degree:
        raise InputError(
            f"parallel.pipeline_microbatches={m} is fewer than the {degree} pipeline ranks: the "
            f"schedule needs at least one micro-batch per rank; raise it (or the batch) to "
            f">= {degree}"
        )
    if rows % m:
        raise InputError(
            f"parallel.pipeline_microbatches={m} does not divide the {rows} rows a pipeline "
            "trains on per step (rows per data-parallel rank x gradient_accumulation_steps); "
            "use a divisor of them"
        )
    if multi and m % degree:
        raise InputError(
            f"{key} needs parallel.pipeline_microbatches to be a multiple of "
            f"parallel.pipeline_parallel={degree}, got {m}"
        )
    starts = [sum(sizes[:s]) for s in range(stages)]
    layers = tuple(tuple(range(a, a + n)) for a, n in zip(starts, sizes))
    stage_costs = tuple(costs.stage(held, s == 0, s == stages - 1)
                        for s, held in enumerate(layers))  # fmt: skip
    return PipelinePlan(degree, schedule, stages_per_rank, m, layers, stage_costs,
                        by_hand=split is not None)  # fmt: skip


def balancing_notice(plan: PipelinePlan, config, accumulation: int) -> str | None:
    """The start-up line when an MoE model's balancing losses (computed over each forward's
    tokens, models/moe.py) span other tokens than the unpipelined run's: the pipeline's
    forwards are its micro-batches, not the gradient-accumulation micro-batches."""
    coefs = (getattr(config, "router_aux_loss_coef", 0), getattr(config, "router_z_loss_coef", 0))
    if not getattr(config, "num_experts", 0) or not any(coefs) or plan.microbatches == accumulation:
        return None
    return (
        f"the MoE balancing losses span each of the {plan.microbatches} pipeline "
        f"micro-batches, not the {accumulation} gradient-accumulation micro-batches of "
        f"the run without a pipeline: set parallel.pipeline_microbatches={accumulation} "
        "(when the schedule allows) for the same balancing"
    )


class _Part(nn.Module):
    """The `model.` prefix of the whole model (embed_tokens, layers, norm), holding only
    what this rank's stages need, so every parameter keeps its whole-model name."""


class _Layers(nn.Module):
    """Some of the whole model's layers under their own indices ("5" -> layer 5), iterated
    in order like the whole model's ModuleList (decoder_layers, activation checkpointing,
    compile and FSDP2 see the layers this rank holds)."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]


class PipelineModel(nn.Module):
    """This rank's share of a model: its stages' layers (keyed by their index in the whole
    model), the embedding when it holds the first stage, the norm and LM head when it holds
    the last. The optimizer, checkpoints and train()/eval() see this module; the schedule
    runs its `stages` (`StageModule`, one per stage), which share its modules and run the
    model's own forward over their layers (models/shape.py `StagedModel`): `runner`, the
    whole model cut down to what this rank holds.
    """

    def __init__(self, whole: nn.Module, plan: PipelinePlan, pp_rank: int) -> None:
        super().__init__()
        self.config = whole.config
        self.plan = plan
        self.pipeline_group = None  # the pp process group, set by the trainer's runner
        held = plan.stages_of(pp_rank)
        last = plan.num_stages - 1
        self.model = _Part()
        self.model.embed_tokens = whole.model.embed_tokens if 0 in held else None
        self.model.layers = _Layers({i: whole.model.layers[i] for s in held
                                     for i in plan.layers[s]})  # fmt: skip
        self.model.norm = whole.model.norm if last in held else None
        self.lm_head = whole.lm_head if last in held else None
        # the whole model runs the stages' forwards; it holds the same modules as this one
        # (the other ranks' layers dropped) and is not a submodule, so no name changes
        whole.model, whole.lm_head = self.model, self.lm_head
        self.__dict__["runner"] = whole
        # plain list: the stages share these modules and must not rename them
        self.stages = [StageModule(self, s) for s in held]

    @property
    def gradient_checkpointing(self):
        return self.runner.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, flag) -> None:
        self.runner.gradient_checkpointing = flag


class StageModule(nn.Module):
    """One stage's forward: (ids or hidden, side inputs) -> hidden states (B, L, H), or on
    the last stage the weighted cross-entropy sum (0-d float32) over the targets."""

    def __init__(self, owner: PipelineModel, stage: int) -> None:
        super().__init__()
        plan = owner.plan
        self.config = owner.config
        self.__dict__["runner"] = owner.runner  # not a submodule: the parts below are
        self.stage = stage
        self.layer_ids = plan.layers[stage]
        self.is_first = stage == 0
        self.is_last = stage == plan.num_stages - 1
        self.vocab_chunk = 8192
        self.head_loss = plan.spec.head_loss
        # which pass of a split backward runs (set by the schedule's stage, `_stage_class`)
        self.backward_pass = BackwardPass()
        self.embed_tokens = owner.model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(owner.model.layers[i] for i in self.layer_ids)
        self.norm = owner.model.norm if self.is_last else None
        self.lm_head = owner.lm_head if self.is_last else None
        if plan.spec.split_backward:
            defer_weight_gradients(self, self.backward_pass)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                targets: torch.Tensor | None = None,
                target_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x: input ids (B, L) on the first stage, hidden states (B, L, H) after it."""
        selected = None  # the last stage: the target rows' count to the host before the work
        if self.is_last and self.config.loss_implementation != "full":
            selected = SelectedRows(targets)
        x = self.runner.hidden_states(x, doc_ids, position_ids, attention_mask,
                                      layers=self.layer_ids, first=self.is_first,
                                      last=self.is_last)  # fmt: skip
        if not self.is_last:
            return x
        return weighted_loss(x, self.lm_head.weight, targets, target_weights,
                             self.vocab_chunk, self.config.loss_implementation,
                             fused=self.head_loss == "fused", selected=selected)  # fmt: skip


def defer_weight_gradients(module: nn.Module, backward_pass: BackwardPass) -> int:
    """Let module's norms (RMSNorm) and linear layers (nn.Linear and FSDP2's subclass of
    it, whose forward is nn.Linear's; not peft's or bitsandbytes' layers) leave their
    weights' gradients to `backward_pass` while it defers (diffusion/backward.py): a
    zero-bubble stage's input pass. Returns how many layers defer."""
    count = 0
    for sub in module.modules():
        if hasattr(type(sub), "backward_pass"):  # a norm that can defer (models/fused.py)
            sub.backward_pass = backward_pass
        elif isinstance(sub, nn.Linear) and type(sub).forward is nn.Linear.forward:
            sub.backward_pass = backward_pass
            sub.forward = MethodType(deferring_linear_forward, sub)
        else:
            continue
        count += 1
    return count


class ModelCall:
    """A stand-in for the model while an objective builds its loss: records the one call
    it makes (`model(noisy_ids, doc_ids=, position_ids=, targets=, target_weights=, ...)`)
    and returns a placeholder, which must come back as the objective's loss_sum (the loss
    is that one call's weighted sum, which the pipeline then computes over its stages)."""

    accepts_target_weights = True

    def __init__(self, training: bool) -> None:
        self.training = training
        self.calls: list[dict] = []
        self.placeholder = torch.zeros(())

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        self.calls.append({"input_ids": input_ids, **kwargs})
        return self.placeholder


def capture_call(
    objective, batch: dict, generator, training: bool = True
) -> tuple[dict, torch.Tensor]:
    """(the model call the objective's loss is, its count): the call's tensors (input_ids,
    doc_ids, position_ids, attention_mask, targets, target_weights; None when not given)
    and vocab_chunk. RuntimeError when the loss is not exactly one weighted call (the
    registry's accepts_pipeline_parallel says which objectives' are)."""
    stand_in = ModelCall(training)
    loss_sum, count = objective(stand_in, batch, generator)
    call = stand_in.calls[0] if len(stand_in.calls) == 1 else None
    if call is None or loss_sum is not stand_in.placeholder or call.get("target_weights") is None:
        raise RuntimeError(
            f"{type(objective).__name__}'s loss is not one weighted call of the model, so it "
            "cannot run through the pipeline's stages (see ObjectiveSpec."
            "accepts_pipeline_parallel)"
        )
    keys = ("input_ids", "doc_ids", "position_ids", "attention_mask", "targets",
            "target_weights")  # fmt: skip
    return {**{k: call.get(k) for k in keys}, "vocab_chunk": call.get("vocab_chunk", 8192)}, count


def _side_inputs(call: dict, last: bool) -> dict:
    """The keyword inputs a stage takes beside x: the targets only on the last stage."""
    keys = ["doc_ids", "position_ids", "attention_mask"]
    if last:
        keys += ["targets", "target_weights"]
    return {k: call[k] for k in keys if call[k] is not None}


def _stage_class():
    """PipelineStage that also hands every stage its micro-batch's side inputs (a stage's
    kwargs otherwise come only from step(), split for the first stage)."""
    from torch.distributed.pipelining import PipelineStage

    class FedStage(PipelineStage):
        chunk_kwargs: list[dict] = []

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            fed = {**(kwargs or {}), **self.chunk_kwargs[fwd_chunk_id]}
            return super().forward_one_chunk(fwd_chunk_id, args, fed, save_forward_output)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                               last_backward=False):  # fmt: skip
            """The backward, told whether it is a split backward's input pass (zero
            bubble: the weights' gradients deferred to `backward_weight_one_chunk`)."""
            holder = self.submod.backward_pass
            holder.deferring = not full_backward
            try:
                return super().backward_one_chunk(bwd_chunk_id, loss=loss,
                                                  full_backward=full_backward,
                                                  last_backward=last_backward)  # fmt: skip
            finally:
                holder.deferring = False

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            _into_reduce_dtype(self.submod)

    return FedStage


def _into_reduce_dtype(module: nn.Module) -> None:
    """Under FSDP2 mixed precision, the gradients a weight pass just made (bfloat16) added
    into the float32 sums FSDP2 keeps between reduce-scatters, as its own post-backward does
    with the ones autograd made. Without it the schedule's reduce-scatter would get the
    weight pass's bfloat16 gradients beside the input pass's float32 sums in one group (the
    embedding, router and expert stacks get theirs in the input pass), which FSDP2 refuses,
    and would sum a stage's micro-batches in bfloat16. (FSDP2's own per-parameter steps, as
    torch.distributed.pipelining's stage calls FSDP2's internals for its reduce.)"""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return
    for state in fully_shard.state(module)._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                if hasattr(param, "_unsharded_param"):
                    param.accumulate_unsharded_grad_if_needed()
                    param.to_accumulated_grad_if_needed()


class PipelineRunner:
    """Runs a step's micro-batches through this rank's stages with the planned schedule
    (training), or one batch forward only through every stage in turn (evaluation)."""

    def __init__(self, model: PipelineModel, group, device: torch.device,
                 hidden_dtype: torch.dtype) -> None:  # fmt: skip
        """group: this pipeline's pp process group; hidden_dtype: what travels between
        stages (bfloat16 under train.bf16's FSDP2 mixed precision, else float32)."""
        self.model, self.group, self.device = model, group, device
        self.plan = model.plan
        model.pipeline_group = group
        self.hidden_dtype = hidden_dtype
        self.stages: list = []
        self.schedule = None
        self._shape: tuple[int, int] | None = None
        self._scale = torch.ones((), device=device)
        self._sums: list[torch.Tensor] = []

    def _build(self, rows: int, length: int) -> None:
        """The stages and the schedule for micro-batches of `rows` rows of `length` tokens:
        static shapes (no start-up shape exchange), fixed from the first step on."""

        plan, device = self.plan, self.device
        hidden = self.model.config.hidden_size
        # activations carry gradients back (their requires_grad is part of the metadata)
        act = torch.zeros(rows, length, hidden, dtype=self.hidden_dtype, device=device,
                          requires_grad=True)  # fmt: skip
        fed = _stage_class()
        self.stages = []
        for module in self.model.stages:
            inputs = (
                torch.zeros(rows, length, dtype=torch.long, device=device)
                if module.is_first
                else act
            )
            outputs = (torch.zeros((), device=device, requires_grad=True) if module.is_last
                       else act)  # fmt: skip
            # zero bubble: the input pass is one autograd backward whose linear layers and
            # norms leave their weights' gradients to the weight pass, which runs just
            # those (diffusion/backward.py), instead of torch's second graph walk
            split = module.backward_pass.take if plan.spec.split_backward else None
            stage = fed(module, module.stage, plan.num_stages, device, input_args=inputs,
                        output_args=outputs, group=self.group, dw_builder=split)  # fmt: skip
            self.stages.append(stage)
        schedule = plan.spec.schedule_class()
        first_arg = self.stages[0] if plan.stages_per_rank == 1 else self.stages
        self.schedule = schedule(first_arg, plan.microbatches, loss_fn=self._loss,
                                 scale_grads=False)  # fmt: skip
        self._shape = (rows, length)

    @property
    def holds_last(self) -> bool:
        return any(module.is_last for module in self.model.stages)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's weighted sum / the step's global count (target: unused)."""
        self._sums.append(output.detach().float())
        return output * self._scale

    def _split(self, calls: list[dict]) -> tuple[torch.Tensor, list[dict]]:
        """The step's calls joined along rows and cut into the planned micro-batches."""
        m = self.plan.microbatches
        joined = {}
        for key, value in calls[0].items():
            if isinstance(value, torch.Tensor):
                joined[key] = torch.cat([call[key] for call in calls])
            else:
                joined[key] = value
        cut = {k: v.tensor_split(m) if isinstance(v, torch.Tensor) else [v] * m
               for k, v in joined.items()}  # fmt: skip
        return joined["input_ids"], [{k: cut[k][i] for k in cut} for i in range(m)]

    def train_step(self, calls: list[dict], scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of a step's calls (one per gradient-accumulation
        micro-batch, in order) with each micro-batch's loss times `scale` (1 / the step's
        global count); returns the step's weighted loss sum on the ranks that hold the last
        stage (0 elsewhere)."""
        input_ids, chunks = self._split(calls)
        shape = (input_ids.shape[0] // self.plan.microbatches, input_ids.shape[1])
        if self.schedule is None:
            self._build(*shape)
        elif shape != self._shape:
            raise RuntimeError(f"pipeline micro-batches of {shape} (rows, tokens) after "
                               f"{self._shape}: the stages' shapes are fixed")  # fmt: skip
        for stage, module in zip(self.stages, self.model.stages):
            module.vocab_chunk = chunks[0]["vocab_chunk"]
            stage.chunk_kwargs = [_side_inputs(chunk, module.is_last) for chunk in chunks]
        self._scale = scale.detach().float()
        self._sums = []
        holds_first = any(module.is_first for module in self.model.stages)
        args = (input_ids,) if holds_first else ()
        target = (torch.zeros(self.plan.microbatches, device=self.device) if self.holds_last
                  else None)  # fmt: skip
        self.schedule.step(*args, target=target, return_outputs=False)
        total = torch.zeros((), device=self.device)
        for value in self._sums:
            total += value
        return total

    @torch.no_grad()
    def forward_loss(self, call: dict) -> torch.Tensor:
        """The weighted loss sum of one call, forward only, stage after stage (evaluation:
        any number of rows); on the ranks that hold the last stage, 0 elsewhere."""
        plan, x = self.plan, call["input_ids"]
        shape = (*x.shape, self.model.config.hidden_size)
        result = torch.zeros((), device=self.device)
        by_stage = {module.stage: module for module in self.model.stages}
        for stage in range(plan.num_stages):
            module = by_stage.get(stage)
            if module is None:
                continue
            module.vocab_chunk = call["vocab_chunk"]
            if stage > 0:
                x = torch.empty(shape, dtype=self.hidden_dtype, device=self.device)
                dist.recv(x, group=self.group, group_src=plan.owner(stage - 1))
            out = module(x, **_side_inputs(call, module.is_last))
            if module.is_last:
                result = out.detach().float()
            else:
                dist.send(out.to(self.hidden_dtype).contiguous(), group=self.group,
                          group_dst=plan.owner(stage + 1))  # fmt: skip
        return result

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """value summed over this pipeline's ranks (a last-stage number to every stage)."""
        value = value.detach().float().clone()
        dist.all_reduce(value, group=self.group)
        return value
