"""`diffusion.objective: grpo`: group rollouts with unmask's sampler, rewards, group
advantages and a policy loss on estimated log-likelihoods (docs/diffusion.md,
Post-training), with the trainer's Objective signature.

One call on a micro-batch of B prompt/answer rows:
  1. rollouts (no grad, eval mode): each row's prompt (its tokens before the first maskable
     one) gets G completions from `sample`, one call per prompt, seeded by the prompt's own
     seed (drawn for the whole global batch in `with_noise`): rollouts do not depend on the
     world size or on which rows share a micro-batch;
  2. rewards(prompts, completions, records), records = {"prompt", "answer"} (the row's
     reference answer: its maskable tokens before EOS, decoded);
  3. advantages: reward - group mean, divided by the group std (`scale_rewards: group`;
     a group whose rewards are all equal gets 0, not 0/0);
  4. the loss of `grpo.loss` on the estimator's passes (estimators.py).
With inner_iterations mu > 1 the rollouts of step s (s a multiple of mu) serve steps s ..
s + mu - 1; iteration j's estimator noise is fixed at rollout time and the old
log-likelihoods are measured then, so the ratio starts at 1 and the clip acts afterwards.
A checkpoint written inside such a cycle carries each rank's cached rollouts (`rank_state`),
so a resumed run uses the same rollouts, advantages, seeds and old log-likelihoods.
"""

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from unmask.diffusion.objectives import (
    MaskedDiffusionObjective,
    Objective,
    ObjectiveOutput,
    maskable_of,
)
from unmask.errors import InputError
from unmask.posttrain.config import GRPOConfig
from unmask.posttrain.estimators import Passes, Rows, estimate, upper_bound_tokens
from unmask.sampling.accuracy import decode_answer
from unmask.sampling.generate import sample

_SEED_LIMIT = 2**62


# ------------------------------------------------------------------ pure loss math


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str) -> torch.Tensor:
    """(R,) advantages of rewards (R,) in groups of group_size consecutive rows: r - mean
    (over the group), divided by the group's std (unbiased, as GRPO) when scale is `group`;
    a group with std 0 (every completion scored alike) gets 0 everywhere."""
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale == "group":
        std = grouped.std(1, keepdim=True)
        centred = torch.where(std > 0, centred / std.clamp_min(1e-12), torch.zeros_like(centred))
    return centred.reshape(-1)


def kl_k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    diff = ref - logp
    return diff.exp() - diff - 1.0


def diffu_grpo_loss(token_logps, old_logps, advantages, scored, epsilon: float,
                    beta: float = 0.0, ref_logps=None) -> tuple[ObjectiveOutput, dict]:  # fmt: skip
    """d1's diffu-GRPO: per token -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + beta KL,
    rho = exp(logp - old); summed over scored tokens, count = scored tokens (the mean over
    all completion tokens of the batch, as d1's code)."""
    ratio = (token_logps - old_logps).exp()
    adv = advantages.float()[:, None]
    unclipped, clipped = ratio * adv, ratio.clamp(1.0 - epsilon, 1.0 + epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped)
    stats = {"clip_fraction": ((clipped < unclipped) & scored).float().sum()}
    if beta > 0:
        kl = kl_k3(token_logps, ref_logps)
        per_token = per_token + beta * kl
        stats["kl_sum"] = torch.where(scored, kl, 0.0).detach().sum()
    loss_sum = torch.where(scored, per_token, torch.zeros_like(per_token)).sum()
    return ObjectiveOutput(loss_sum, scored.sum().float()), stats


def wd1_loss(token_logps, advantages, scored, group_size: int) -> ObjectiveOutput:
    """wd1: -sum_i (w+_i - w-_i) log pi(o_i), w+ = softmax(A) and w- = softmax(-A) within each
    group, log pi(o_i) the sequence estimate (sum over scored tokens); count = groups."""
    seq = torch.where(scored, token_logps, torch.zeros_like(token_logps)).sum(1)
    adv = advantages.float().view(-1, group_size)
    weights = (adv.softmax(1) - (-adv).softmax(1)).reshape(-1)
    return ObjectiveOutput(-(weights * seq).sum(), torch.tensor(float(adv.shape[0])))


