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

Open-ended answers (`--task open`, benchmarks/results/stopping_open.md): the same policies
on answers whose length the prompt does not decide ("any 3917=" -> 1 to 12 random digits,
lengths uniform), the setting of an instruct model's chat answers. No answer is right or
wrong; what is measured is the length the sampler ends at, against the data's lengths (mean
6.5, 16.7% of 1 or 2 digits). With EOS padding a masked position's EOS probability is the
chance that the answer has already ended (the data's length CDF, one token), while its
content spreads over ten digits: the low-confidence sampler commits EOS first, from the
canvas end inward, and answers come out short (LLaDA's note that its instruct model
over-generates EOS). Rows for the sampler options that answer it: LLaDA's
`confidence_eos_eot_inf` and `eos_penalty`.

Run: python benchmarks/stopping.py            (trains 3 models, a few minutes each on
     one CPU core; writes benchmarks/results/stopping.md)
     python benchmarks/stopping.py --task open (3 more models; writes stopping_open.md)
     python benchmarks/stopping.py --quick    (20 steps per model, 16 prompts; prints)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import publish

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


OPEN_LENGTHS = range(1, 13)  # open task: answer lengths, uniform


def data_overrides() -> list[str]:
    return ["data.synthetic_tasks=[repeat]", "data.synthetic_min_digits=1",
            "data.synthetic_max_digits=4", f"data.packing_length={ROW}"]  # fmt: skip


def open_examples(count: int, stream: str) -> list[tuple[str, str]]:
    """`count` open-ended examples: "any <1-4 digits>=" -> 1 to 12 random digits (the prompt
    decides nothing); `stream` names the random stream (train and held-out differ)."""
    rng = random.Random(f"unmask-stopping-open-{stream}")
    digits = "0123456789"

    def draw(n: int) -> str:
        return "".join(rng.choice(digits) for _ in range(n))

    return [(f"any {draw(rng.randint(1, 4))}=", draw(rng.choice(OPEN_LENGTHS)))
            for _ in range(count)]  # fmt: skip


def open_data_overrides(folder: Path, train_size: int) -> list[str]:
    """The open task as a local prompt/response jsonl file (written once into `folder`)."""
    path = folder / "open_train.jsonl"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"prompt": p, "response": a}) for p, a in open_examples(train_size, "train")
        ]
        path.write_text("\n".join(lines) + "\n")
    return [f"data.dataset={path}", "data.eval_split=300", f"data.packing_length={ROW}"]


