import contextlib
import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml


def pytest_collection_modifyitems(config, items):
    """The files marked slow (multi-process launches, docs commands, trainings) first, in
    their order, then the rest: under `make test` (xdist --dist loadfile, without its
    reordering by test count) the two workers end on the short unit files together instead
    of one waiting on a 2-minute launch the other started last."""
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    items[:] = slow + fast


TINY = {
    "model": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 128,
    },
    "data": {
        "dataset": "synthetic",
        "packing": False,
        "packing_length": 20,
        "synthetic_train_size": 256,
        "synthetic_eval_size": 32,
    },
    "optim": {"learning_rate": 3e-3, "lr_scheduler_type": "linear", "warmup_steps": 2},
    "train": {
        "max_steps": 6,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "logging_steps": 1,
        "eval_steps": 3,
        "eval_max_batches": 1,
        "save_steps": 3,
        "disable_tqdm": True,
        # one thread, whatever the machine's load: runs a test compares (an interrupted and an
        # uninterrupted one, say) use the same CPU kernels (auto would follow the load)
        "num_threads": 1,
    },
    "eval": {"generate_accuracy": False},
}


@pytest.fixture(autouse=True, scope="session")
def _unmask_cache_in_tmp(tmp_path_factory):
    """unmask's per-machine cache (the MFU peak measurement) goes to a temporary folder for
    the whole session, subprocesses included, never to the real home."""
    os.environ["UNMASK_CACHE_DIR"] = str(tmp_path_factory.mktemp("unmask-cache"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread avoids OpenMP threads spinning against each other on a
    shared 2-core machine (restored afterwards). Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def deep_update(base: dict, extra: dict) -> dict:
    """A copy of base updated by extra, recursively (extra wins): unmask's own merge of
    config trees, on a deep copy of base, so that no result shares a section with TINY."""
    from unmask.config.compat.tree import merge

    return merge(copy.deepcopy(base), extra)


def write_run_config(root: Path, name: str, base: dict, extra: dict) -> Path:
    """root/<name>.yaml: TINY updated with base, then extra, running in root/<name>."""
    tree = deep_update(deep_update(TINY, base), extra)
    tree = deep_update(tree, {"train": {"output_dir": str(root / name)}})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def train_in_process(config: Path, out: Path, **train) -> Path:
    """The run of `config` in this process (world size 1) into `out`, with train.KEY = value
    (parallel.KEY for the layout's keys) for each keyword: the reference a multi-process run is compared with. Once: an `out`
    that exists is returned as it is."""
    from unmask.config import ParallelConfig, load_config
    from unmask.train.trainer import Trainer

    if not out.exists():
        cfg = load_config(config)
        layout = {k: v for k, v in train.items() if k in ParallelConfig.model_fields}
        train = {k: v for k, v in train.items() if k not in layout}
        cfg.train = cfg.train.model_copy(update={"output_dir": str(out), **train})
        cfg.parallel = cfg.parallel.model_copy(update=layout)
        Trainer(cfg).train()
    return out


@pytest.fixture
def tiny_config(tmp_path):
    """Write a tiny run config; returns a function (extra dict) -> config path."""

    def make(extra: dict | None = None, name: str = "run.yaml"):
        tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run")}})
        tree = deep_update(tree, extra or {})
        path = tmp_path / name
        path.write_text(yaml.safe_dump(tree))
        return path

    return make


#: a parametrization's CUDA case: marked `cuda` (`pytest -m cuda` runs every such test: the
#: prepared GPU run does) and skipped where no GPU is visible
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])  # fmt: skip
#: a module or test that needs a GPU: `pytestmark = NEEDS_CUDA`
NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="no CUDA device")]  # fmt: skip


