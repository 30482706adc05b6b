"""The picture-colors recipe (docs/recipes.md, DiffusionGemma learning from pictures): a
task whose answer is only in the picture, for a tiny DiffusionGemma with a tiny vision tower trained
from scratch, and a text-only control that cannot see the picture.

    python recipes/picture_colors.py prepare     # the model folder and the rows, offline
    unmask train recipes/picture_colors.yaml     # the run with pictures
    unmask train recipes/picture_colors.yaml data.dataset=runs/picture_colors/data/train_text.jsonl \\
        train.output_dir=runs/picture_colors/control
    python recipes/picture_colors.py score       # held-out exact match of both

or all four in one process: `python recipes/picture_colors.py all` (`--set KEY=VALUE`,
repeatable, goes to both runs).

`prepare` writes runs/picture_colors/model (a random DiffusionGemma folder made by
transformers: a 2-layer text stack, a 2-layer Gemma 4 vision tower whose weights are
drawn N(0, 0.3) so that pictures differ in its output from the start, the char tokenizer
and the Gemma 4 image processor) and runs/picture_colors/data: train.jsonl (each row a picture
file, the prompt "color?" and the answer, the color's name), train_text.jsonl (the same
rows without their pictures: the control) and heldout.jsonl (other pictures). A picture:
32 x 32 pixels of dark noise with 1 to 4 squares of 6 pixels, each in its own cell of a
4 x 4 grid, all of one of four colors. `score` decodes each held-out prompt with its
picture (the run) or without (the control), the tokens `unmask generate --image FILE
--prompt "color?"` gives the model, and prints each one's exact match.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path("runs/picture_colors")
PROMPT = "color?"
COLORS = {
    "red": (230, 60, 50),
    "green": (60, 200, 80),
    "blue": (70, 110, 240),
    "yellow": (230, 210, 40),
}
IMAGE, BOI, EOI = 125, 126, 127
TEXT = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"], "num_experts": 2,
        "top_k_experts": 2, "moe_intermediate_size": 64, "max_position_embeddings": 256,
        "final_logit_softcapping": 30.0}  # fmt: skip
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 2,
          "position_embedding_size": 64, "pooling_kernel_size": 2}  # fmt: skip


def picture(count: int, color: str, g):
    """A PIL picture holding `count` squares of `color` (module docstring)."""
    import torch
    from PIL import Image

    pixels = torch.randint(0, 40, (32, 32, 3), generator=g)
    cells = torch.randperm(16, generator=g)[:count].tolist()
    rgb = torch.tensor(COLORS[color])
    for cell in cells:
        top, left = 8 * (cell // 4) + int(torch.randint(3, (1,), generator=g)), 8 * (
            cell % 4) + int(torch.randint(3, (1,), generator=g))  # fmt: skip
        pixels[top : top + 6, left : left + 6] = rgb
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def rows(folder: Path, name: str, size: int, g) -> list[dict]:
    import torch

    (folder / name).mkdir(parents=True, exist_ok=True)
    out = []
    for index in range(size):
        count = int(torch.randint(1, 5, (1,), generator=g))
        color = list(COLORS)[int(torch.randint(len(COLORS), (1,), generator=g))]
        path = folder / name / f"{index}.png"
        picture(count, color, g).save(path)
        out.append({"image": f"{name}/{index}.png", "prompt": PROMPT, "response": color})
    return out


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def prepare(root: Path, train: int, heldout: int, seed: int) -> None:
    import torch
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    torch.manual_seed(seed)
    config = transformers.DiffusionGemmaConfig(
        text_config=TEXT, vision_config=VISION, canvas_length=8, initializer_range=0.02,
        image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)  # fmt: skip
    model = transformers.DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():  # transformers' init (0.02) gives every picture nearly the same
        for name, param in model.named_parameters():  # soft tokens (0.4% apart): N(0, 0.3)
            if "vision" in name and "norm" not in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(root / "model"))
    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    tokenizer.save_pretrained(str(root / "model"))
    Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70,
                            pooling_kernel_size=2).save_pretrained(str(root / "model"))  # fmt: skip
    data = root / "data"
    g = torch.Generator().manual_seed(seed)
    training = rows(data, "train", train, g)
    write(data / "train.jsonl", training)
    write(data / "train_text.jsonl", [{k: r[k] for k in ("prompt", "response")}
                                      for r in training])  # fmt: skip
    write(data / "heldout.jsonl", rows(data, "heldout", heldout, g))
    print(f"wrote {root / 'model'} and {len(training)} training rows, {heldout} held-out rows "
          f"in {data}")  # fmt: skip


def score(root: Path, runs: dict[str, Path], batch: int = 50) -> None:
    """Each run's held-out exact match: the prompt after its picture's tokens (the run with
    pictures) or alone (the control), decoded with the folder's sampling settings."""
    import torch
    from PIL import Image

    from unmask.checkpoint import load_for_sampling
    from unmask.models.diffusion_gemma_vision import Images
    from unmask.sampling import sample
    from unmask.sampling.config import resolve_sampling
    from unmask.sampling.images import prompt_images

    lines = (root / "data" / "heldout.jsonl").read_text().splitlines()
    heldout = [json.loads(line) for line in lines]
    for name, folder in runs.items():
        sm = load_for_sampling(folder, device="cpu")
        config = resolve_sampling(sm.saved, {"gen_length": 8})
        text = sm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        right = 0
        for start in range(0, len(heldout), batch):
            rows = heldout[start : start + batch]
            images, ids = None, torch.tensor([text] * len(rows))
            if name == "pictures":  # every picture is 32 x 32: one prefix length
                given = [prompt_images(sm.model, root / "model",
                                       [Image.open(root / "data" / r["image"]).convert("RGB")])
                         for r in rows]  # fmt: skip
                ids = torch.tensor([g.prefix + text for g in given])
                images = Images(torch.cat([g.images.pixel_values for g in given]),
                                torch.cat([g.images.position_ids for g in given]))  # fmt: skip
            out = sample(sm.model, ids, config, mask_id=sm.mask_id, eos_id=sm.eos_id,
                         pad_id=sm.pad_id, generator=torch.Generator().manual_seed(start),
                         images=images)  # fmt: skip
            for row, answer in zip(rows, out.answers):
                got = sm.tokenizer.decode(answer.tolist(), skip_special_tokens=True)
                right += got.strip() == row["response"]
        print(f"{name}: held-out exact match {right}/{len(heldout)} = "
              f"{100 * right / len(heldout):.1f}%", flush=True)  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["prepare", "score", "all"])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--train", type=int, default=4000, help="training rows")
    parser.add_argument("--heldout", type=int, default=100, help="held-out rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="all: a config override for both runs")  # fmt: skip
    ns = parser.parse_args(argv)
    if ns.step in ("prepare", "all"):
        prepare(ns.root, ns.train, ns.heldout, ns.seed)
    if ns.step == "all":
        from unmask.cli import main as unmask

        recipe = str(Path(__file__).with_suffix(".yaml"))
        control = [f"data.dataset={ns.root / 'data' / 'train_text.jsonl'}",
                   f"train.output_dir={ns.root / 'control'}"]  # fmt: skip
        for overrides in ([], control):
            if unmask(["train", recipe, *ns.set, *overrides]) != 0:
                return 1
    if ns.step in ("score", "all"):
        score(ns.root, {"pictures": ns.root / "run" / "final",
                        "control": ns.root / "control" / "final"})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
