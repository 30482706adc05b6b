"""lm-evaluation-harness model `unmask`: Monte Carlo log-likelihoods and diffusion generation.

    pip install 'unmask[eval]'
    unmask-lm-eval --model unmask --model_args pretrained=DIR,mc_num=128,cfg_scale=0.5 \
        --tasks arc_challenge

lm-eval (0.4.x) has no plugin discovery for models: `unmask-lm-eval` (or
`python -m unmask.eval.harness`) imports this module, which registers the model, and then
runs lm-eval's own command line with the same arguments. In Python, importing the module
is enough: `lm_eval.simple_evaluate(model="unmask", model_args=...)`.

- loglikelihood: LLaDA's MC ELBO (`unmask.sampling.likelihood.answer_log_likelihood`, the
  estimator `unmask eval --pairs` uses), exact for one-token continuations (mc_num is not
  spent there); only the continuation's tokens are masked and scored, no EOS after them
  (lm-eval's continuations run on into the text). `is_greedy` is checked only with
  check_greedy=True (greedy decoding of the continuation's length).
- loglikelihood_rolling: minus the NELBO of the text, in chunks of max_length tokens.
- Request i of a call draws its masks from seed + i (`item_generator`), like record i of
  `unmask eval`, so a request's value does not depend on the requests before it.
- generate_until: `unmask.sampling.sample` with the folder's sampling options
  (generation_config.json), then `defaults` (a preset's, `unmask eval --preset`), then the
  task's (max_gen_toks, temperature), then model_args: every SamplingConfig field is a
  model_arg; gen_length rounded up to whole blocks, steps to whole steps per block; the text
  is cut at the first stop string. A diffusion_gemma model (decoder entropy_bound) takes
  only max_gen_toks from the task, and has no likelihoods. Draws come from one generator seeded `seed` on the
  model's device.
- Pictures (a task with doc_to_image: lm-eval's multimodal requests, `visual`): file paths
  (relative ones from the task's data file's folder, `picture_roots`) or PIL images, put
  before the prompt's text as `unmask generate --image` puts them (a model with a vision
  tower: DiffusionGemma); a call with pictures decodes each prompt alone, in order. Every
  request's pictures are read and checked before any prompt is decoded (a missing or
  unreadable file, a wrong type, a picture over the pixel cap, a model without a vision
  tower or a folder without an image processor: one line), then dropped; a prompt's patches
  are built when it is decoded and dropped after it, so a task's pictures are never held
  all at once (each picture is decoded twice: to check it, and to build its patches).
- apply_chat_template (lm-eval's `--apply_chat_template`): the tokenizer's chat template
  with the generation prompt; a tokenizer without one gets the "role: content" lines that
  unmask's SFT rows use without a template (`unmask.data.sft.split_chat`).
- `stats` counts the work: generated tokens (answer tokens before the first EOS, never the
  prompt, the canvas or its padding), forward passes, generation seconds, scored tokens;
  `generations` lists every distinct generation setting used, in full.
"""

import sys
from pathlib import Path
from typing import Any

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - only without the eval extra
    raise ImportError("the lm-eval adapter needs lm-eval: pip install 'unmask[eval]'") from err

from unmask.checkpoint import load_for_sampling
from unmask.data.sft import has_chat_template, split_chat
from unmask.errors import InputError
from unmask.models.diffusion_gemma_vision import require_vision
from unmask.plugins import load_plugins
from unmask.sampling.config import SamplingConfig, resolve_sampling
from unmask.sampling.decoders import decoder_class
from unmask.sampling.generate import sample
from unmask.sampling.images import PromptImages, image_processor, open_image, prompt_images
from unmask.sampling.likelihood import (
    answer_log_likelihood,
    continuation_ids,
    item_generator,
    log_likelihood,
    with_start_token,
)
from unmask.sampling.texts import generate_texts

#: model_args lm-eval passes that the adapter accepts without use
_IGNORED_ARGS = ("max_batch_size", "dtype")


