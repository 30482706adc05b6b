"""The command line: `unmask train | generate`. The only module that reads argv.

Bad input (an InputError from anywhere) becomes one line on stderr and exit code 2.
"""

import argparse
import sys
from pathlib import Path

from unmask.errors import InputError


def _split_train_args(args: list[str], config_flag: str | None) -> tuple[str | None, list[str]]:
    """`unmask train [FILE] [key=value ...]`: the one argument without '=' is the file."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if config_flag is not None:
        files.insert(0, config_flag)
    if len(files) > 1:
        raise InputError(
            f"expected one config file, got {files}; overrides are written section.key=value"
        )
    return (files[0] if files else None), overrides


def cmd_train(ns: argparse.Namespace) -> int:
    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    path, overrides = _split_train_args(ns.args, ns.config)
    if path is None:
        print("unmask: no config given, running the built-in quickstart", file=sys.stderr)
    cfg = load_config(path, overrides)
    trainer = Trainer(cfg)
    trainer.train()
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    import torch

    from unmask.models import from_pretrained
    from unmask.sampling.accuracy import decode_answer
    from unmask.sampling.generate import generate

    folder = Path(ns.model)
    if not folder.is_dir():
        raise InputError(
            f"--model {ns.model!r} is not a folder; give a checkpoint-N or exported model folder"
        )
    tokenizer = _load_tokenizer(Path(ns.tokenizer) if ns.tokenizer else folder)
    mask_id = ns.mask_id if ns.mask_id is not None else tokenizer.mask_token_id
    if mask_id is None:
        raise InputError("the tokenizer has no mask token; pass --mask-id")
    device = torch.device(ns.device)
    model = from_pretrained(folder).to(device).eval()
    prompt_ids = tokenizer(ns.prompt, add_special_tokens=False)["input_ids"]
    if not prompt_ids:
        raise InputError("--prompt is empty; give some text to continue")
    block = ns.block_length or ns.gen_length
    steps = ns.steps or ns.gen_length
    if ns.seed is not None:
        torch.manual_seed(ns.seed)
    try:
        out = generate(
            model,
            torch.tensor([prompt_ids], device=device),
            steps=steps,
            gen_length=ns.gen_length,
            block_length=block,
            temperature=ns.temperature,
            remasking=ns.remasking,
            mask_id=mask_id,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    answer = decode_answer(tokenizer, out[0, len(prompt_ids) :].tolist())
    print(ns.prompt + answer)
    return 0


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise InputError(f"no tokenizer files in {str(folder)!r}; pass --tokenizer FOLDER")
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unmask", description="Train and sample masked-diffusion language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train from a YAML config (no config: the built-in quickstart)",
        description="unmask train [CONFIG.yaml] [section.key=value ...]",
    )
    train.add_argument("args", nargs="*", help="a config file and/or section.key=value overrides")
    train.add_argument("--config", help="config file (same as the positional form)")
    train.set_defaults(func=cmd_train)

    gen = sub.add_parser("generate", help="sample a continuation from a trained model")
    gen.add_argument("--model", required=True, help="checkpoint-N or exported model folder")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    gen.add_argument("--gen-length", type=int, default=32, help="tokens to generate")
    gen.add_argument("--steps", type=int, help="denoising steps (default: gen-length)")
    gen.add_argument("--block-length", type=int, help="block length (default: gen-length)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--remasking", choices=["low_confidence", "random"], default="low_confidence")
    gen.add_argument("--mask-id", type=int, help="mask token id (default: the tokenizer's)")
    gen.add_argument("--device", default="cpu", help="cpu or cuda")
    gen.add_argument("--seed", type=int, help="seed for temperature > 0")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except InputError as exc:
        print(f"unmask: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("unmask: interrupted; resume with train.resume_from_checkpoint=true", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
