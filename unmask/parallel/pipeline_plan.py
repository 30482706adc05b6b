"""Planning a pipeline: how the decoder's layers are cut into stages and how many
micro-batches flow, before any process group exists (the trainer and `unmask plan` both
plan here, through train/setup.py `pipeline_plan`; the runtime is parallel/pipeline.py).

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

from unmask.errors import InputError
from unmask.models.families import FAMILIES
from unmask.models.shape import matmul_flops
from unmask.parallel.schedules import HEAD_PASSES, PIPELINE_SCHEDULES, ScheduleSpec, schedule_spec


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
    shape = FAMILIES[cfg.model_type].shape  # the family's declaration: its layers' weights
    hidden = cfg.hidden_size
    width = shape.attention_width(cfg)
    layers = tuple(float(matmul_flops(shape.layer_matmul_params(cfg, i), 1, width, 1, length))
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
    shape = FAMILIES[cfg.model_type].shape  # a native decoder's family's declaration
    scores = 12.0 * shape.attention_width(cfg) * length * cfg.num_hidden_layers
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
