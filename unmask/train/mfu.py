"""Model FLOPs utilization (MFU): the FLOPs a step's model math needs, per second, over the
peak FLOP/s of the device it ran on.

FLOPs of one optimizer step on one device (forward and backward, 3x the forward's matmuls):

    6 N T  +  12 n_layers d_attn sum_mb(L T_mb)  +  6 d V R

- N: the weights of the model's matmuls, every ``nn.Linear`` (in x out) except the LM head;
  in a mixture of experts only the active ones (router + top-k experts per token).
  The embedding is a lookup, not a matmul, and is left out; norms and biases too.
- T: the tokens the model reads, rows x length of every micro-batch (padding included).
- Attention: per token and layer, the forward's Q K^T and A V take 2 L d_attn FLOPs each
  (L the row length, d_attn = heads x head_dim); x3 with the backward. Full bidirectional
  attention, so no causal halving; document masks (packing) are ignored: a packed row counts
  as if every token saw the whole row, which overstates the attention term of packed batches.
  `FlopModel.executed_flops` counts what a document-masked kernel executes instead:
  sum over documents of len^2 per layer (the benchmark's `mfu_executed`).
- Pictures (DiffusionGemma's vision tower and projector): per picture of a call that has
  them, the tower's matmuls over its patches, forward, and backward where the tower or
  projector trains (models/diffusion_gemma_vision.py `tower_flops`).
- LM head: 6 d V per row it runs on, R = the masked tokens of the step (unmask computes
  logits only for them); an encoder from transformers (BERT, ModernBERT) runs its head on
  every token (R = T).

MFU = FLOPs / (wall seconds x peak FLOP/s). The peak is the dense datasheet number of a
known GPU for the step's matmul dtype (`KNOWN_PEAKS`), or else a short matmul measurement
at start-up (`measure_peak`: the best of a few large GEMMs, under a second; on a CPU, at
least one thread's rate), cached per machine (`peak_cache_file`) by device name, dtype,
thread count and torch version; every later start probes again, cheaply, and the cache keeps
the best rate seen (a probe on a busy machine measures low). A measured peak is what the
device reaches on one plain GEMM, not its datasheet number, so it is a stricter bar.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from unmask.models.build import shape_of
from unmask.models.diffusion_gemma_vision import TowerFlops, tower_flop_model, vision_modules
from unmask.models.shape import matmul_flops

# Dense peak FLOP/s (no structured sparsity: the datasheets' "with sparsity" figures halved),
# from NVIDIA's datasheets: H100 (SXM5 / NVL / PCIe), H200 (SXM / NVL), A100 (SXM4 and
# PCIe, 40 and 80 GB). "float32": the CUDA-core FP32 rate, what a float32 matmul gets at
# torch's default matmul precision ("highest"); "tf32": the tensor-core rate a float32 matmul
# gets at precision "high"/"medium". First match of the device name (case-insensitive) wins,
# so the specific names come before the generic ones.
KNOWN_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756e12, "tf32": 378e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "tf32": 417.5e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12}),
    ("H200 NVL", {"bfloat16": 835e12, "tf32": 417.5e12, "float32": 60e12}),
    ("H200", {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12}),
    ("A100", {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
)

PEAK_CACHE_FILE = "peak_flops.json"
PROBE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "tf32": torch.float32}
FIRST_PROBE_BUDGET_S = 0.3
"""Seconds of repeats of the first probe of a machine (after finding the GEMM size)."""
REPROBE_BUDGET_S = 0.03
"""Seconds of repeats of the probe at every later start: a cheap check that the cached
number was not measured on a busy machine."""


# -- FLOPs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlopModel:
    """The dimensions the FLOP count needs, read from a model."""

    matmul_params: int
    """N: in x out of every nn.Linear but the LM head."""
    layers: int
    attention_width: int
    """d_attn = attention heads x head_dim."""
    head_params: int
    """d x V of the LM head."""
    head_on_masked: bool
    """True: the head runs on the masked rows only (unmask's decoder); False: every token."""
    tower: TowerFlops | None = None
    """DiffusionGemma's vision tower and projector, counted per picture of a call that
    has pictures (models/diffusion_gemma_vision.py `tower_flops`); None: no tower."""

    def step_flops(self, tokens: int, length: int, head_rows):
        """FLOPs of one micro-batch of `tokens` tokens in rows of `length`, forward and
        backward, with the LM head on `head_rows` rows (a number or a 0-d tensor, e.g. the
        masked-token count still on the device; the result is then a tensor)."""
        dense = matmul_flops(self.matmul_params, tokens, self.attention_width, self.layers,
                             length * tokens)  # fmt: skip
        rows = head_rows if self.head_on_masked else tokens
        return dense + 6 * self.head_params * rows

    def executed_flops(self, doc_ids: torch.Tensor, head_rows):
        """The FLOPs one micro-batch of packed rows executes when attention skips the pairs
        its document mask removes (flex attention's block mask, varlen): `step_flops` with
        the attention term counted over each document alone, 12 n_layers d_attn
        sum_docs(len^2), instead of the whole row's L^2 per token. doc_ids: (B, L), a token
        attending to the tokens of its row with the same id (models/transformer.py), padding
        under an id of its own included. `mfu_executed` of benchmarks/gpu_profile.py."""
        tokens = doc_ids.numel()
        dense = matmul_flops(self.matmul_params, tokens, self.attention_width, self.layers,
                             document_pairs(doc_ids))  # fmt: skip
        rows = head_rows if self.head_on_masked else tokens
        return dense + 6 * self.head_params * rows


def document_pairs(doc_ids: torch.Tensor) -> int:
    """sum over rows and documents of len^2: the (query, key) pairs a document mask keeps
    (doc_ids (B, L); equal ids in one row attend to each other, wherever they sit)."""
    ids = doc_ids.detach().to("cpu", torch.long)
    ids = ids - ids.min()
    span = int(ids.max()) + 1 if ids.numel() else 1
    keyed = ids + span * torch.arange(ids.shape[0])[:, None]  # one id space per row
    counts = torch.unique(keyed, return_counts=True)[1]
    return int((counts.long() ** 2).sum())


class DeviceTimer:
    """Marks in the device's stream and the seconds between two of them, read later: CUDA
    events on a GPU (recorded without a sync; read when the window is logged, a step that
    syncs anyway), the wall clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, stop) -> float:
        if self.cuda:
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        return stop - start


class CallFlops:
    """The model FLOPs of the training forwards a model really ran: a forward pre-hook
    records each call's rows and length (an objective may feed more than its batch: BD3LM
    the noisy and the clean copy of a row side by side, Fast-dLLM v2 two masks of each row
    twice over) and the rows its LM head runs on (the call's targets that are not -100; all
    of them without targets). Forwards without gradients (evaluation, sampling) are left
    out. `context`: the context-parallel degree (a call's rows are its slice of each row,
    which attends over the whole row)."""

    def __init__(self, model: nn.Module, flops: FlopModel, context: int = 1):
        self.flops, self.context = flops, context
        self.pending: float | torch.Tensor = 0.0
        # how a call's FLOPs count: the family's declaration (models/shape.py call_flops)
        self.arch = model.config
        self.shape = shape_of(model.config)
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.pending = self.pending + self.shape.call_flops(self.flops, self.arch, args, kwargs,
                                                            self.context)  # fmt: skip

    def take(self) -> float | torch.Tensor:
        """The FLOPs recorded since the last take (a 0-d tensor still on the device, or 0)."""
        value, self.pending = self.pending, 0.0
        return value


def flop_model(model: nn.Module) -> FlopModel:
    """The FlopModel of a native decoder (its `lm_head`), an encoder from transformers (its
    output embeddings) or either under a LoRA wrapper; the layer count and attention width
    come from `model.config` (a ModelConfig)."""
    head = getattr(model, "lm_head", None)
    on_masked = head is not None
    if head is None:
        head = model.hf_model.get_output_embeddings()
    vision = vision_modules(model)  # counted per picture (`tower`), not per token
    linears = [m for m in model.modules()
               if isinstance(m, nn.Linear) and m is not head and id(m) not in vision]  # fmt: skip
    cfg = model.config
    return FlopModel(
        matmul_params=sum(m.in_features * m.out_features for m in linears) + _active_experts(model),
        layers=cfg.num_hidden_layers,
        attention_width=shape_of(cfg).attention_width(cfg),
        head_params=head.in_features * head.out_features,
        head_on_masked=on_masked,
        tower=tower_flop_model(model) if on_masked else None,
    )


def _active_experts(model: nn.Module) -> int:
    """Matmul weights one token uses in the MoE layers (router + its top-k experts; the
    experts are stacked parameters, not nn.Linear): MFU counts active parameters only."""
    return sum(m.active_matmul_params() for m in model.modules()
               if hasattr(m, "active_matmul_params"))  # fmt: skip


# -- peak FLOP/s --------------------------------------------------------------------------
def matmul_dtype(device_type: str, bf16: bool) -> str:
    """The dtype name a step's matmuls run in: bfloat16 under bf16 autocast, else float32,
    or tf32 on CUDA when torch's float32 matmul precision allows TF32 tensor cores."""
    if bf16:
        return "bfloat16"
    if device_type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "float32"


