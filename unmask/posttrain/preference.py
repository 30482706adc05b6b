"""`diffusion.objective: preference`: DPO on ELBO estimates with VRPO's variance reduction.

LLaDA 1.5 (Zhu et al. 2025, arXiv 2505.19223) replaces DPO's exact log-likelihoods by
Monte Carlo ELBOs of each completion y given its prompt x:

    B_pi(y) = mean over k = 1..n of  -w(t_k) * sum over masked i of CE_pi(y_i | y_{t_k}, x)

(w(t) = 1/t for the linear schedule: the MDLM / LLaDA bound) and minimizes

    -log sigmoid(beta * [(B_pi(y_w) - B_ref(y_w)) - (B_pi(y_l) - B_ref(y_l))])

per pair (y_w chosen, y_l rejected). The variance of the score inside the sigmoid is what
biases the loss and its gradient, so (VRPO):

- one mask per noise level: n draws of (t, mask), not fewer t with several masks each;
- the reference scores the very same noisy inputs as the policy (`shared_noise`): the
  Monte Carlo noise of B_pi - B_ref then largely cancels (exactly, while pi = ref);
- the n noise levels of a completion are spread over [0, 1) (`t_sampling`: `stratified`
  u_k = (u + k) / n, or `antithetic` pairs u, 1 - u) instead of drawn independently.

Chosen and rejected of a pair are scored at the same noise levels (with their own masks).
The reference is the frozen starting model: the policy with its LoRA adapters disabled
(peft's `disable_adapter`, no second copy), else a frozen copy of the starting weights
held by the trainer. Reference ELBOs run under no_grad.

Batch layout (pairs.py): the chosen rows as `input_ids`, `maskable`, `doc_ids`,
`position_ids` (B, L), the rejected rows under the same names prefixed `rejected_`.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.loss import IGNORE_INDEX
from unmask.diffusion.noise import RowSlice, loss_weight, mask_prob, rand_rows
from unmask.diffusion.objectives import Objective, ObjectiveOutput

SIDES = ("chosen", "rejected")
ROW_KEYS = ("input_ids", "maskable", "doc_ids", "position_ids")
NOISE_KEYS = ("pref_t", "pref_chosen_masked", "pref_rejected_masked")
REF_NOISE_KEYS = ("pref_ref_t", "pref_ref_chosen_masked", "pref_ref_rejected_masked")


class PreferenceConfig(BaseModel):
    """The `preference:` section (diffusion.objective: preference; docs/diffusion.md,
    Preference optimization)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    beta: float = Field(0.1, gt=0.0)
    """DPO's inverse temperature: how far the policy may move from the reference."""

    num_samples: int = Field(8, ge=1)
    """n: (t, mask) draws per completion and step for each ELBO; one mask per noise level
    (VRPO's optimal allocation). Each step runs 2 * n rows per pair through the policy and
    again through the reference."""

    t_sampling: Literal["stratified", "antithetic", "uniform"] = "stratified"
    """How a completion's n noise levels are drawn: `stratified` u_k = (u + k) / n (one per
    stratum of [0, 1)), `antithetic` pairs (u, 1 - u), `uniform` independent."""

    chosen_nll_weight: float = Field(0.0, ge=0.0)
    """alpha >= 0 adds alpha * (-B_pi(y_w)) / |y_w| per pair: the chosen completion's
    negative ELBO per maskable token (the NLL term of Pang et al. 2024's iterative RPO), which
    keeps DPO from lowering the chosen answers' likelihood along with the rejected ones'.
    0: plain DPO (VRPO)."""

    shared_noise: bool = True
    """The reference scores the same noisy inputs as the policy (VRPO's antithetic
    sampling). false: independent noise for the reference (for comparison only)."""