#: runs whose training step tests/unit/test_step_audit.py audits (every objective, dense and
#: MoE), updates of TINY
_AUDIT_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
AUDIT_CASES = {
    "mdlm": {"diffusion": {"objective": "mdlm", "t_sampling": "antithetic"}},
    "llada_random_length": {"diffusion": {"objective": "llada", "random_length_prob": 0.5}},
    "sft": {"diffusion": {"objective": "sft", "prompt_drop_prob": 0.1}},
    "dream_cart": {"model": {"model_type": "dream"},
                   "diffusion": {"objective": "dream", "loss_weight": "cart[geo_p:0.3]"}},
    "bd3lm": {"diffusion": {"objective": "bd3lm", "block_size": 4}},
    "ar": {"diffusion": {"objective": "ar"}},
    "fastdllm_v2": {"diffusion": {"objective": "fastdllm_v2", "block_size": 4}},
    "packed": {"data": {"packing": True}},
    "moe": {"model": {"model_type": "llada_moe", **_AUDIT_MOE}},
    "moe_sigmoid_shared": {"model": {"model_type": "llada2_moe", "num_shared_experts": 1, **_AUDIT_MOE}},
}  # fmt: skip


#: the tiny native model every test builds: a qwen3_dllm (4 query and 2 key/value heads, as
#: ModelConfig's defaults) of ~30k parameters; `tiny_model` overrides what a test needs
TINY_MODEL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2}  # fmt: skip


def tiny_model(seed: int = 0, **fields):
    """`build_model` of TINY_MODEL updated with `fields` (any ModelConfig field, model_type
    too), after torch.manual_seed(seed): the same seed and fields give the same weights."""
    from unmask.models import ModelConfig, build_model

    torch.manual_seed(seed)
    return build_model(ModelConfig(**(TINY_MODEL | fields)))


def perturb_norms(model):
    """Norm weights drawn from U(0.5, 1.5) and biases from N(0, 0.5) (in place, from the
    global RNG), so a parity test sees a swapped norm or a dropped bias; returns the model
    in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    return model.eval()


#: transformers-side sizes of the logit parity tests (unmask's folders load from them)
PARITY_SIZES = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 128}  # fmt: skip


#: conftest's TINY (2 layers of hidden size 32, the synthetic tasks in rows of 20 tokens) as
#: a diffusion_gemma: a sliding and a full layer, 4 experts (top 2), canvases of 4 tokens (an
#: answer of the quickstart's tasks is 1 or 2 canvases), trained by the `uniform` objective
TINY_GEMMA = {
    "model": {"model_type": "diffusion_gemma", "head_dim": 16, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "diffusion_gemma": {"sliding_window": 8, "canvas_length": 4,
                                  "layer_types": ["sliding_attention", "full_attention"]}},
    "diffusion": {"objective": "uniform"},
    "train": {"eval_steps": 0, "save_steps": 0, "logging_steps": 1},
}  # fmt: skip


def write_toy_tasks(folder: Path, rows: list[dict]) -> Path:
    """lm-eval task files toy_mc (multiple choice) and toy_gen (generate_until) in `folder`
    over one local jsonl file of `rows` ({"question", "choices", "label"})."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "toy.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{question}}}}"
target_delimiter: ""
"""
    (folder / "mc.yaml").write_text(f"""task: toy_mc
{common}output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (folder / "gen.yaml").write_text(f"""task: toy_gen
{common}output_type: generate_until
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
""")
    return folder


def installed_plugin(root: Path, module: str, entry: str | None, source: str = "") -> Path:
    """A plug-in package "installed" in folder `root` (put it on sys.path or PYTHONPATH):
    module `module` with `source` (none when empty) and a dist-info folder whose
    entry_points.txt names `entry` (default: the module) in the `unmask.plugins` group, as
    pip writes it. Returns root."""
    if source:
        (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[unmask.plugins]\ntoy = {entry or module}\n")
    return root


def save_tiny_model(folder, seed: int = 0, **fields):
    """A random tiny qwen3_dllm (or the family and fields given, as tiny_model takes them)
    + the char tokenizer saved as an HF folder; returns folder."""
    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    model = tiny_model(seed, **({"vocab_size": max(128, len(tokenizer)),
                                 "initializer_range": 0.2} | fields))  # fmt: skip
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


#: a tiny DiffusionGemma's text config (transformers' names): both layer types, full layers
#: with their own head size, every layer's dense MLP beside its experts, soft-capping
DIFFUSION_GEMMA_TEXT = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
    "num_global_key_value_heads": 1, "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 24, "max_position_embeddings": 256,
    "final_logit_softcapping": 30.0, "initializer_range": 0.02,
}  # fmt: skip
DIFFUSION_GEMMA_VISION = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
    "position_embedding_size": 64,
}  # fmt: skip