def known_peak(device_name: str, dtype: str) -> float | None:
    """The datasheet peak of a known GPU for `dtype`, or None."""
    name = device_name.lower()
    for pattern, peaks in KNOWN_PEAKS:
        if pattern.lower() in name:
            return peaks.get(dtype)
    return None


def device_name(device: torch.device) -> str:
    """A name that identifies the device's kind: the GPU's, or the CPU's model, vector ISA
    and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    isa = torch.backends.cpu.get_cpu_capability()
    return f"{device.type} {model} ({isa}, {os.cpu_count()} cores)"


def measure_peak(device: torch.device, dtype: torch.dtype, budget_s: float = 0.3) -> float:
    """FLOP/s of the best of several n x n GEMMs: n doubles from 256 until one takes 10 ms
    (or n reaches 2048 on a CPU, 8192 on a GPU), then repeats fill `budget_s`."""

    def timed(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    largest = 2048 if device.type == "cpu" else 8192
    n = 256
    # its own generator: the run's global RNG (dropout, a resumed run's restored state) is
    # left as it was, so a probe at start-up never changes a run
    values = torch.Generator(device=device)
    values.manual_seed(0)
    while True:
        a, b = (torch.randn(n, n, device=device, generator=values).to(dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)
        timed(a, b, out)  # warm-up: kernel choice, page faults
        best = timed(a, b, out)
        if best >= 0.01 or n >= largest:
            break
        n *= 2
    deadline = time.perf_counter() + budget_s
    for _ in range(20):
        if time.perf_counter() >= deadline:
            break
        best = min(best, timed(a, b, out))
    return 2 * n**3 / best


def peak_cache_file() -> Path:
    """$UNMASK_CACHE_DIR/peak_flops.json, else $XDG_CACHE_HOME/unmask/..., else
    ~/.cache/unmask/peak_flops.json."""
    root = os.environ.get("UNMASK_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "unmask")
    return Path(root) / PEAK_CACHE_FILE


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s for one dtype, and where the number came from."""

    flops: float
    source: str

    def describe(self) -> str:
        return f"MFU against a peak of {self.flops / 1e12:.3g} TFLOP/s ({self.source})"


