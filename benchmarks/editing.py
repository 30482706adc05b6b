"""LLaDA2.1's token editing on the quickstart tasks: a model trained with the editing stream
(`diffusion.edit_fraction`, docs/diffusion.md) against one trained without it, both decoded
with `joint_threshold` at low fill thresholds, T2T edits on (`edit_threshold` 0.5) and off
(1.0: p > 1 never holds, so nothing is edited).

Each held-out prompt is decoded in the row the model was trained on (prompt + answer + EOS
padding = data.packing_length tokens), one block, greedily, as the trainer's held-out
accuracy does. Reported per model x fill threshold x edit threshold: exact match, tokens
per forward (masks filled per row per forward pass, `GenerationOutput.tokens_per_forward`),
edits per answer, forwards per answer and the decode's wall time (one thread).

Run: unmask train train.output_dir=runs/edit-base
     unmask train train.output_dir=runs/edit-f02 diffusion.edit_fraction=0.2
     python benchmarks/editing.py --base runs/edit-base/final --edit runs/edit-f02/final
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import load_average, machine, write_report

from unmask.checkpoint import load_for_sampling
from unmask.config import load_config
from unmask.data.synthetic import make_synthetic_heldout
from unmask.sampling import SamplingConfig, sample
from unmask.sampling.accuracy import decode_answer


def decode(sm, examples, row_length: int, threshold: float, edit_threshold: float) -> dict:
    """Every prompt, batched by prompt length; totals over the batches."""
    groups: dict[int, list[int]] = defaultdict(list)
    encoded = [sm.tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
    for index, ids in enumerate(encoded):
        groups[len(ids)].append(index)
    options = SamplingConfig(decoder="joint_threshold", threshold=threshold,
                             edit_threshold=edit_threshold, row_length=row_length)  # fmt: skip
    decoded = row_forwards = edits = correct = 0
    start = time.perf_counter()
    for prompt_len, indices in sorted(groups.items()):
        prompt = torch.tensor([encoded[i] for i in indices])
        out = sample(sm.model, prompt, options.fitted(prompt_len), mask_id=sm.mask_id)
        decoded, row_forwards, edits = (decoded + out.decoded, row_forwards + out.row_forwards,
                                        edits + out.edits)  # fmt: skip
        for row, index in zip(out.answers.tolist(), indices):
            correct += decode_answer(sm.tokenizer, row) == examples[index][1]
    return {"accuracy": correct / len(examples), "tpf": decoded / max(1, row_forwards),
            "edits": edits / len(examples), "forwards": row_forwards / len(examples),
            "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="model trained without edit_fraction")
    parser.add_argument("--edit", required=True, help="model trained with edit_fraction")
    parser.add_argument("--thresholds", default="0.5,0.2", help="fill thresholds")
    parser.add_argument(
        "--edit-thresholds",
        default="1.0,0.5,0.0",
        help="1.0: no edits; 0.0: wherever the argmax differs",
    )
    parser.add_argument("--examples", type=int, default=300, help="held-out prompts")
    parser.add_argument("--label", default="edit_fraction 0.2", help="the --edit model's row")
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_config().data
    examples = make_synthetic_heldout(data)[: args.examples]
    lines = [f"{len(examples)} held-out prompts, rows of {data.packing_length} tokens; "
             f"{machine('torch')}; load {load_average()}", "",
             "| model | threshold | edit_threshold | exact match | tokens / forward | "
             "edits / answer | forwards / answer | decode s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, folder in (("edit_fraction 0", args.base), (args.label, args.edit)):
        sm = load_for_sampling(folder)
        for threshold in map(float, args.thresholds.split(",")):
            for edit_threshold in map(float, args.edit_thresholds.split(",")):
                r = decode(sm, examples, data.packing_length, threshold, edit_threshold)
                lines.append(f"| {name} | {threshold:g} | {edit_threshold:g} | "
                             f"{r['accuracy']:.1%} | {r['tpf']:.2f} | {r['edits']:.2f} | "
                             f"{r['forwards']:.2f} | {r['seconds']:.1f} |")  # fmt: skip
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(text, args.out)


if __name__ == "__main__":
    main()
