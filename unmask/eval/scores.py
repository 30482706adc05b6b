"""`unmask eval`: Monte Carlo likelihood scores of a file, as jsonl records.

Two things can be scored (docs/sampling.md, Likelihood):

- pairs (`--pairs`): answers given prompts, log p(answer | prompt). Only answer tokens (and
  the EOS that end them, `eos_tail`) are masked and scored, the prompt is clean context:
  LLaDA's conditional likelihood, the estimator of lm-eval's `loglikelihood`
  (`answer_log_likelihood`). Prompt and answer are tokenized separately, as training rows
  are built (data/packing.py).
- text (`--ppl`): the text alone, every token masked and scored, no prompt; a perplexity
  upper bound. The whole file as one text, or each line as its own (`--per-line`).

Item i (record, line) draws its masks from seed + i (`item_generator`): items are
independent, so the summary's standard error is sqrt(sum of the items' squared stderrs), and
two files scored with one seed share masks item by item (common random numbers: comparing a
right and a wrong answer file then cancels most of the Monte Carlo noise).

Which EOS follow an answer (`--eos`, default `auto`): what the model's training rows had
after an answer, read from the run's config.yaml next to the checkpoint: padded rows
(data.packing: false) with supervised padding -> `pad` to data.packing_length (the
quickstart); packed rows, or padding kept out of the loss -> `eos` (one EOS, the one the
loss saw); no run config (an exported or downloaded folder) -> `none`.

`score_file` does the whole job for the command line (a `ScoreRequest`: the flags, checked):
the model loaded, the file scored, the records and the summary record returned.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from unmask.checkpoint import load_for_sampling, resolve_model_folder
from unmask.data.config import DataConfig
from unmask.errors import InputError
from unmask.parallel.threads import set_sampling_threads
from unmask.sampling.config import resolve_sampling
from unmask.sampling.likelihood import (
    answer_log_likelihood,
    combined_stderr,
    eos_tail,
    item_generator,
    perplexity_bound,
)
from unmask.sampling.texts import SamplingModel

#: answer fields of a pairs jsonl record, tried in this order (without --answer-field)
ANSWER_FIELDS = ("response", "answer")
_RUN_FOLDER = re.compile(r"^(checkpoint-\d+|final)$")


@dataclass
class AnswerEnd:
    """What follows each answer on the canvas and is scored with it (`eos_tail`)."""

    end: str  # none | eos | pad
    row_length: int | None  # pad: prompt + answer + EOS fill, in tokens
    source: str  # where the choice came from, for the summary record


@dataclass
class ScoreRequest:
    """`unmask eval --pairs / --ppl` once its flags are checked: the file, the model and the
    estimator's settings (`score_file`)."""

    flag: str  # --pairs or --ppl: named in messages
    path: Path
    text: str  # the file's text
    pairs: list[tuple[str, str]] | None  # --pairs: parsed before the model loads
    model: str
    tokenizer: str | None = None
    device: str = "auto"
    mask_id: int | None = None
    base: str | None = None
    mc_num: int = 32
    batch_size: int = 16
    seed: int = 0
    context: int = 512  # --ppl: tokens per scored chunk
    each_line: bool = False  # --ppl: each line scored as a text of its own
    eos: str | None = None  # --pairs: --eos (None = auto)
    row_length: int | None = None  # --pairs: --row-length


@dataclass
class MonteCarlo:
    """The estimator's settings: rows per item, rows per forward pass, the base seed."""

    mc_num: int
    batch_size: int
    seed: int
    cfg_scale: float = 0.0
    shift_logits: bool = False