def draw_levels(
    pairs: int, n: int, method: str, eps: float, generator, device, rows: RowSlice | None
) -> torch.Tensor:
    """(pairs, n) noise levels in [eps, 1); rows: these pairs are a slice of a larger batch
    whose draws are made whole (`RowSlice`), so a pair's levels do not depend on the rank."""
    if method == "stratified":
        u0 = rand_rows((pairs, 1), rows, generator, device)
        u = (u0 + torch.arange(n, device=device, dtype=torch.float32)) / n
    elif method == "antithetic":
        half = rand_rows((pairs, (n + 1) // 2), rows, generator, device)
        u = torch.cat([half, 1.0 - half], dim=1)[:, :n]
    elif method == "uniform":
        u = rand_rows((pairs, n), rows, generator, device)
    else:
        raise ValueError(
            f"unknown t sampling {method!r}; expected stratified, antithetic or uniform"
        )
    return (1.0 - eps) * u.clamp(max=1.0 - 1e-7) + eps


def draw_masks(
    maskable: torch.Tensor, t: torch.Tensor, schedule: str, generator, rows: RowSlice | None
) -> torch.Tensor:
    """(P, n, L) bool: each maskable token masked with probability mask_prob(t) of its draw;
    maskable (P, L), t (P, n)."""
    pairs, length = maskable.shape
    u = rand_rows((pairs, t.shape[1], length), rows, generator, maskable.device)
    return (u < mask_prob(t, schedule)[..., None]) & maskable[:, None, :]


def dpo_terms(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss and reward margin from ELBOs (P, 2) [chosen, rejected]:
    rewards beta * (B_pi - B_ref); loss = -log sigmoid(chosen reward - rejected reward)."""
    rewards = beta * (policy - reference)  # (P, 2)
    margin = rewards[:, 0] - rewards[:, 1]
    return -F.logsigmoid(margin), margin


class PreferenceObjective(Objective):
    """DPO on ELBO estimates (module docstring). count = the number of pairs, so the
    trainer's global normalization is the mean over pairs across micro-batches and ranks.

    reference: a frozen module, or None to score the reference with the policy's LoRA
    adapters disabled (peft). After each call `step_sums` holds detached sums over the
    call's pairs (`reward_margin`, `reward_accuracy`, `reward_chosen`, `reward_rejected`),
    which the trainer divides by the step's pairs for metrics.jsonl.
    """

    #: each pair's noise is drawn on its own (rows of one global draw): losses do not
    #: depend on the world size
    global_noise = True

    def __init__(
        self,
        cfg: PreferenceConfig,
        diffusion: DiffusionConfig,
        mask_id: int,
        reference: nn.Module | None = None,
    ):
        self.cfg, self.diffusion, self.mask_id = cfg, diffusion, mask_id
        self.reference = reference
        if reference is not None:
            reference.requires_grad_(False)
        self.last_stats: dict[str, torch.Tensor] = {}
        self.step_sums: dict[str, torch.Tensor] = {}

    def count(self, batch: dict) -> torch.Tensor:
        return torch.tensor(float(batch["input_ids"].shape[0]), device=batch["input_ids"].device)

    # -- noise ---------------------------------------------------------------------------
    def _draw(self, batch: dict, generator, rows: RowSlice | None, keys: tuple) -> dict:
        d, n = self.diffusion, self.cfg.num_samples
        pairs, device = batch["input_ids"].shape[0], batch["input_ids"].device
        t = draw_levels(pairs, n, self.cfg.t_sampling, d.time_eps, generator, device, rows)
        out = {keys[0]: t}
        for side, key in zip(SIDES, keys[1:]):
            maskable = _side(batch, side)["maskable"].bool()
            out[key] = draw_masks(maskable, t, d.schedule, generator, rows)
        return out

    def with_noise(
        self, batch: dict, generator: torch.Generator | None = None, rows: RowSlice | None = None
    ) -> dict:
        """The batch with its noise drawn: levels (P, n) and masks (P, n, L) per side (and
        the reference's own when shared_noise is false); rows: see `RowSlice`."""
        if all(k in batch for k in NOISE_KEYS):
            return batch
        drawn = self._draw(batch, generator, rows, NOISE_KEYS)
        if not self.cfg.shared_noise:
            drawn.update(self._draw(batch, generator, rows, REF_NOISE_KEYS))
        return {**batch, **drawn}

    # -- ELBOs ---------------------------------------------------------------------------
    def elbos(self, model: nn.Module, batch: dict, keys: tuple) -> torch.Tensor:
        """(P, 2) ELBO estimates [chosen, rejected] of `model` under the batch's noise
        `keys`; one forward over the 2 * P * n noisy rows."""
        t = batch[keys[0]]  # (P, n)
        pairs, n = t.shape
        ids, masked, extra = [], [], {"doc_ids": [], "position_ids": []}
        for side, key in zip(SIDES, keys[1:]):
            rows = _side(batch, side)
            ids.append(rows["input_ids"][:, None].expand(-1, n, -1))
            masked.append(batch[key])
            for name in extra:
                if rows.get(name) is not None:
                    extra[name].append(rows[name][:, None].expand(-1, n, -1))
        length = ids[0].shape[-1]
        clean = torch.stack(ids, 1).reshape(-1, length)  # (P * 2 * n, L)
        hidden = torch.stack(masked, 1).reshape(-1, length)
        noisy = torch.where(hidden, self.mask_id, clean)
        targets = torch.where(hidden, clean, IGNORE_INDEX)
        kwargs = {k: torch.stack(v, 1).reshape(-1, length) if len(v) == 2 else None
                  for k, v in extra.items()}  # fmt: skip
        ce = model(
            noisy, targets=targets, vocab_chunk=self.diffusion.vocab_chunk_size, **kwargs
        )  # (P * 2 * n, L) fmt: skip
        weight = loss_weight(t, self.diffusion.loss_weight, self.diffusion.schedule)  # (P, n)
        per_draw = ce.float().sum(1).view(pairs, 2, n) * weight[:, None, :]
        return -per_draw.mean(2)

    @torch.no_grad()
    def reference_elbos(self, model: nn.Module, batch: dict) -> torch.Tensor:
        keys = NOISE_KEYS if self.cfg.shared_noise else REF_NOISE_KEYS
        if self.reference is not None:
            return self.elbos(self.reference, batch, keys)
        with adapters_disabled(model):
            return self.elbos(model, batch, keys)

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        batch = self.with_noise(batch, generator)
        reference = self.reference_elbos(model, batch)
        policy = self.elbos(model, batch, NOISE_KEYS)
        losses, margin = dpo_terms(policy, reference.float(), self.cfg.beta)
        if self.cfg.chosen_nll_weight > 0:  # RPO's NLL term on the chosen completion
            tokens = batch["maskable"].sum(1).clamp(min=1).float()
            losses = losses - self.cfg.chosen_nll_weight * policy[:, 0] / tokens
        margin, rewards = margin.detach(), self.cfg.beta * (policy.detach() - reference.float())
        self.step_sums = {
            "reward_margin": margin.sum(),
            "reward_accuracy": (margin > 0).float().sum(),
            "reward_chosen": rewards[:, 0].sum(),
            "reward_rejected": rewards[:, 1].sum(),
        }
        t = batch[NOISE_KEYS[0]]
        masked = batch[NOISE_KEYS[1]].sum() + batch[NOISE_KEYS[2]].sum()
        self.last_stats = {"mean_t": t.detach().float().mean(),
                           "num_masked": masked.detach().float()}  # fmt: skip
        return ObjectiveOutput(losses.sum(), self.count(batch))


def _side(batch: dict, side: str) -> dict:
    """The chosen (unprefixed keys) or rejected (`rejected_` keys) rows of a pair batch."""
    prefix = "" if side == "chosen" else "rejected_"
    return {k: batch.get(prefix + k) for k in ROW_KEYS}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The peft model's base weights for the block (its LoRA adapters off)."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        raise ValueError("the preference reference is the base under LoRA: the model has no "
                         "adapters to disable; pass a frozen reference model")  # fmt: skip
    with disable():
        yield


def reference_memory_note(num_params: int, bytes_per_param: int) -> str:
    """What the frozen reference copy costs (shown at start-up)."""
    gib = num_params * bytes_per_param / 2**30
    return (f"preference: the frozen reference is a second copy of the weights "
            f"({gib:.2f} GiB); model.lora: true scores it with the adapters off instead")  # fmt: skip