def decisive_diffusion_gemma(seed: int = 0, canvas_length: int = 8, eos_id: int = 1):
    """transformers' tiny random DiffusionGemmaForBlockDiffusion (eval mode), made to decide
    as a trained one does, so its sampler stops, ends rows and follows transformers:
    weights N(0, 0.02) (a random model's self-conditioning loop at 0.1 doubles a rounding
    difference every step, so no other kernels can follow it for 48 steps), the tied
    embedding x 20 (peaked distributions: entropies fall below the thresholds), EOS's row
    x 1.3 more (EOS is often drawn, ending rows), and the layers' output norms x 0.6 (a
    step's argmax depends less on the renoised canvas, so canvases get stable)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DiffusionGemmaConfig(
        text_config=DIFFUSION_GEMMA_TEXT, vision_config=DIFFUSION_GEMMA_VISION,
        canvas_length=canvas_length, initializer_range=0.02,
    )  # fmt: skip
    model = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.mul_(20.0)
        embedding[eos_id].mul_(1.3)
        for name, param in model.named_parameters():
            if ".layers." in name and name.endswith(("post_attention_layernorm.weight",
                                                     "post_feedforward_layernorm.weight")):  # fmt: skip
                param.mul_(0.6)
    return model


def save_tiny_diffusion_gemma(folder, seed: int = 0, canvas_length: int = 8):
    """`decisive_diffusion_gemma` saved by transformers' save_pretrained with the char
    tokenizer (EOS 1, pad 0, no chat template); returns (transformers' model, folder)."""
    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    model = decisive_diffusion_gemma(seed, canvas_length, tokenizer.eos_token_id)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model, folder


@contextlib.contextmanager
def newton_schulz_calls():
    """Yields a list that gets the input shape of every Newton-Schulz call MuonAdamW makes
    inside the block ((n, rows, cols) for a batch of n same-shape matrices)."""
    import unmask.optim.updates as updates

    calls: list[tuple[int, ...]] = []
    original = updates.newton_schulz

    def recording(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    updates.newton_schulz = recording
    try:
        yield calls
    finally:
        updates.newton_schulz = original


def matrices_in(calls: list[tuple[int, ...]]) -> int:
    """How many matrices the recorded Newton-Schulz calls orthogonalized."""
    return sum(math.prod(shape[:-2]) for shape in calls)


def read_metrics(run_dir) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(run_dir, key: str) -> dict[int, float]:
    """{step: value of `key`} over the records of a run's metrics.jsonl that have it."""
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


def losses(run_dir) -> dict[int, float]:
    """{step: training loss} from a run's metrics.jsonl."""
    return by_step(run_dir, "loss")


def value_rows(n: int, base: int = 0, length: int = 3):
    """A RowStore whose row i holds base + i everywhere, so a batch shows which rows it took
    (`taken`)."""
    from unmask.data import RowStore

    ids = (base + torch.arange(n)).unsqueeze(1).expand(n, length).clone()
    return RowStore(
        {
            "input_ids": ids,
            "doc_ids": torch.zeros(n, length, dtype=torch.long),
            "position_ids": torch.arange(length).expand(n, length).clone(),
            "maskable": torch.ones(n, length, dtype=torch.bool),
        }
    )


def taken(batch) -> list[int]:
    """The row values of a batch of `value_rows`."""
    return batch["input_ids"][:, 0].tolist()


REVERSE_RUN = {
    "model": {"model_type": "qwen3_dllm", "hidden_size": 96, "intermediate_size": 288,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128, "tie_word_embeddings": True},
    "data": {"dataset": "synthetic", "tokenizer": "char", "packing": False,
             "packing_length": 16, "synthetic_tasks": ["reverse"], "synthetic_min_digits": 2,
             "synthetic_max_digits": 4, "synthetic_train_size": 20000,
             "synthetic_eval_size": 120},
    "diffusion": {"objective": "mdlm", "t_sampling": "antithetic"},
    "optim": {"name": "adamw", "learning_rate": 3e-3, "lr_scheduler_type": "cosine",
              "warmup_steps": 30, "min_lr_ratio": 0.05, "max_grad_norm": 1.0},
    "train": {"max_steps": 600, "per_device_train_batch_size": 64, "logging_steps": 600,
              "eval_steps": 600, "eval_max_batches": 1, "save_steps": 600, "seed": 0,
              "disable_tqdm": True},
    "eval": {"generate_accuracy": False},
}  # fmt: skip


@pytest.fixture(scope="session")
def reverse_run(tmp_path_factory):
    """The run directory of a small model trained on reverse (2-4 digits) for 600 steps until
    it answers (about 30 s on 1 CPU); shared by every test that needs a model that works."""
    from unmask.cli import main

    root = tmp_path_factory.mktemp("reverse")
    tree = {**REVERSE_RUN, "train": {**REVERSE_RUN["train"], "output_dir": str(root / "run")}}
    (root / "run.yaml").write_text(yaml.safe_dump(tree))
    assert main(["train", str(root / "run.yaml")]) == 0
    return root / "run"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub, no datasets download; the datasets cache in the test's folder."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))


#: a tiny Gemma 4 vision tower whose patches (2 x 2 pixels) pool 2 x 2 into soft tokens
PICTURE_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                  "patch_size": 2, "position_embedding_size": 64, "pooling_kernel_size": 2}  # fmt: skip
PICTURE_IMAGE, PICTURE_BOI, PICTURE_EOI = 125, 126, 127


def save_vision_gemma(folder: Path, seed: int = 0, canvas_length: int = 4, **text) -> Path:
    """A random tiny DiffusionGemma folder with a vision tower (transformers' model), the
    char tokenizer and transformers' Gemma 4 image processor (70 soft tokens a picture):
    what a run with pictures fine-tunes. Text config: DIFFUSION_GEMMA_TEXT with every
    expert chosen (2 of 2: no token's routing flips on a rounding difference between
    process counts), updated by `text`."""
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    torch.manual_seed(seed)
    config = transformers.DiffusionGemmaConfig(
        text_config={**DIFFUSION_GEMMA_TEXT, "num_experts": 2, "top_k_experts": 2, **text},
        vision_config=PICTURE_VISION,
        canvas_length=canvas_length, initializer_range=0.02, image_token_id=PICTURE_IMAGE,
        boi_token_id=PICTURE_BOI, eoi_token_id=PICTURE_EOI)  # fmt: skip
    model = transformers.DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():  # a tower whose features differ from picture to picture
        for name, param in model.named_parameters():
            if "vision" in name and "norm" not in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    tokenizer.save_pretrained(str(folder))
    Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70,
                            pooling_kernel_size=2).save_pretrained(str(folder))  # fmt: skip
    return folder