def train(policy: str, folder: Path, steps: int, train_size: int, task: str = "repeat") -> Path:
    """The quickstart model trained on `task` with `policy`; returns final/."""
    final = folder / policy / "final"
    if final.is_dir():
        return final
    packing, supervise = PAD_POLICIES[policy]  # the quickstart file sets packing: false
    data = data_overrides() if task == "repeat" else open_data_overrides(folder, train_size)
    overrides = [*data, f"data.pad_policy={policy}", f"data.packing={packing}",
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


def decode(sm, examples, config_for) -> tuple[list[str], int, list[bool]]:
    """Predictions, forward calls x rows, and whether each answer ended with EOS; prompts are
    batched by config_for(prompt, answer) (a SamplingConfig; equal ones share a batch) and
    prompt length. The char tokenizer has no end-of-turn token: `confidence_eos_eot_inf`
    acts on its EOS alone."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    encoded = [sm.tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
    configs = [config_for(len(ids), len(a)) for ids, (_, a) in zip(encoded, examples)]
    for i, ids in enumerate(encoded):
        groups[(len(ids), configs[i].model_dump_json())].append(i)
    predictions: dict[int, str] = {}
    ended: dict[int, bool] = {}
    row_forwards = 0
    for (_, _), indices in sorted(groups.items()):
        prompt = torch.tensor([encoded[i] for i in indices])
        out = sample(sm.model, prompt, configs[indices[0]], mask_id=sm.mask_id,
                     eos_id=sm.eos_id, eot_id=sm.eos_id)  # fmt: skip
        row_forwards += out.row_forwards
        for i, row in zip(indices, out.answers.tolist()):
            predictions[i] = _answer(sm, row)
            ended[i] = sm.eos_id in row
    order = range(len(examples))
    return [predictions[i] for i in order], row_forwards, [ended[i] for i in order]


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


def open_lengths(predictions: list[str], ended: list[bool]) -> dict[str, float]:
    """Length statistics of open-ended answers (the data: mean 6.5, 16.7% of 1-2 digits)."""
    n = len(predictions)
    lengths = [len(p) for p in predictions]
    return {
        "mean": sum(lengths) / n,
        "short": sum(0 < k <= 2 for k in lengths) / n,
        "over": sum(k > max(OPEN_LENGTHS) for k in lengths) / n,
        "no_eos": sum(not e for e in ended) / n,
        "digits": sum(p.isdigit() or not p for p in predictions) / n,
        "lengths": lengths,
    }


def open_options() -> list[tuple[str, dict]]:
    """Sampler options on the `eos` model's row canvas: sampling at temperature 1 (seeded),
    LLaDA's `confidence_eos_eot_inf` and the EOS penalty."""
    return [("temperature 1", {"temperature": 1.0}),
            ("confidence_eos_eot_inf", {"confidence_eos_eot_inf": True}),
            *((f"eos_penalty {p:g}", {"eos_penalty": p}) for p in (1.0, 2.0, 4.0))]  # fmt: skip


def report_open(args, folder: Path) -> None:
    examples = open_examples(args.examples, "heldout")
    data = [len(a) for _, a in open_examples(args.train_size, "train")]
    lines = [
        "# Stopping benchmark, open-ended answers (CPU)",
        "",
        f'{len(examples)} held-out prompts "any <1-4 digits>="; training answers of 1-12 random '
        f"digits, lengths uniform: the prompt does not decide the length (mean "
        f"{sum(data) / len(data):.2f}, {pct(sum(k <= 2 for k in data) / len(data))} of 1-2 digits). "
        f"A 0.16M-parameter qwen3_dllm (hidden 64, 3 layers) trained {args.steps} steps per "
        f"policy on a local jsonl file, rows of {ROW} tokens (packed: {4 * ROW}). One token "
        "per step, low-confidence remasking, greedy (the temperature row: sampled, seed 0). "
        "Canvas `row`: row length - prompt length, one block (15-18 positions). The prompt "
        "says nothing about the length, so a greedy sampler stops at one or two lengths for "
        "all prompts (by the prompt's length, which sets the canvas): the table shows where "
        "it stops, not a distribution. "
        "Written by `python benchmarks/stopping.py --task open` (plot: stopping_open.png); "
        "read in docs/data.md (Pad policy).",
        "",
        "| pad policy | canvas | sampler option | mean length | 1-2 digits | longer than any "
        "training answer (> 12) | no EOS in the canvas | digits only |",
        "|---|---|---|---|---|---|---|---|",
        f"| (training data) | | | {sum(data) / len(data):.2f} | "
        f"{pct(sum(k <= 2 for k in data) / len(data))} | 0.0% | | 100.0% |",
    ]
    runs: dict[str, list[int]] = {}
    for policy in args.policies:
        started = time.perf_counter()
        sm = load_for_sampling(train(policy, folder, args.steps, args.train_size, task="open"),
                               device="cpu")  # fmt: skip
        print(f"{policy}: trained in {time.perf_counter() - started:.0f}s", flush=True)
        rows = [("row", row_canvas, "", {}),
                (f"{LONG}, blocks of {BLOCK}", long_canvas, "", {})]  # fmt: skip
        if policy == "eos":
            rows += [("row", row_canvas, name, opts) for name, opts in open_options()]
        for canvas, config_for, option, opts in rows:

            def configured(p, a, config_for=config_for, opts=opts):
                return config_for(p, a).model_copy(update=opts)

            torch.manual_seed(0)  # the temperature row's draws
            predictions, _, ended = decode(sm, examples, configured)
            s = open_lengths(predictions, ended)
            runs[f"{policy}, {canvas}" + (f", {option}" if option else "")] = s["lengths"]
            lines.append(f"| {policy} | {canvas} | {option or '-'} | {s['mean']:.2f} | "
                         f"{pct(s['short'])} | {pct(s['over'])} | {pct(s['no_eos'])} | "
                         f"{pct(s['digits'])} |")  # fmt: skip
            print(lines[-1], flush=True)
    publish("\n".join(lines) + "\n", args.out)
    if args.out:
        plot_open(runs, data, Path(args.out).with_suffix(".png"))


def plot_open(runs: dict[str, list[int]], data: list[int], path: Path) -> None:
    """Answer-length distributions of the plain row-canvas runs against the data's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(OPEN_LENGTHS) + 8
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, lengths in [("training data", data), *runs.items()]:
        if "blocks" in name or "eos_penalty 1" in name or "eos_penalty 2" in name:
            continue
        share = [sum(k == n for k in lengths) / len(lengths) for n in range(top)]
        ax.plot(range(top), share, marker="o", markersize=3, label=name,
                linewidth=2.5 if name == "training data" else 1.2)  # fmt: skip
    ax.set_xticks(range(0, top, 2))
    ax.set_xlabel("answer length (tokens before the first EOS)")
    ax.set_ylabel("share of answers")
    ax.set_title("Open-ended answers: where the sampler stops, per pad policy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    parser.add_argument("--task", default="repeat", choices=("repeat", "open"),
                        help="repeat: answers the prompt decides; open: free lengths")  # fmt: skip
    parser.add_argument("--out", default=None,
                        help="results file (default benchmarks/results/stopping.md, "
                        "stopping_open.md with --task open)")  # fmt: skip
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
    if args.out is None:
        name = "stopping_open.md" if args.task == "open" else "stopping.md"
        args.out = f"benchmarks/results/{name}"
    if args.quick:
        args.steps, args.train_size, args.examples, args.out = 20, 1000, 16, None
    with tempfile.TemporaryDirectory(prefix="unmask-stopping-bench-") as tmp:
        (report_open if args.task == "open" else report)(
            args, Path(args.runs) if args.runs else Path(tmp)
        )


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
        predictions, row_forwards, _ = decode(sm, examples, config_for)
        s = score(examples, predictions)
        lines.append(f"| {name} | {pct(s['exact'])} | {pct(s['stops_right'])} | "
                     f"{row_forwards / len(examples):.2f} |")  # fmt: skip
        print(lines[-1], flush=True)
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