def probe_peak(device: torch.device, dtype: str, budget_s: float) -> float:
    """`measure_peak` for `dtype` (bfloat16, float32, tf32); on a CPU with several threads,
    the better of that and one thread's rate."""
    flops = measure_peak(device, PROBE_DTYPES[dtype], budget_s)
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1:
        # on a busy machine the threads of one GEMM wait for each other and the rate can
        # fall far below one thread's (measured here: 2 vs 67 GFLOP/s); the peak is at least
        # what one thread reaches
        torch.set_num_threads(1)
        try:
            flops = max(flops, measure_peak(device, PROBE_DTYPES[dtype], budget_s))
        finally:
            torch.set_num_threads(threads)
    return flops


def device_peak(device: torch.device, dtype: str) -> Peak:
    """The peak for matmuls in `dtype` (bfloat16, float32, tf32) on `device`: a known GPU's
    datasheet number, else the best of every probe this machine has run (`measure_peak`).

    A probe taken while other work shared the device measures low, so one probe is not
    trusted for good: with no cached number for this machine the probe is a full one
    (`budget_s` 0.3), with one it is a cheap one (`REPROBE_BUDGET_S`, about 0.1-0.2 s on a
    2-core CPU), and the larger of it and the cached number is the peak and stays cached
    (a cache that cannot be read or written is ignored). The cache key is the machine's
    identity (`_cache_key`): a cache copied with a home folder to another machine, or kept
    across a torch upgrade, is not read there."""
    name = device_name(device)
    known = known_peak(name, dtype) if device.type == "cuda" else None
    if known is not None:
        return Peak(known, f"{name}, {dtype}, datasheet")
    key = _cache_key(device, dtype)
    path = peak_cache_file()
    cache = _read_cache(path)
    cached = cache.get(key)
    if not isinstance(cached, (int, float)) or isinstance(cached, bool):
        flops = probe_peak(device, dtype, FIRST_PROBE_BUDGET_S)
        _write_cache(path, {**cache, key: flops})
        return Peak(flops, f"{key}, measured by a matmul probe, cached in {path}")
    probed = probe_peak(device, dtype, REPROBE_BUDGET_S)
    if probed > cached:
        _write_cache(path, {**cache, key: probed})
        return Peak(probed, f"{key}, measured by a matmul probe now, above the "
                            f"{cached / 1e9:.3g} GFLOP/s cached in {path} (raised there)")  # fmt: skip
    return Peak(float(cached), f"{key}, the best matmul probe so far, cached in {path} (this "
                               f"start's probe: {probed / 1e9:.3g} GFLOP/s)")  # fmt: skip


def raise_cached_peak(device: torch.device, dtype: str, flops: float) -> str:
    """A run reached `flops` model FLOP/s, above the cached peak (measured while the machine
    was busy): the cache keeps the higher number from now on. Returns the log line."""
    key, path = _cache_key(device, dtype), peak_cache_file()
    cache = _read_cache(path)
    if not isinstance(cache.get(key), (int, float)) or cache[key] < flops:
        _write_cache(path, {**cache, key: flops})
    return (
        f"the run reached {flops / 1e12:.3g} TFLOP/s of model FLOPs, above the peak it was "
        f"measuring MFU against (probed on a busy machine?): the peak is now that rate, also "
        f"in {path}"
    )


def _cache_key(device: torch.device, dtype: str) -> str:
    """The machine's identity for a measured peak: the device's name (a CPU's model, vector
    ISA and core count; a GPU's name), the dtype, on a CPU the torch thread count, and the
    torch version (its kernels set the rate)."""
    key = f"{device_name(device)} | {dtype}"
    if device.type == "cpu":
        key += f" | {torch.get_num_threads()} threads"
    return f"{key} | torch {torch.__version__}"


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)  # concurrent runs: each writes whole files
    except OSError:
        pass  # a cache that cannot be written is ignored