PICTURE_COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def write_picture_rows(root: Path, count: int, seed: int = 0) -> Path:
    """root/rows.jsonl: LLaVA-style rows ("image" a file under root/pictures, the human
    turn "<image>\\ncolor?", the answer the picture's color name), pictures of a few sizes,
    a solid color with noise."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    (root / "pictures").mkdir(parents=True, exist_ok=True)
    names, rows = list(PICTURE_COLORS), []
    for index in range(count):
        name = names[int(torch.randint(len(names), (1,), generator=g))]
        width, height = [(12, 12), (16, 8), (10, 14)][index % 3]
        noise = torch.randint(-20, 21, (height, width, 3), generator=g)
        pixels = (torch.tensor(PICTURE_COLORS[name]) + noise).clamp(0, 255).to(torch.uint8)
        Image.fromarray(pixels.numpy()).save(root / "pictures" / f"{index}.png")
        rows.append({"id": index, "image": f"pictures/{index}.png",
                     "conversations": [{"from": "human", "value": "<image>\ncolor?"},
                                       {"from": "gpt", "value": name}]})  # fmt: skip
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def huge_png(width: int, height: int) -> bytes:
    """A 1-bit PNG whose header says width x height, with no pixel data (a few dozen
    bytes): what a decompression bomb shows before anything is decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)  # fmt: skip

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))  # fmt: skip


def sigkill_after_steps(cfg: Path, run: Path, steps: int, timeout: float = 120) -> None:
    """`python -m unmask train cfg` SIGKILLed once `steps` steps are in run/metrics.jsonl
    (what a killed job leaves on disk: its checkpoints, no final/)."""
    import signal
    import subprocess
    import sys
    import time

    def logged() -> int:
        path = run / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    proc = subprocess.Popen([sys.executable, "-m", "unmask", "train", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + timeout
    while logged() < steps and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "final").exists()
