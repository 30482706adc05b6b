"""The autoregressive baseline: next-token causal language modelling (`diffusion.objective:
ar`) on the same rows, config and layouts as the diffusion objectives.

An `ar` model is the same native decoder run under a causal mask (passed as the forward's
`attention_mask`, combined with the packing's document mask), and output i is scored
against token i + 1. It is both the baseline a DLM result is set beside and the source an
adaptation (A2D, docs/adaptation.md) starts from. Its checkpoints carry
`autoregressive: true` in generation_config.json, so `unmask generate` / `unmask eval`
sample it left to right with a KV cache (unmask/sampling/autoregressive.py).
"""

import torch
from torch import nn

from unmask.diffusion.cutoffs import document_starts
from unmask.diffusion.loss import IGNORE_INDEX
from unmask.diffusion.objectives import (
    Objective,
    ObjectiveOutput,
    maskable_of,
    weighted_token_loss,
)
from unmask.diffusion.registry import ObjectiveContext, ObjectiveSpec, register_objective


def causal_attention_mask(length: int, device=None) -> torch.Tensor:
    """(1, 1, L, L) bool, True = may attend: query i sees keys 0..i. The model ands it with
    the document mask of packed rows, so a token sees only its own document's past."""
    index = torch.arange(length, device=device)
    return (index[None, :] <= index[:, None])[None, None]


def next_token_targets(batch: dict) -> torch.Tensor:
    """(B, L) long: the target of output i is token i + 1 when that token is maskable (an
    answer or plain text token: the same tokens the diffusion objectives supervise) and
    belongs to the same document; -100 elsewhere (the last column, a document's last
    token, tokens before a prompt's end)."""
    input_ids = batch["input_ids"]
    maskable = maskable_of(batch)
    starts = document_starts(batch)  # a token starting a document is not predicted
    wanted = maskable[:, 1:] & ~starts[:, 1:]
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(wanted, input_ids[:, 1:], IGNORE_INDEX)
    return targets


class AutoregressiveObjective(Objective):
    """Next-token cross-entropy: loss_sum = sum over i with a target of CE(logits_i,
    x_{i+1}) (`next_token_targets`), count = the number of those targets; the model runs
    under `causal_attention_mask`. Nothing is drawn, so losses do not depend on the world
    size (`global_noise`: `with_noise` returns the batch as it is)."""

    global_noise = True

    def __init__(self, vocab_chunk: int = 8192):
        self.vocab_chunk = vocab_chunk
        self.last_stats: dict[str, torch.Tensor] = {}

    def count(self, batch: dict) -> torch.Tensor:
        return (next_token_targets(batch) != IGNORE_INDEX).sum().float()

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        input_ids = batch["input_ids"]
        targets = next_token_targets(batch)
        selected = targets != IGNORE_INDEX
        coef = selected.float()
        mask = causal_attention_mask(input_ids.shape[1], input_ids.device)
        loss_sum = weighted_token_loss(
            _Causal(model, mask), input_ids, batch, targets, coef, self.vocab_chunk
        )
        count = selected.sum().float()
        self.last_stats = {"num_masked": count.detach(), "num_maskable": count.detach()}
        return ObjectiveOutput(loss_sum, count)


class _Causal:
    """The model called with the causal mask added to every forward (the objectives'
    `weighted_token_loss` calls `model(ids, doc_ids=, position_ids=, targets=, ...)`)."""

    def __init__(self, model: nn.Module, mask: torch.Tensor):
        self.model, self.mask = model, mask
        self.accepts_target_weights = getattr(model, "accepts_target_weights", False)

    def __call__(self, input_ids, **kwargs):
        return self.model(input_ids, attention_mask=self.mask, **kwargs)


def _build(context: ObjectiveContext) -> AutoregressiveObjective:
    return AutoregressiveObjective(context.diffusion.vocab_chunk_size)


def _samples_left_to_right(diffusion) -> dict:
    """An ar model is sampled one token per forward, left to right, with a KV cache."""
    return {"autoregressive": True}


def _check_run(run) -> None:
    """ar runs the native decoder under a causal mask: not a wrapped encoder, not split
    over context-parallel ranks (the mask is an explicit one)."""
    if not run.model.native:
        raise ValueError(
            f"diffusion.objective ar needs a native decoder (model_type qwen3_dllm, "
            f"qwen2_dllm, llama_dllm, ...), not the encoder {run.model.model_type!r}"
        )
    if run.parallel.context_parallel > 1:
        raise ValueError(
            "diffusion.objective ar runs with an explicit causal mask, which context "
            "parallelism does not take: set parallel.context_parallel=1"
        )


register_objective(ObjectiveSpec("ar", _build, fixed_sampling=_samples_left_to_right,
                                 check_run=_check_run, head_share=1.0,
                                 explicit_mask=True))  # fmt: skip
