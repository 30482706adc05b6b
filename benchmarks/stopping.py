"""Stopping at the right length: pad policies and `gen_length: auto` on the variable-length
synthetic task (`repeat`: "rep 3x41=" -> "414141", answers of 1 to 12 digits).

Part 1, pad policies: one small model per `data.pad_policy` (eos, single_eos, packed),
trained on the same built-in data with the quickstart's optimizer and a smaller model
(hidden 64, 3 layers), rows of 24 tokens (the longest prompt, answer and EOS) in batches of
64; packed: rows of 96 in batches of 16, the same tokens per step. Each model decodes the same held-out
prompts two ways, one token per step, low-confidence remasking, greedy:
  - row canvas: gen_length = row length - prompt length, one block (what a checkpoint of
    a padded-rows run samples with, `row_length`);
  - long canvas: 16 positions (longest answer + EOS + 3), blocks of 4, EOS stopping.
Reported: exact match, "stops right" (the answer before the first EOS has exactly the
expected length), stopped short, ran long, and "right answer, then more" (the expected
answer followed by more tokens: the content is right, the stop is missing).

Part 2, `gen_length: auto` on the default policy's model: the canvas starts at one block
(4) and grows by a block while P(EOS) at its last position is below 0.5, up to 16; then
blocks are decoded with EOS stopping (and a row that fills its canvas without EOS grows
again). Compared with the oracle fixed length (each prompt decoded with exactly its answer
length + 1 positions) and fixed canvases of the longest length (16 in one block, and 16 in
blocks of 4 with EOS stopping: a row stops after the block holding its EOS). Forward passes are counted per prompt (forward calls x rows / prompts).

Run: python benchmarks/stopping.py            (trains 3 models, a few minutes each on
     one CPU core; writes benchmarks/results/stopping.md)
     python benchmarks/stopping.py --quick    (20 steps per model, 16 prompts; prints)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from unmask.checkpoint import load_for_sampling
from unmask.config import load_config
from unmask.data.config import PAD_POLICIES
from unmask.data.synthetic import make_synthetic_heldout
from unmask.sampling import SamplingConfig, sample
from unmask.train.trainer import Trainer

POLICIES = ("eos", "single_eos", "packed")
ROW = 24  # "rep 3x1234=" (11) + 12 answer digits + EOS
LONG, BLOCK = 16, 4
MODEL = ["model.hidden_size=64", "model.intermediate_size=192", "model.num_hidden_layers=3",
         "train.per_device_train_batch_size=64"]  # fmt: skip


def data_overrides() -> list[str]:
    return ["data.synthetic_tasks=[repeat]", "data.synthetic_min_digits=1",
            "data.synthetic_max_digits=4", f"data.packing_length={ROW}"]  # fmt: skip


def train(policy: str, folder: Path, steps: int, train_size: int) -> Path:
    """The quickstart model trained on the repeat task with `policy`; returns final/."""
    final = folder / policy / "final"
    if final.is_dir():
        return final
    packing, supervise = PAD_POLICIES[policy]  # the quickstart file sets packing: false
    overrides = [*data_overrides(), f"data.pad_policy={policy}", f"data.packing={packing}",
                 f"data.supervise_padding={supervise}", f"data.synthetic_train_size={train_size}",
                 f"train.output_dir={folder / policy}", f"train.max_steps={steps}",
                 "train.save_steps=0", "train.eval_steps=0", "train.disable_tqdm=true",
                 "train.logging_steps=100", "optim.warmup_steps=50", *MODEL,
                 "train.overwrite_output_dir=true", "eval.generate_accuracy=false"]  # fmt: skip
    if packing:  # rows of 4 examples' length, a quarter of the rows: the same tokens a step,
        # and fewer examples cut by a row end (a cut one continues without its prompt)
        overrides += [f"data.packing_length={4 * ROW}", "train.per_device_train_batch_size=16"]
    Trainer(load_config(None, overrides)).train()
    return final


def heldout(count: int) -> list[tuple[str, str]]:
    return make_synthetic_heldout(load_config(None, data_overrides()).data)[:count]


def _answer(sm, row: list[int]) -> str:
    if sm.eos_id in row:
        row = row[: row.index(sm.eos_id)]
    return sm.tokenizer.decode(row, skip_special_tokens=True)


def decode(sm, examples, config_for) -> tuple[list[str], int]:
    """Predictions and forward calls x rows; prompts are batched by config_for(prompt, answer)
    (a SamplingConfig; equal ones share a batch) and prompt length."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    encoded = [sm.tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
    configs = [config_for(len(ids), len(a)) for ids, (_, a) in zip(encoded, examples)]
    for i, ids in enumerate(encoded):
        groups[(len(ids), configs[i].model_dump_json())].append(i)
    predictions: dict[int, str] = {}
    row_forwards = 0
    for (_, _), indices in sorted(groups.items()):
        prompt = torch.tensor([encoded[i] for i in indices])
        out = sample(sm.model, prompt, configs[indices[0]], mask_id=sm.mask_id, eos_id=sm.eos_id)
        row_forwards += out.row_forwards
        for i, row in zip(indices, out.answers.tolist()):
            predictions[i] = _answer(sm, row)
    return [predictions[i] for i in range(len(examples))], row_forwards