def spg_loss(passes: Passes, advantages, scored, beta: float, mix: float) -> ObjectiveOutput:
    """SPG: sequence bound b_i = the per-token mean of the estimator's log-likelihood (ELBO)
    when A_i > 0, else mix * EUBO + (1 - mix) * ELBO, EUBO's token term
    (1/beta) log sum_k w_k p_k^beta; loss = sum_i -A_i b_i |o_i| over sum_i |o_i|."""
    lengths = scored.sum(1).float()
    token = passes.token_estimates()
    elbo = torch.where(scored, token, 0.0).sum(1) / lengths.clamp_min(1.0)
    upper, defined = upper_bound_tokens(passes, beta)
    defined = defined & scored
    eubo = torch.where(defined, upper, 0.0).sum(1) / defined.sum(1).clamp_min(1).float()
    negative = mix * eubo + (1.0 - mix) * elbo
    bound = torch.where(advantages > 0, elbo, negative)
    return ObjectiveOutput((-advantages.float() * bound * lengths).sum(), lengths.sum())


# ------------------------------------------------------------------ rollouts


class Rollouts(NamedTuple):
    """One micro-batch's completions, scored: what inner iterations reuse."""

    rows: Rows
    advantages: torch.Tensor  # (R,)
    seeds: list[int]  # one per prompt
    old_logps: torch.Tensor | None  # (mu, R, L) token estimates at rollout time (mu > 1)


def rollouts_to_dict(rollouts: Rollouts) -> dict:
    """Rollouts as a dict of CPU tensors, ints and None: what torch.load(weights_only=True)
    reads back."""
    rows = {name: (None if value is None else value.detach().cpu())
            for name, value in rollouts.rows._asdict().items()}  # fmt: skip
    old = rollouts.old_logps
    return {"rows": rows, "advantages": rollouts.advantages.detach().cpu(),
            "seeds": [int(s) for s in rollouts.seeds],
            "old_logps": None if old is None else old.detach().cpu()}  # fmt: skip


def rollouts_from_dict(state: dict) -> Rollouts:
    """The inverse of rollouts_to_dict (tensors where they were loaded)."""
    return Rollouts(Rows(**state["rows"]), state["advantages"],
                    [int(s) for s in state["seeds"]], state["old_logps"])  # fmt: skip


def prompt_answer(input_ids: torch.Tensor, maskable: torch.Tensor, eos_id: int):
    """(prompt ids, reference answer ids) of one row: the tokens before its first maskable
    one, and the maskable ones before EOS. ValueError for a row without a prompt."""
    where = maskable.nonzero()
    if where.numel() == 0 or int(where[0]) == 0:
        raise InputError(
            "diffusion.objective grpo needs prompt/answer rows (the synthetic tasks, or "
            "prompt/response or messages records with data.packing: false); a row has no "
            "prompt"
        )
    start = int(where[0])
    answer = input_ids[maskable].tolist()
    answer = answer[: answer.index(eos_id)] if eos_id in answer else answer
    return input_ids[:start], answer


def stack_rows(sequences: list[torch.Tensor], prompt_lengths: list[int], eos_id: int) -> Rows:
    """Rows from each group's (G, P_i + C_i) canvases: EOS fill (hidden by doc id 1) up to
    the longest; scored = completion up to and including its first EOS."""
    width = max(s.shape[1] for s in sequences)
    ids, prompt, canvas, doc = [], [], [], []
    for seq, plen in zip(sequences, prompt_lengths):
        g, length = seq.shape
        fill = torch.full((g, width - length), eos_id, dtype=seq.dtype, device=seq.device)
        ids.append(torch.cat([seq, fill], 1))
        pos = torch.arange(width, device=seq.device)[None].expand(g, width)
        prompt.append(pos < plen)
        canvas.append((pos >= plen) & (pos < length))
        doc.append((pos >= length).long())
    ids, prompt, canvas, doc = (torch.cat(x) for x in (ids, prompt, canvas, doc))
    is_eos = (ids == eos_id) & canvas
    before = is_eos.long().cumsum(1) - is_eos.long()
    scored = canvas & (before == 0)
    return Rows(ids, prompt, canvas, scored, doc if bool(doc.any()) else None)


def shuffled_in_groups(values: torch.Tensor, seeds: list[int], group_size: int) -> torch.Tensor:
    """values (R,) with each group's entries permuted by a generator seeded from its seed."""
    out = values.clone()
    for i, seed in enumerate(seeds):
        gen = torch.Generator().manual_seed((seed * 31 + 5) % _SEED_LIMIT)
        order = torch.randperm(group_size, generator=gen).to(values.device)
        out[i * group_size : (i + 1) * group_size] = values[i * group_size + order]
    return out


