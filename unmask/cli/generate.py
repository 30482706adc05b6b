"""`unmask generate`: continuations of prompts from a trained model (text out, or jsonl)."""

import argparse
import json
import sys
import time
from pathlib import Path

from unmask.cli.flags import (
    SAMPLING_REFERENCE,
    add_base_flag,
    check_out_file,
    positive_int,
    read_text,
)
from unmask.cli.sampling_flags import add_sampling_flags, sampling_flags
from unmask.errors import InputError


def add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="sample continuations from a trained model",
                         epilog=SAMPLING_REFERENCE)  # fmt: skip
    gen.add_argument("--model", required=True, help="checkpoint-N (one process or sharded, "
                     "LoRA or not), final/, run output_dir or exported folder")  # fmt: skip
    gen.add_argument("--prompt", action="append", help="text to continue (repeatable)")
    gen.add_argument("--prompts", help='jsonl file, one {"prompt": ...} per line')
    gen.add_argument("--image", action="append", help="a picture every prompt sees, before "
                     "its text (repeatable; a diffusion_gemma folder with a vision tower)")  # fmt: skip
    gen.add_argument("--out", help="write one jsonl record per prompt here")
    gen.add_argument("--jsonl", action="store_true", help="print jsonl records to stdout "
                     "(default: each prompt and its completion as one plain line, in order)")  # fmt: skip
    gen.add_argument("--show", action="store_true", help="animate the denoising (stderr)")
    gen.add_argument("--show-delay", type=float, default=0.05, help="seconds per frame")
    gen.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    add_base_flag(gen)
    add_sampling_flags(gen)
    gen.add_argument("--batch-size", type=positive_int, default=16, help="prompts decoded together")
    gen.add_argument("--mask-id", type=int, help="mask token id (default: the tokenizer's)")
    gen.add_argument("--device", default="auto", help="auto (cuda when visible), cpu or cuda")
    gen.add_argument("--seed", type=int, help="seed for temperature > 0")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(ns: argparse.Namespace) -> int:
    import torch

    from unmask.checkpoint import load_for_sampling
    from unmask.parallel.threads import set_sampling_threads
    from unmask.sampling.config import resolve_sampling
    from unmask.sampling.run_origin import editing_notice, trained_edit_fraction
    from unmask.sampling.show import TerminalAnimation
    from unmask.sampling.texts import generate_texts, throughput, unknown_characters

    prompts = list(ns.prompt or [])
    if ns.prompts:
        prompts += read_prompts(Path(ns.prompts))
    if not prompts:
        raise InputError("no prompts; give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    if ns.out:
        check_out_file(Path(ns.out))
    pictures = None
    if ns.image:
        from unmask.sampling.images import read_image_files

        pictures = read_image_files(ns.image)  # a missing or unreadable file: before loading
    sm = load_for_sampling(ns.model, ns.tokenizer, ns.device, ns.mask_id, base=ns.base)
    set_sampling_threads(sm.model, sm.device)
    if pictures is not None:
        from unmask.sampling.images import prompt_images

        pictures = prompt_images(sm.model, sm.folder, pictures)
    config = resolve_sampling(sm.saved, sampling_flags(ns))
    notice = editing_notice(config, trained_edit_fraction(ns.model))
    if notice:
        print(f"unmask: warning: {notice}", file=sys.stderr)
    generator = (
        torch.Generator(device=sm.device).manual_seed(ns.seed) if ns.seed is not None else None
    )
    for prompt in prompts:
        ids = sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        unknown = unknown_characters(sm.tokenizer, prompt, ids)
        if unknown:
            print(f"unmask: warning: the tokenizer does not know {unknown!r} in prompt "
                  f"{prompt!r}; the model sees its unknown token there", file=sys.stderr)  # fmt: skip
    on_step = None
    if ns.show:
        on_step = TerminalAnimation(sm.tokenizer, sm.mask_id, sm.pad_id, sm.eos_id,
                                    delay=ns.show_delay)  # fmt: skip
    on_batch = on_step.begin_batch if on_step is not None else None  # one animation each
    if on_batch is None and not sys.stderr.isatty():  # a log: say it moves, now and then
        on_batch = progress_lines(len(prompts))
    records = generate_texts(sm, prompts, config, ns.batch_size, generator, on_step, on_batch,
                             pictures)  # fmt: skip
    if on_step is not None:
        on_step.list_edits()  # the last batch's
    if ns.out:
        with open(ns.out, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
        print(f"unmask: wrote {len(records)} record(s) to {ns.out}", file=sys.stderr)
    elif ns.jsonl:
        sys.stdout.writelines(json.dumps(r) + "\n" for r in records)
    else:  # the form depends on the flags only, never on how many prompts there are
        sys.stdout.writelines(r["prompt"] + r["completion"] + "\n" for r in records)
    print(f"unmask: {throughput(records)}", file=sys.stderr)
    return 0


#: without a terminal, a progress line when a batch starts this long after the last line
PROGRESS_SECONDS = 30.0


def progress_lines(total: int, every: float = PROGRESS_SECONDS, stream=None):
    """An on_batch callback for output that is not a terminal (a file, a pipe, CI): when a
    batch starts `every` seconds or more after the last line, one line on stderr says how
    many of the `total` prompts are done."""
    state = {"done": 0, "last": time.monotonic()}

    def on_batch(chunk: list[int]) -> None:
        now = time.monotonic()
        if now - state["last"] >= every:
            print(f"unmask: generate: {state['done']}/{total} prompts done",
                  file=stream or sys.stderr, flush=True)  # fmt: skip
            state["last"] = now
        state["done"] += len(chunk)

    return on_batch


def read_prompts(path: Path) -> list[str]:
    """Prompts from a jsonl file: one {"prompt": ...} object (or JSON string) per line."""
    if not path.is_file():
        raise InputError(f"--prompts {str(path)!r} does not exist; give a jsonl file")
    prompts = []
    for number, line in enumerate(read_text(path, "--prompts").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(
                f'{path}:{number}: not JSON ({err}); write one {{"prompt": "..."}} per line'
            ) from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise InputError(f'{path}:{number}: expected {{"prompt": "..."}} or a JSON string')
        prompts.append(text)
    return prompts