def score(examples, predictions) -> dict[str, float]:
    n = len(examples)
    lengths = [(len(p), len(a)) for p, (_, a) in zip(predictions, examples)]
    return {
        "exact": sum(p == a for p, (_, a) in zip(predictions, examples)) / n,
        "stops_right": sum(got == want for got, want in lengths) / n,
        "short": sum(got < want for got, want in lengths) / n,
        "long": sum(got > want for got, want in lengths) / n,
        "runs_on": sum(
            len(p) > len(a) and p.startswith(a) for p, (_, a) in zip(predictions, examples)
        )
        / n,
    }


def row_canvas(prompt_len: int, _answer_len: int) -> SamplingConfig:
    gen = ROW - prompt_len
    return SamplingConfig(gen_length=gen, block_length=gen, steps=gen)


def long_canvas(_prompt_len: int, _answer_len: int) -> SamplingConfig:
    return SamplingConfig(gen_length=LONG, block_length=BLOCK, steps=LONG)


def one_block_canvas(_prompt_len: int, _answer_len: int) -> SamplingConfig:
    return SamplingConfig(gen_length=LONG, block_length=LONG, steps=LONG)


def oracle_canvas(_prompt_len: int, answer_len: int) -> SamplingConfig:
    gen = answer_len + 1
    return SamplingConfig(gen_length=gen, block_length=gen, steps=gen)


def auto_canvas(_prompt_len: int, _answer_len: int) -> SamplingConfig:
    return SamplingConfig(gen_length="auto", gen_length_max=LONG, block_length=BLOCK)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main() -> None:
    global ROW
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2500, help="training steps per model")
    parser.add_argument("--train-size", type=int, default=60000)
    parser.add_argument("--examples", type=int, default=300, help="held-out prompts")
    parser.add_argument("--runs", default=None, help="keep the trained models here (reused)")
    parser.add_argument("--default", default="eos", choices=POLICIES,
                        help="the policy whose model part 2 uses")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--row",
        type=int,
        default=ROW,
        help="training row length (the row canvas is this minus the prompt)",
    )
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--out", default="benchmarks/results/stopping.md")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 20 steps per model, 16 prompts; writes no file",
    )
    args = parser.parse_args()
    if args.default not in args.policies:
        parser.error(f"--default {args.default} must be one of --policies")
    ROW = args.row
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.train_size, args.examples, args.out = 20, 1000, 16, None
    with tempfile.TemporaryDirectory(prefix="unmask-stopping-bench-") as tmp:
        report(args, Path(args.runs) if args.runs else Path(tmp))


def report(args, folder: Path) -> None:
    examples = heldout(args.examples)
    lines = [
        "# Stopping benchmark (variable-length `repeat` task, CPU)",
        "",
        f"{len(examples)} held-out prompts; answers of 1-12 digits; a 0.16M-parameter "
        f"qwen3_dllm (hidden 64, 3 layers) trained {args.steps} steps per policy, rows of "
        f"{ROW} tokens (packed: {4 * ROW}). Greedy, one token per step, low-confidence "
        "remasking. Canvas `row`: row length - prompt length, one block. Written by "
        "`python benchmarks/stopping.py`; read in docs/data.md (Pad policy) and "
        "docs/diffusion.md (gen_length auto).",
        "",
        "## Pad policies",
        "",
        "| pad policy | canvas | exact match | stops right | stopped short | ran long | "
        "right answer, then more |",
        "|---|---|---|---|---|---|---|",
    ]
    models = {}
    for policy in args.policies:
        started = time.perf_counter()
        models[policy] = load_for_sampling(train(policy, folder, args.steps, args.train_size),
                                           device="cpu")  # fmt: skip
        print(f"{policy}: trained in {time.perf_counter() - started:.0f}s", flush=True)
        for name, config_for in (("row", row_canvas), (f"{LONG}, blocks of {BLOCK}", long_canvas)):
            s = score(examples, decode(models[policy], examples, config_for)[0])
            lines.append(f"| {policy} | {name} | {pct(s['exact'])} | {pct(s['stops_right'])} | "
                         f"{pct(s['short'])} | {pct(s['long'])} | {pct(s['runs_on'])} |")  # fmt: skip
            print(lines[-1], flush=True)
    sm = models[args.default]
    lines += [
        "",
        f"## `gen_length: auto` (the `{args.default}` model)",
        "",
        "| canvas | exact match | stops right | forward passes per prompt |",
        "|---|---|---|---|",
    ]
    for name, config_for in (("oracle fixed length (answer + 1)", oracle_canvas),
                             (f"fixed {LONG}, one block", one_block_canvas),
                             (f"fixed {LONG}, blocks of {BLOCK}, EOS stop", long_canvas),
                             (f"auto: start {BLOCK}, grow by {BLOCK}, cap {LONG}", auto_canvas)):  # fmt: skip
        predictions, row_forwards = decode(sm, examples, config_for)
        s = score(examples, predictions)
        lines.append(f"| {name} | {pct(s['exact'])} | {pct(s['stops_right'])} | "
                     f"{row_forwards / len(examples):.2f} |")  # fmt: skip
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