def parse_pairs(
    text: str, where: str, separator: str | None, prompt_field: str, answer_field: str | None
) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a file's text: jsonl records, or with `separator` text lines
    split at the first separator (the prompt keeps it). Blank lines are skipped."""
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if separator is not None:
            if separator not in line:
                raise InputError(
                    f"{where}:{number}: no {separator!r} in the line; every line is "
                    "PROMPT{separator}ANSWER (--separator)"
                )
            cut = line.index(separator) + len(separator)
            pairs.append((line[:cut], line[cut:]))
            continue
        pairs.append(_json_pair(line, f"{where}:{number}", prompt_field, answer_field))
    if not pairs:
        raise InputError(f"{where} holds no prompt/answer pairs; give a non-empty file")
    for number, (_, answer) in enumerate(pairs, 1):
        if not answer:
            raise InputError(f"{where}: pair {number} has an empty answer; nothing to score")
    return pairs


def _json_pair(
    line: str, where: str, prompt_field: str, answer_field: str | None
) -> tuple[str, str]:
    fields = (answer_field,) if answer_field else ANSWER_FIELDS
    form = f'{{"{prompt_field}": "...", "{fields[0]}": "..."}}'
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(
            f"{where}: not JSON ({err}); write one {form} per line, or give --separator "
            "for a text file"
        ) from None
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected a JSON object {form}")
    answer_key = next((k for k in fields if k in item), None)
    if prompt_field not in item or answer_key is None:
        missing = prompt_field if prompt_field not in item else " or ".join(fields)
        raise InputError(
            f"{where}: no {missing!r} field (found {sorted(item)}); name the fields with "
            "--prompt-field / --answer-field"
        )
    prompt, answer = item[prompt_field], item[answer_key]
    if not isinstance(prompt, str) or not isinstance(answer, str):
        raise InputError(f"{where}: {prompt_field!r} and {answer_key!r} must be strings")
    return prompt, answer


def training_answer_end(folder: Path) -> AnswerEnd:
    """The answer end a model was trained with (module docstring), from the run's
    config.yaml: in the model folder, or in the run directory holding checkpoint-N / final."""
    candidates = [folder / "config.yaml"]
    if _RUN_FOLDER.match(folder.name):
        candidates.append(folder.parent / "config.yaml")
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        return AnswerEnd("none", None, "no run config.yaml beside the model")
    try:
        tree = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        raise InputError(f"{str(path)!r} is not YAML; fix it or pass --eos") from None
    data = tree.get("data") if isinstance(tree, dict) else None
    data = data if isinstance(data, dict) else {}
    fields = DataConfig.model_fields

    def setting(key: str):
        return data.get(key, fields[key].default)

    source = f"{path} (data.packing: {setting('packing')}, supervise_padding: " \
             f"{setting('supervise_padding')})"  # fmt: skip
    if not setting("packing") and setting("supervise_padding"):
        return AnswerEnd("pad", int(setting("packing_length")), source)
    return AnswerEnd("eos", None, source)


def choose_answer_end(eos: str | None, row_length: int | None, folder: Path) -> AnswerEnd:
    """--eos (None = auto) and --row-length: a given row length alone means `pad`; `auto`
    and a `pad` without a row length read the run config (`training_answer_end`)."""
    if eos in (None, "auto"):
        if row_length is not None:
            return AnswerEnd("pad", row_length, "--row-length")
        return training_answer_end(folder)
    if eos == "pad":
        row_length = row_length or training_answer_end(folder).row_length
        if row_length is None:
            raise InputError(
                "--eos pad needs --row-length N (the data.packing_length the model was "
                "trained with; no padded-rows run config.yaml was found beside the model)"
            )
        return AnswerEnd("pad", row_length, "--eos pad")
    if row_length is not None:
        raise InputError(f"--row-length applies to --eos pad, not --eos {eos}")
    return AnswerEnd(eos, None, f"--eos {eos}")


def score_pairs(
    sm: SamplingModel, pairs: list[tuple[str, str]], end: AnswerEnd, mc: MonteCarlo
) -> list[dict[str, Any]]:
    """One record per pair: prompt, answer, token counts, nelbo (nats, minus the
    log-likelihood bound of answer + EOS tail), nelbo_per_token, stderr, samples."""
    records = []
    tok = sm.tokenizer
    for index, (prompt, answer) in enumerate(pairs):
        ctx = tok(prompt, add_special_tokens=False)["input_ids"]
        ans = tok(answer, add_special_tokens=False)["input_ids"]
        if not ans:
            raise InputError(f"pair {index + 1}: answer {answer!r} has no tokens")
        try:
            tail = eos_tail(end.end, sm.eos_id, len(ctx) + len(ans), end.row_length)
        except ValueError as err:
            raise InputError(f"--eos: {err}") from None
        if mc.shift_logits and not ctx and sm.eos_id is None and tok.bos_token_id is None:
            raise InputError(f"pair {index + 1}: an empty prompt needs BOS or EOS (Dream)")
        est = answer_log_likelihood(sm, ctx, ans + tail, mc_num=mc.mc_num,
                                    batch_size=mc.batch_size, cfg_scale=mc.cfg_scale,
                                    shift_logits=mc.shift_logits,
                                    generator=item_generator(mc.seed, index))  # fmt: skip
        scored = len(ans) + len(tail)
        records.append(
            {
                "index": index,
                "prompt": prompt,
                "answer": answer,
                "answer_tokens": len(ans),
                "eos_tokens": len(tail),
                "scored_tokens": scored,
                "nelbo": -est.value,
                "nelbo_per_token": -est.value / scored,
                "stderr": est.stderr,
                "samples": est.samples,
            }
        )
    return records


def score_lines(
    sm: SamplingModel, lines: list[str], context: int, mc: MonteCarlo
) -> list[dict[str, Any]]:
    """One record per non-empty line, each scored as a text of its own (no newline)."""
    records = []
    for index, line in enumerate(lines):
        ids = sm.tokenizer(line, add_special_tokens=False)["input_ids"]
        bound = score_text(sm, ids, context, mc, index)
        records.append(
            {
                "index": index,
                "text": line,
                "scored_tokens": bound.tokens,
                "nelbo": bound.nelbo,
                "nelbo_per_token": bound.nll_per_token,
                "stderr": bound.stderr,
                "chunks": bound.chunks,
            }
        )
    return records


def score_text(sm: SamplingModel, ids: list[int], context: int, mc: MonteCarlo, index: int = 0):
    """`perplexity_bound` of token ids (every token masked and scored)."""
    if len(ids) <= int(mc.shift_logits):
        raise InputError(f"text {index + 1} holds too few tokens to score")
    return perplexity_bound(sm.model, ids, mask_id=sm.mask_id, context=context,
                            mc_num=mc.mc_num, batch_size=mc.batch_size,
                            generator=item_generator(mc.seed, index), device=sm.device,
                            shift_logits=mc.shift_logits)  # fmt: skip


@torch.inference_mode()  # scoring only: no graph built or kept
def score_file(request: ScoreRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The records of a file's items and its summary record (`"summary": true`, with how it
    was scored): answers given prompts (request.pairs), each line of a text
    (request.each_line) or the whole text. Loads the model; its folder's sampling options
    give the guidance scale and the logit shift."""
    sm = load_for_sampling(request.model, request.tokenizer, request.device, request.mask_id,
                           base=request.base)  # fmt: skip
    set_sampling_threads(sm.model, sm.device)
    config = resolve_sampling(sm.saved)
    if config.uniform_canvas:
        raise InputError(
            f"{request.flag}: likelihoods of uniform-canvas (diffusion_gemma) models are not "
            "implemented (the MC estimator masks tokens; the model has no [MASK])"
        )
    if config.block_causal:
        raise InputError(
            f"{request.flag}: likelihoods of block-causal (bd3lm) models are not implemented "
            "yet (the MC estimator is the bidirectional one)"
        )
    mc = MonteCarlo(request.mc_num, request.batch_size, request.seed, config.cfg_scale,
                    config.shift_logits)  # fmt: skip
    path, context = request.path, request.context
    head = {"file": str(path), "mc_num": mc.mc_num, "batch_size": mc.batch_size,
            "seed": mc.seed}  # fmt: skip
    if request.pairs is not None:
        folder = resolve_model_folder(request.model)
        end = choose_answer_end(request.eos, request.row_length, folder)
        records = score_pairs(sm, request.pairs, end, mc)
        return records, {
            "summary": True, "mode": "pairs", **head,
            "scores": "answers given prompts: answer tokens and their EOS tail masked and "
                      "scored, prompt clean",
            "eos": end.end, "row_length": end.row_length, "eos_from": end.source,
            "answer_tokens": sum(r["answer_tokens"] for r in records), **summary(records),
        }  # fmt: skip
    if request.each_line:
        lines = [line for line in request.text.splitlines() if line.strip()]
        if not lines:
            raise InputError(f"--ppl {str(path)!r} holds no text; give a file with text")
        records = score_lines(sm, lines, context, mc)
        return records, {
            "summary": True, "mode": "text-lines", **head,
            "scores": "each line on its own, every token masked and scored (no prompt)",
            "context": context, **summary(records),
        }  # fmt: skip
    ids = sm.tokenizer(request.text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InputError(f"--ppl {str(path)!r} holds no tokens; give a file with text to score")
    bound = score_text(sm, ids, context, mc)
    return [], {
        "summary": True, "mode": "text", **head,
        "scores": "the whole file as one text, every token masked and scored (no prompt)",
        "ppl_upper_bound": bound.perplexity, "nelbo_per_token": bound.nll_per_token,
        "stderr_per_token": bound.stderr_per_token, "tokens": bound.tokens,
        "scored_tokens": bound.tokens, "nelbo": bound.nelbo, "stderr": bound.stderr,
        "chunks": bound.chunks, "context": context,
    }  # fmt: skip


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the records: nelbo, scored tokens, per-token NELBO, the perplexity bound
    exp(nelbo / tokens) and the stderrs (None if any record's is unknown)."""
    tokens = sum(r["scored_tokens"] for r in records)
    nelbo = math.fsum(r["nelbo"] for r in records)
    stderr = combined_stderr([r["stderr"] for r in records])
    return {
        "records": len(records),
        "scored_tokens": tokens,
        "nelbo": nelbo,
        "nelbo_per_token": nelbo / tokens,
        "ppl_upper_bound": _exp(nelbo / tokens),
        "stderr": stderr,
        "stderr_per_token": None if stderr is None else stderr / tokens,
    }


def _exp(value: float) -> float:
    return math.exp(value) if value < 700 else math.inf


def describe(result: dict[str, Any]) -> str:
    """The human lines for stderr: the per-token NELBO with its standard error ("unknown"
    where it cannot be estimated) and the perplexity bound; for a text (--ppl), a second
    line on what the bound is, since a DLM's is often far above an autoregressive model's."""
    stderr = result.get("stderr_per_token")
    error = "unknown (one Monte Carlo draw: raise --mc-num above --batch-size)" \
        if stderr is None else f"{stderr:.4g}"  # fmt: skip
    line = (
        f"unmask: {result['scored_tokens']} scored tokens: NELBO {result['nelbo_per_token']:.4g} "
        f"nats/token, standard error {error}; perplexity <= {result['ppl_upper_bound']:.4g}"
    )
    if result.get("mode") not in ("text", "text-lines"):
        return line
    return line + (
        f"\nunmask: perplexity <= exp(NELBO/token) is an upper bound: a diffusion LM has no "
        f"exact likelihood, only the ELBO below it, here a Monte Carlo estimate from --mc-num "
        f"{result['mc_num']} masked rows per chunk of <= {result['context']} tokens. Every "
        f"token is masked and scored, with no prompt: tokens the model cannot predict (an "
        f"undertrained model, or "
        f"prompts it was never trained to predict, as in prompt/answer training) make the bound "
        f"large. Compare models on the same file and flags; score answers given prompts with "
        f"--pairs"
    )