def read_pictures(visual, root: Path, where: str) -> list | None:
    """A document's pictures as PIL images (lm-eval's `visual`, a task's doc_to_image: a
    file path, a PIL image, or a list of them), None without any; relative paths start at
    `root`. One line naming `where` for a missing or unreadable file."""
    if visual is None or visual == []:
        return None
    opened = []
    for item in visual if isinstance(visual, list) else [visual]:
        if isinstance(item, str | Path):
            path = Path(item) if Path(item).is_absolute() else root / item
            name = f"{where}: image {str(item)!r}"
            if not path.is_file():
                raise InputError(f"{name} does not exist ({path}); give paths relative to "
                                 "the task's data file")  # fmt: skip
            opened.append(open_image(path.read_bytes(), name))
        elif hasattr(item, "convert"):  # a PIL image (a datasets Image column)
            opened.append(item.convert("RGB"))
        else:
            raise InputError(f"{where}: an image is a file path or a picture, not "
                             f"{type(item).__name__}")  # fmt: skip
    return opened


@register_model("unmask")
class UnmaskLM(LM):
    """An unmask checkpoint or exported folder behind lm-eval's LM interface."""

    #: lm-eval gives it a task's pictures (a task with doc_to_image); a model without a
    #: vision tower refuses them in one line (`_pictures`)
    MULTIMODAL = True

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        base: str | None = None,
        device: str = "cpu",
        mc_num: int = 128,
        mc_batch_size: int = 16,
        max_length: int = 4096,
        batch_size: int | str = 16,
        check_greedy: bool = False,
        seed: int = 0,
        mask_id: int | None = None,
        defaults: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> None:
        """model_args: the adapter's own (above; `base`: the base model folder of an
        unmerged LoRA adapter; `defaults`: sampling options under the task's, from Python
        only) and every SamplingConfig field."""
        super().__init__()
        unknown = set(sampling) - set(SamplingConfig.model_fields) - set(_IGNORED_ARGS)
        if unknown:
            raise ValueError(f"unknown model_args {sorted(unknown)} for model 'unmask'")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's command line defaults to cuda
        self.sm = load_for_sampling(
            pretrained,
            tokenizer,
            str(device or "cpu"),
            None if mask_id is None else int(mask_id),
            base=base,
        )
        self.mc_num, self.mc_batch_size = int(mc_num), int(mc_batch_size)
        self.max_length = int(max_length)
        self.gen_batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.check_greedy = str(check_greedy).lower() in ("true", "1")
        self.seed = int(seed)
        # generate_until's draws; on the model's device, where `sample` draws
        self.generator = torch.Generator(device=self.sm.device).manual_seed(self.seed)
        self.sampling = {k: v for k, v in sampling.items() if k in SamplingConfig.model_fields}
        self.defaults = dict(defaults or {})
        # what likelihoods share with generation: guidance, Dream's shift, block-causal
        self.options = resolve_sampling(self.sm.saved, self.defaults, self.sampling)
        # likelihoods read the folder's own options: a family's default decoding (LLaDA2's
        # block-causal generate) is how its authors decode, not how unmask scores
        own = getattr(self.sm.saved, "own", self.sm.saved)
        self.scoring = resolve_sampling(own, self.defaults, self.sampling)
        self.stats = {"generation_requests": 0, "generated_tokens": 0, "canvas_tokens": 0,
                      "forward_passes": 0, "row_forwards": 0, "generation_seconds": 0.0,
                      "likelihood_requests": 0, "scored_tokens": 0}  # fmt: skip
        self.generations: list[dict[str, Any]] = []
        #: task -> the folder its documents' relative picture paths start from (its data
        #: file's: unmask eval sets it; else the working folder)
        self.picture_roots: dict[str, Path] = {}

    @property
    def tokenizer(self):
        """The tokenizer (lm-eval reads its special tokens for the results file)."""
        return self.sm.tokenizer

    @property
    def tokenizer_name(self) -> str:
        return type(self.sm.tokenizer).__name__

    def chat_template(self, chat_template: bool | str = False) -> str:
        """The tokenizer's chat template text ('' without one)."""
        template = getattr(self.sm.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else ""

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model's prompt: its chat template, or unmask's template-
        less SFT format ("role: content" lines, then "assistant: ")."""
        tok = self.sm.tokenizer
        if has_chat_template(tok):
            return tok.apply_chat_template(chat_history, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)  # fmt: skip
        if not add_generation_prompt:  # the last (assistant) turn is prefilled
            prompt, answer = split_chat(tok, chat_history)
            return prompt + answer
        return split_chat(tok, [*chat_history, {"role": "assistant", "content": ""}])[0]

    def _encode(self, text: str) -> list[int]:
        return self.sm.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _is_greedy(self, ctx: list[int], cont: list[int]) -> bool:
        prompt = torch.tensor([ctx], device=self.sm.device)
        greedy = SamplingConfig(steps=len(cont), gen_length=len(cont),
                                cfg_scale=self.options.cfg_scale,
                                shift_logits=self.options.shift_logits)  # fmt: skip
        out = sample(self.sm.model, prompt, greedy, mask_id=self.sm.mask_id)
        return out.answers[0].tolist() == cont

    def _check_likelihood(self) -> None:
        if self.options.uniform_canvas:
            raise ValueError(
                "likelihoods of uniform-canvas (diffusion_gemma) models are not implemented "
                "(the MC estimator masks tokens; the model has no [MASK]); use generate_until "
                "tasks"
            )
        if self.scoring.block_causal:
            raise ValueError(
                "likelihoods of block-causal (bd3lm) models are not implemented (the MC "
                "estimator is the bidirectional one); use generate_until tasks"
            )

    @torch.inference_mode()
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._check_likelihood()
        results = []
        for index, request in enumerate(requests):
            context, continuation = request.args
            ctx, cont = continuation_ids(self.sm.tokenizer, context, continuation, self.max_length)
            ctx = with_start_token(self.sm, ctx, self.options.shift_logits)
            est = answer_log_likelihood(
                self.sm, ctx, cont, mc_num=self.mc_num, batch_size=self.mc_batch_size,
                cfg_scale=self.options.cfg_scale, shift_logits=self.options.shift_logits,
                generator=item_generator(self.seed, index),
            )  # fmt: skip
            greedy = self._is_greedy(ctx, cont) if self.check_greedy and ctx else False
            self.stats["likelihood_requests"] += 1
            self.stats["scored_tokens"] += len(cont)
            results.append((est.value, greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, (est.value, greedy))
        return results

    @torch.inference_mode()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self._check_likelihood()
        results = []
        for index, request in enumerate(requests):
            ids = torch.tensor(self._encode(request.args[0]), device=self.sm.device)
            generator, total = item_generator(self.seed, index), 0.0
            # a logit-shift model scores each token from the one before it: a chunk's
            # context is the token before the chunk (the text's first token is not scored)
            shift = 1 if self.options.shift_logits else 0
            width = max(1, self.max_length - shift)
            for start in range(shift, len(ids), width):
                est = log_likelihood(self.sm.model, ids[start - shift : start],
                                     ids[start : start + width],
                                     mask_id=self.sm.mask_id, mc_num=self.mc_num,
                                     batch_size=self.mc_batch_size, generator=generator,
                                     shift_logits=self.options.shift_logits)  # fmt: skip
                total += est.value
            self.stats["likelihood_requests"] += 1
            self.stats["scored_tokens"] += max(0, len(ids) - shift)
            results.append(total)
        return results

    def _opened(self, request) -> list | None:
        """A request's pictures (lm-eval's `visual`: a task's doc_to_image) as PIL images,
        None without (`read_pictures`)."""
        extra = request.args[2] if len(request.args) > 2 else None
        visual = extra.get("visual") if isinstance(extra, dict) else None
        root = self.picture_roots.get(request.task_name, Path.cwd())
        return read_pictures(visual, root, f"task {request.task_name!r} document "
                             f"{request.doc_id}")  # fmt: skip

    def _check_pictures(self, requests) -> list[bool]:
        """Which requests have pictures, every one read and checked as `_pictures` reads it
        and dropped (one line for a bad one); at the first request with pictures, the
        model's vision tower and the folder's image processor are checked too."""
        found, model_checked = [], False
        for request in requests:
            found.append(self._opened(request) is not None)
            if found[-1] and not model_checked:
                require_vision(self.sm.model)
                image_processor(self.sm.folder)
                model_checked = True
        return found

    def _pictures(self, request) -> PromptImages | None:
        """A request's pictures, None without, through the folder's image processor: the
        tokens before its prompt and their patches (built when the prompt is decoded)."""
        opened = self._opened(request)
        return None if opened is None else prompt_images(self.sm.model, self.sm.folder, opened)

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(requests):
            kwargs = dict(request.args[1] or {})
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            key = (until, kwargs.get("max_gen_toks"), kwargs.get("temperature"))
            groups.setdefault(key, []).append(index)
        with_pictures = self._check_pictures(requests)  # all checked before any decoding
        results: list[str] = [""] * len(requests)
        for (until, max_gen_toks, temperature), indices in groups.items():
            options = self._generation_config(max_gen_toks, temperature)
            contexts = [requests[i].args[0] for i in indices]
            if any(with_pictures[i] for i in indices):
                # each prompt with its own pictures, alone and in order: prompt i draws from
                # seed + i as in a batch, and gets what `unmask generate --image` gives it;
                # its patches are built here and dropped when its decoding returns
                records = []
                for i, context in zip(indices, contexts):
                    (record,) = generate_texts(self.sm, [context], options, 1, self.generator,
                                               pictures=self._pictures(requests[i]))  # fmt: skip
                    records.append({**record, "batch": len(records)})
            else:
                records = generate_texts(self.sm, contexts, options, self.gen_batch_size,
                                         self.generator)  # fmt: skip
            self._count(records, options, until, max_gen_toks, temperature)
            for index, record in zip(indices, records):
                text = record["completion"]
                for stop in until:
                    if stop and stop in text:
                        text = text[: text.index(stop)]
                results[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return results

    def _count(self, records, options: SamplingConfig, until, max_gen_toks, temperature) -> None:
        """Add a generation call's work to `stats` and its setting to `generations`."""
        batches = {r["batch"]: r for r in records}
        self.stats["generation_requests"] += len(records)
        self.stats["generated_tokens"] += sum(r["tokens"] for r in records)
        self.stats["canvas_tokens"] += len(records) * options.gen_length
        self.stats["forward_passes"] += sum(r["nfe"] for r in batches.values())
        self.stats["row_forwards"] += sum(r["nfe"] * sum(x["batch"] == b for x in records)
                                          for b, r in batches.items())  # fmt: skip
        self.stats["generation_seconds"] += sum(r["seconds"] for r in batches.values())
        if any("edits" in r for r in records):  # a decoder that edits (joint_threshold)
            self.stats["edits"] = self.stats.get("edits", 0) + sum(r.get("edits", 0)
                                                                   for r in records)  # fmt: skip
        self.generations.append({"until": list(until), "max_gen_toks": max_gen_toks,
                                 "task_temperature": temperature, "requests": len(records),
                                 "sampling": options.record()})  # fmt: skip

    def _generation_config(self, max_gen_toks, temperature) -> SamplingConfig:
        """model_args over the task's gen_kwargs over the defaults over the folder's
        options; gen_length rounded up to whole blocks, steps to whole steps per block
        (block_origin request or block_steps: as given, as LLaDA2's generate takes them).
        Decoder entropy_bound (DiffusionGemma) takes the task's max_gen_toks alone: its
        temperature is its schedule's, its canvases the model's."""
        task = {"gen_length": max_gen_toks, "temperature": temperature}
        if not decoder_class(self.options).block_layout:  # entropy_bound: no blocks, its schedule
            return resolve_sampling(self.sm.saved, self.defaults, {"gen_length": max_gen_toks},
                                    self.sampling)  # fmt: skip
        chosen = resolve_sampling(self.sm.saved, self.defaults, task, self.sampling)
        if chosen.block_origin == "request" or chosen.block_steps is not None:
            return chosen  # any gen_length; steps counted per block (LLaDA2's generate)
        gen, block = chosen.gen_length, chosen.resolved_block_length
        if not chosen.block_causal:  # block-causal models keep the block size they trained on
            block = min(block, gen)
        gen = -(-gen // block) * block
        blocks = gen // block
        steps = -(-(chosen.steps or gen) // blocks) * blocks
        return chosen.updated(gen_length=gen, block_length=block, steps=steps)


def cli(argv: list[str] | None = None) -> None:
    """`unmask-lm-eval ...`: lm-eval's command line with the `unmask` model registered."""
    from lm_eval.__main__ import cli_evaluate  # only the command needs lm-eval's CLI module

    try:  # a registered decoder is a sampling model_arg
        load_plugins()
    except InputError as err:
        print(f"unmask-lm-eval: error: {err}", file=sys.stderr)
        sys.exit(2)
    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    cli()