def group_random(seeds: list[int], group_size: int, device, salt: int) -> Callable:
    """rand(shape) -> (len(seeds) * group_size, *shape) uniforms, each group's from its own
    generator seeded by (seed, salt): independent of how groups are batched."""
    generators = []
    for seed in seeds:
        gen = torch.Generator(device=device)
        gen.manual_seed((seed * 1_000_003 + salt * 7919 + 17) % _SEED_LIMIT)
        generators.append(gen)

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([torch.rand((group_size, *shape), generator=g, device=device)
                          for g in generators])  # fmt: skip

    return rand


@contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """An FSDP2 model's weights gathered once for the whole rollout, so sampling runs no
    collective: ranks decode different numbers of steps (EOS, threshold decoding), which
    per-forward all-gathers would deadlock. Each FSDP unit is unsharded, kept so through its
    forwards, and resharded after, with its reshard-after-forward setting restored. A model
    without FSDP units is left alone."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        saved.append((state._auto_reshard_after_forward,
                       [g.post_forward_mesh_info for g in state._fsdp_param_groups]))  # fmt: skip
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, (auto, infos) in zip(units, saved):
            unit.reshard()
            state = unit._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info


# ------------------------------------------------------------------ the objective


class GRPOObjective(Objective):
    """Diffusion GRPO / wd1 / SPG with the trainer's Objective signature (module doc).

    rewards(prompts, completions, records) returns an object with `total` (R,) and
    `per_reward` {name: (R,)} (unmask.rewards.RewardSet); `failures` / `failure_lines`
    are logged when present. reference: how to run the frozen reference model for the KL
    (a context manager factory taking the model: peft's disable_adapter), or None."""

    global_noise = True  # with_noise draws each prompt's seed for the whole global batch

    def __init__(self, cfg: GRPOConfig, rewards, tokenizer, mask_id: int, eos_id: int,
                 sampling, *, time_eps: float = 1e-3, vocab_chunk: int = 8192,
                 reference: Callable | None = None, eval_objective=None):  # fmt: skip
        if cfg.kl_beta > 0 and reference is None:
            raise InputError(
                "grpo.kl_beta > 0 needs a frozen reference: set model.lora: true (the base "
                "weights are the reference) or grpo.kl_beta: 0"
            )
        self.cfg, self.rewards, self.tokenizer = cfg, rewards, tokenizer
        self.mask_id, self.eos_id = mask_id, eos_id
        self.sampling = sampling
        self.time_eps, self.vocab_chunk = time_eps, vocab_chunk
        self.reference = reference
        self.eval_objective = eval_objective
        self.step = 0
        self._micro = 0  # calls since begin_step: the micro-batch index
        self._cache: dict[int, Rollouts] = {}
        self._cycle = -1  # the step whose rollouts are cached (a multiple of mu)
        self._log = _RolloutLog()
        self.last_stats: dict[str, torch.Tensor] = {}

    # -- the trainer's hooks -------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """The trainer's step number before its micro-batches (inner iterations)."""
        self.step, self._micro = step, 0
        cycle = step - step % self.cfg.inner_iterations
        if cycle != self._cycle:  # a new cycle (every step when mu = 1): fresh rollouts
            self._cache.clear()
            self._cycle = cycle

    def with_noise(self, batch: dict, generator: torch.Generator | None = None,
                   rows=None) -> dict:  # fmt: skip
        """The batch with `rollout_seed` (B,) drawn for the whole global batch (rows =
        (offset, total)) and this slice kept."""
        b = batch["input_ids"].shape[0]
        offset, total = rows if rows is not None else (0, b)
        device = generator.device if generator is not None else "cpu"
        seeds = torch.randint(0, _SEED_LIMIT, (total,), generator=generator, device=device)
        return {**batch, "rollout_seed": seeds[offset : offset + b]}

    def count(self, batch: dict) -> None:
        """Unknown before the rollouts (the completion tokens): the trainer scales after."""
        return None

    def close(self) -> None:
        """Stop the rewards' worker processes (the trainer calls this when train() ends)."""
        close = getattr(self.rewards, "close", None)
        if close is not None:
            close()

    def rank_state(self) -> dict:
        """What the steps after the last begun one need from this rank: its cached rollouts
        (tensors on the CPU, seeds as ints) while their cycle has steps left, else {}."""
        mu = self.cfg.inner_iterations
        if not self._cache or (self.step + 1) % mu == 0:
            return {}
        cached = [
            {"micro": micro, **rollouts_to_dict(r)} for micro, r in sorted(self._cache.items())
        ]
        return {"cycle_start": self._cycle, "inner_iterations": mu,
                "group_size": self.cfg.group_size, "rollouts": cached}  # fmt: skip

    def load_rank_state(self, state: dict) -> str | None:
        """Restore `rank_state()`'s rollouts (tensors already on this rank's device); {}
        forgets any cached ones. Returns None, or why they were left out (they were drawn
        with another grpo.inner_iterations or grpo.group_size): then the next step draws
        fresh ones."""
        self._cache.clear()
        self._cycle = -1
        if not state:
            return None
        for key in ("inner_iterations", "group_size"):
            saved, now = int(state[key]), getattr(self.cfg, key)
            if saved != now:
                return f"they were drawn with grpo.{key} {saved}, this run has {now}"
        self._cache = {int(r["micro"]): rollouts_from_dict(r) for r in state["rollouts"]}
        self._cycle = int(state["cycle_start"])
        return None

    def take_log(self) -> dict:
        """Rollout metrics since the last call (reward mean/std per reward, length, KL, ...)."""
        return self._log.take()

    # -- one micro-batch -----------------------------------------------------------------
    def __call__(self, model: nn.Module, batch: dict, generator=None) -> ObjectiveOutput:
        micro, self._micro = self._micro, self._micro + 1
        iteration = self.step % self.cfg.inner_iterations
        rollouts = self._cache.get(micro)
        if rollouts is None:
            if "rollout_seed" not in batch:
                batch = self.with_noise(batch, generator)
            rollouts = self.rollout(model, batch)
            if self.cfg.inner_iterations > 1:
                self._cache[micro] = rollouts
        return self.loss(model, rollouts, iteration)

    def rollout(self, model: nn.Module, batch: dict) -> Rollouts:
        """Sample, decode, score, advantages (and old log-likelihoods when mu > 1)."""
        g, eos = self.cfg.group_size, self.eos_id
        input_ids, maskable = batch["input_ids"], maskable_of(batch)
        seeds = [int(s) for s in batch["rollout_seed"].tolist()]
        was_training = model.training
        model.eval()
        started = time.perf_counter()
        sequences, prompt_lengths, prompts, records = [], [], [], []
        try:
            with torch.no_grad(), unsharded(model):
                for row, seed in enumerate(seeds):
                    prompt, answer = prompt_answer(input_ids[row], maskable[row], eos)
                    gen = torch.Generator(device=input_ids.device)
                    gen.manual_seed(seed)
                    out = sample(model, prompt[None].expand(g, -1), self.sampling,
                                 mask_id=self.mask_id, eos_id=eos, generator=gen)  # fmt: skip
                    sequences.append(out.sequences)
                    prompt_lengths.append(prompt.numel())
                    text = self.tokenizer.decode(prompt.tolist(), skip_special_tokens=True)
                    prompts.append(text)
                    records.append({"prompt": text, "answer": decode_answer(self.tokenizer,
                                                                            answer)})  # fmt: skip
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - started
        rows = stack_rows(sequences, prompt_lengths, eos)
        completions = [
            decode_answer(self.tokenizer, seq[plen:].tolist())
            for seq_group, plen in zip(sequences, prompt_lengths)
            for seq in seq_group
        ]
        prompts_r = [p for p in prompts for _ in range(g)]
        records_r = [r for r in records for _ in range(g)]
        scores = self.rewards(prompts_r, completions, records_r)
        total = torch.as_tensor(scores.total, dtype=torch.float32, device=input_ids.device)
        if self.cfg.shuffle_rewards:
            total = shuffled_in_groups(total, seeds, g)
        advantages = group_advantages(total, g, self.cfg.scale_rewards)
        old = None
        if self.cfg.inner_iterations > 1:
            with torch.no_grad():
                old = torch.stack([self._passes(model, rows, seeds, j).token_estimates()
                                   for j in range(self.cfg.inner_iterations)])  # fmt: skip
        self._log.add_rollouts(scores, total, advantages, rows, g, seconds,
                               prompts_r, completions, records_r, self.cfg.log_samples)  # fmt: skip
        return Rollouts(rows, advantages, seeds, old)

    def _passes(self, model, rows: Rows, seeds: list[int], iteration: int) -> Passes:
        cfg = self.cfg
        rand = group_random(seeds, cfg.group_size, rows.ids.device, iteration)
        return estimate(cfg.estimator, model, rows, rand, self.mask_id, self.vocab_chunk,
                        prompt_mask_prob=cfg.prompt_mask_prob, samples=cfg.mc_samples,
                        how=cfg.mc_time, time_eps=self.time_eps)  # fmt: skip

    def loss(self, model: nn.Module, rollouts: Rollouts, iteration: int) -> ObjectiveOutput:
        """The policy loss on cached or fresh rollouts at inner iteration `iteration`."""
        cfg, rows = self.cfg, rollouts.rows
        passes = self._passes(model, rows, rollouts.seeds, iteration)
        token = passes.token_estimates()
        if cfg.loss == "wd1":
            out = wd1_loss(token, rollouts.advantages, rows.scored, cfg.group_size)
        elif cfg.loss == "spg":
            out = spg_loss(passes, rollouts.advantages, rows.scored, cfg.spg_beta, cfg.spg_mix)
        else:
            old = token.detach() if rollouts.old_logps is None else rollouts.old_logps[iteration]
            ref = None
            if cfg.kl_beta > 0:
                with torch.no_grad(), self.reference(model):
                    ref = self._passes(model, rows, rollouts.seeds, iteration).token_estimates()
            out, stats = diffu_grpo_loss(token, old, rollouts.advantages, rows.scored,
                                         cfg.clip_epsilon, cfg.kl_beta, ref)  # fmt: skip
            self._log.add_loss_stats(stats, rows.scored.sum())
        self.last_stats = {"num_masked": (passes.weights > 0).sum().detach().float()}
        return out


class _RolloutLog:
    """Rollout metrics summed over calls until `take` (host floats: rollouts sync anyway)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.samples: list[dict] = []
        self.failure_lines: list[str] = []  # what a reward that failed said (first 5)
        self.generations = 0
        self.seconds = 0.0

    def _add(self, key: str, value: float, n: int = 1) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + n

    def add_rollouts(self, scores, total, advantages, rows: Rows, g: int, seconds: float,
                     prompts, completions, records, keep: int) -> None:  # fmt: skip
        per_reward = {
            "reward": total,
            **{
                f"reward/{k}": torch.as_tensor(v, dtype=torch.float32)
                for k, v in getattr(scores, "per_reward", {}).items()
            },
        }
        for name, values in per_reward.items():
            values = values.float().cpu()
            self._add(f"{name}_mean", float(values.mean()))
            self._add(f"{name}_std", float(values.std()) if values.numel() > 1 else 0.0)
        lengths = rows.scored.sum(1).float()
        self._add("completion_length", float(lengths.mean()))
        zero = (advantages.view(-1, g).abs().amax(1) == 0).float()
        self._add("zero_advantage_groups", float(zero.mean()))
        for name, count in getattr(scores, "failures", {}).items():
            self._add(f"reward_failures/{name}", float(count), 0)
        self.failure_lines += list(getattr(scores, "failure_lines", []))[
            : 5 - len(self.failure_lines)
        ]
        self.generations += len(completions)
        self.seconds += seconds
        for i in range(min(keep - len(self.samples), len(completions))):
            index = i * g  # the first completion of each of the first prompts
            if index >= len(completions):
                break
            self.samples.append({"prompt": prompts[index], "completion": completions[index],
                                 "answer": records[index].get("answer"),
                                 "reward": round(float(total[index]), 4)})  # fmt: skip

    def add_loss_stats(self, stats: dict, tokens: torch.Tensor) -> None:
        n = max(float(tokens), 1.0)
        self._add("clip_fraction", float(stats["clip_fraction"]) / n)
        if "kl_sum" in stats:
            self._add("kl", float(stats["kl_sum"]) / n)

    def take(self) -> dict:
        values = {}
        for key, total in self.sums.items():
            n = self.counts[key]
            values[key] = total if n == 0 else total / n
        if self.generations:
            values["generations_per_second"] = self.generations / max(self.seconds, 1e-9)
        if self.samples:
            values["samples"] = self.samples
        if self.failure_lines:
            values["reward_failure_lines"] = self.failure_lines
        self.__init__()
        return {
            k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in values.items()
        }


def build_eval_objective(diffusion_cfg, mask_id: int, eos_id: int) -> MaskedDiffusionObjective:
    """Eval loss of a grpo run: the masked-diffusion loss of the held-out reference answers
    (does the policy still give them likelihood)."""
    objective = MaskedDiffusionObjective(diffusion_cfg, mask_id, eos_id)
    return objective
