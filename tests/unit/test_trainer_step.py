"""The training step against its plain form: the loss scaled before backward equals the
gradients scaled after it."""

import json
import os

import pytest
import torch
from conftest import deep_update, losses, read_metrics, tiny_model

from unmask.config import load_config
from unmask.host import in_host_read
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


class CountAfterForward:
    """An objective whose `count` is unknown before the forward (None): the trainer then
    takes its plain path (sum the losses, backward, divide every gradient by the count
    afterwards)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def count(self, batch):
        return None

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_trainer(tiny_config, tmp_path, name: str, extra: dict | None = None) -> Trainer:
    tree = deep_update({"train": {"output_dir": str(tmp_path / name)}}, extra or {})
    return Trainer(load_config(tiny_config(tree, name=f"{name}.yaml")))


def micro_batches(trainer: Trainer, maskable_per_row: int | None) -> list[dict]:
    """Two micro-batches of 4 rows; with maskable_per_row, only the first that many
    positions of each row are maskable (a count fixed by the test)."""
    rows = trainer.train_rows
    batch = {k: torch.stack([rows[i][k] for i in range(8)]) for k in rows[0]}
    if maskable_per_row is not None:
        maskable = torch.zeros_like(batch["maskable"])
        maskable[:, :maskable_per_row] = True
        batch["maskable"] = maskable
    return [{k: v[i : i + 4] for k, v in batch.items()} for i in (0, 4)]


@pytest.mark.parametrize("maskable_per_row", [16, None])
def test_loss_scaled_before_backward_equals_gradients_scaled_after(
    tiny_config, tmp_path, maskable_per_row
):
    """Three steps of two micro-batches each, clipping on. With 2 x 4 x 16 = 128 maskable
    tokens per step (a power of two, so 1/128 scales exactly either way) the parameters are
    bit-equal; with the data's own count they agree to float32 rounding."""
    scaled = make_trainer(tiny_config, tmp_path, "scaled")
    plain = make_trainer(tiny_config, tmp_path, "plain")
    plain.objective = CountAfterForward(plain.objective)
    assert scaled._count_before_forward(micro_batches(scaled, maskable_per_row)) is not None
    assert plain._count_before_forward(micro_batches(plain, maskable_per_row)) is None
    if maskable_per_row is not None:
        assert scaled._count_before_forward(micro_batches(scaled, 16)).item() == 128
    for step in range(3):
        stats = [t.train_step(micro_batches(t, maskable_per_row)) for t in (scaled, plain)]
        for t in (scaled, plain):
            t.step += 1
        assert stats[0]["finite"] and stats[1]["finite"]
        loss_scaled, loss_plain = float(stats[0]["loss"]), float(stats[1]["loss"])
        if step == 0 or maskable_per_row is not None:  # same parameters: the same loss
            assert loss_scaled == loss_plain
        else:
            assert loss_scaled == pytest.approx(loss_plain, rel=1e-6)
    moved = 0
    for (name, p), q in zip(scaled.model.named_parameters(), plain.model.parameters()):
        if maskable_per_row is not None:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        moved += not torch.equal(p, q)
    if maskable_per_row is None:
        assert moved > 0  # the two paths round differently: they are different code


# -- host syncs --------------------------------------------------------------------------

#: The Python-level ways a tensor's value reaches the host (each waits for the device).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class Prefetched:
    """The trainer's loader with its batches read ahead: reading rows is CPU work of the
    data loader, not a device sync, and stays out of the count."""

    def __init__(self, loader, steps: int):
        self.loader, self.batches = loader, [next(loader) for _ in range(steps)]

    def __next__(self):
        return self.batches.pop(0)

    def __getattr__(self, name):  # close, state_dict
        return getattr(self.loader, name)


def count_host_reads(monkeypatch, trainer: Trainer) -> dict[int, list[str]]:
    """Patch every HOST_READS method of torch.Tensor to record which one was called during
    which step: a step runs from its train_step call to the next one (its loss, clipping,
    update, guard, window, logging, saving). Step 0: before the first step. Reads of host
    copies made earlier in the stream (unmask/host.py `host_read`: the masked rows' count)
    wait for no device and are left out."""
    reads: dict[int, list[str]] = {0: []}
    current = [0]
    real_step = trainer.train_step

    def train_step(batches):
        current[0] = trainer.step + 1
        reads[current[0]] = []
        return real_step(batches)

    trainer.train_step = train_step
    for name in HOST_READS:
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            if not in_host_read():
                reads[current[0]].append(_name)
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_no_host_sync_on_non_logging_steps_but_the_guards_one(tiny_config, tmp_path, monkeypatch):
    """Six steps, logging every third: steps 1, 2, 4 and 5 read exactly one value from the
    device, the non-finite guard's flag (skip the update when the loss or the gradient
    norm is NaN/inf); losses, gradient norms and MFU are read at steps 3 and 6 only. The
    logged loss is the mean of the window's step losses as Python floats, as before. The
    model attends through sdpa: `auto`'s varlen on CPU reads each forward's document
    boundaries once more (tests/unit/test_models.py::test_document_runs_read_the_device_once)."""
    trainer = make_trainer(tiny_config, tmp_path, "sync", {
        "train": {"max_steps": 6, "logging_steps": 3, "eval_steps": 0, "save_steps": 0},
        "model": {"attn_implementation": "sdpa"},
    })  # fmt: skip
    trainer.loader = Prefetched(trainer.loader, 6)
    step_losses = {}
    real_step = trainer.train_step

    def keep_loss(batches):
        stats = real_step(batches)
        step_losses[trainer.step + 1] = torch.as_tensor(stats["loss"]).detach().clone()
        return stats

    trainer.train_step = keep_loss
    reads = count_host_reads(monkeypatch, trainer)
    trainer.train()
    monkeypatch.undo()
    for step in (1, 2, 4, 5):
        assert reads[step] == ["tolist"], (step, reads[step])
    for step in (3, 6):
        assert len(reads[step]) > 1
    logged = losses(tmp_path / "sync")
    for end in (3, 6):
        window = [float(step_losses[s]) for s in range(end - 2, end + 1)]
        total = 0.0
        for value in window:  # LogWindow's arithmetic: Python floats, summed in step order
            total += value
        assert logged[end] == total / 3


# -- MFU ---------------------------------------------------------------------------------


def test_flop_count_of_a_tiny_model_by_hand():
    """hidden 32, 2 heads of 16, 1 KV head, MLP 64, 2 layers, vocab 128."""
    from unmask.train.mfu import flop_model

    fm = flop_model(tiny_model(num_attention_heads=2, num_key_value_heads=1))
    q, k, v, o = 32 * 32, 32 * 16, 32 * 16, 32 * 32
    gate, up, down = 32 * 64, 32 * 64, 64 * 32
    assert fm.matmul_params == 2 * (q + k + v + o + gate + up + down) == 18432
    assert (fm.layers, fm.attention_width, fm.head_params) == (2, 32, 32 * 128)
    assert fm.head_on_masked
    # 4 rows of 20 tokens, 37 of them masked:
    # 6 N T + 12 layers d_attn L T + 6 d V R
    expected = 6 * 18432 * 80 + 12 * 2 * 32 * 20 * 80 + 6 * 4096 * 37
    assert expected == 8_847_360 + 1_228_800 + 909_312
    assert fm.step_flops(80, 20, 37) == expected
    assert fm.step_flops(80, 20, torch.tensor(37.0, dtype=torch.float64)).item() == expected


def test_executed_flops_of_a_packed_row_are_flop_counter_modes_over_its_documents_alone():
    """mfu_executed's count: a packed micro-batch (two rows, documents of 5, 4 and 3 tokens
    and one of 12; ids reused across rows) executes what running each document as a row of
    its own executes, which FlopCounterMode counts (sdpa's math kernel, forward and
    backward, the head on the target rows as the trainer's weighted loss runs it); the
    whole-row count is larger by the attention
    pairs the document mask removes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from unmask.train.mfu import document_pairs, flop_model

    model = tiny_model(num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")
    fm = flop_model(model)
    doc_ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    ids = torch.randint(0, 100, doc_ids.shape, generator=torch.Generator().manual_seed(0))
    targets = torch.full(doc_ids.shape, -100)
    targets[0, [1, 2, 6, 10]] = ids[0, [1, 2, 6, 10]]
    targets[1, [0, 5, 11]] = ids[1, [0, 5, 11]]
    assert document_pairs(doc_ids) == 25 + 16 + 9 + 144
    counted = 0
    with sdpa_kernel(SDPBackend.MATH):
        for row in range(2):
            for doc in doc_ids[row].unique():
                keep = doc_ids[row] == doc
                with FlopCounterMode(display=False) as counter:
                    model(
                        ids[row, keep][None],
                        targets=targets[row, keep][None],
                        target_weights=torch.ones(1, int(keep.sum())),
                    ).backward()
                counted += counter.get_total_flops()
    assert fm.executed_flops(doc_ids, 7) == counted
    whole = fm.step_flops(24, 12, 7)
    assert whole - counted == 12 * fm.layers * fm.attention_width * (2 * 144 - 194)


class Recording:
    """The objective, recording how many tokens each call masked."""

    def __init__(self, inner):
        self.inner, self.masked = inner, []

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.masked.append(int(self.inner.last_stats["num_masked"]))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_logged_mfu_is_the_hand_count_over_the_window_and_the_peak(
    tiny_config, tmp_path, monkeypatch, capsys
):
    """mfu x peak / tokens_per_second (both over the window's wall time) = the window's
    FLOPs / its tokens, with the FLOPs counted by hand from the TINY dims and the masked
    counts of each step."""
    from unmask.train import trainer as trainer_module
    from unmask.train.mfu import Peak

    monkeypatch.setattr(trainer_module, "device_peak", lambda device, dtype: Peak(1e12, "test"))
    trainer = make_trainer(tiny_config, tmp_path, "mfu", {
        "train": {"max_steps": 3, "logging_steps": 3, "eval_steps": 0, "save_steps": 0},
    })  # fmt: skip
    trainer.objective = recording = Recording(trainer.objective)
    trainer.train()
    record = next(r for r in read_metrics(tmp_path / "mfu") if r["step"] == 3)
    h, inter, layers, heads, kv = 32, 64, 2, 2, 1  # conftest.TINY
    hd = h // heads
    vocab = trainer.model.config.vocab_size
    n = layers * (h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter)
    rows, length = 8, 20  # per_device_train_batch_size x packing_length
    tokens = rows * length
    per_step = [6 * n * tokens + 12 * layers * heads * hd * length * tokens + 6 * h * vocab * r
                for r in recording.masked[:3]]  # fmt: skip
    assert record["mfu"] * 1e12 / record["tokens_per_second"] == pytest.approx(
        sum(per_step) / (3 * tokens), rel=1e-9
    )
    out = capsys.readouterr().out
    assert "MFU against a peak of 1 TFLOP/s (test)" in out
    assert f"mfu {record['mfu']:.1%}" in out


def test_a_peak_below_the_achieved_rate_is_raised_to_it_and_cached(
    tiny_config, tmp_path, monkeypatch, capsys
):
    """A peak probed on a busy machine can sit below what a run reaches: the run's model
    FLOP rate bounds the peak from below, so mfu never passes 1 and the cache learns it."""
    from unmask.train import trainer as trainer_module
    from unmask.train.mfu import Peak, device_peak

    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(trainer_module, "device_peak", lambda device, dtype: Peak(1.0, "test"))
    trainer = make_trainer(tiny_config, tmp_path, "low", {
        "train": {"max_steps": 2, "logging_steps": 1, "eval_steps": 0, "save_steps": 0},
    })  # fmt: skip
    trainer.train()
    first, second = (r for r in read_metrics(tmp_path / "low") if "mfu" in r)
    assert first["mfu"] == 1.0 and 0 < second["mfu"] <= 1.0
    assert "above the peak it was measuring MFU against" in capsys.readouterr().out
    monkeypatch.undo()  # the real device_peak, reading the cache the run wrote
    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "cache"))
    cached = device_peak(torch.device("cpu"), "float32")
    assert cached.flops > 1.0 and "cached" in cached.source


def test_log_mfu_false_counts_nothing(tiny_config, tmp_path):
    trainer = make_trainer(tiny_config, tmp_path, "off", {"train": {"log_mfu": False}})
    assert trainer.flops is None
    stats = trainer.train_step([next(trainer.loader)])
    assert "flops" not in stats


def test_peak_from_the_datasheet_table_or_the_best_probe_cached_per_machine(tmp_path, monkeypatch):
    from unmask.train import mfu

    assert mfu.known_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert mfu.known_peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert mfu.known_peak("NVIDIA H200", "tf32") == 494.5e12
    assert mfu.known_peak("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert mfu.known_peak("NVIDIA L4", "bfloat16") is None
    assert mfu.matmul_dtype("cpu", True) == "bfloat16"
    assert mfu.matmul_dtype("cpu", False) == "float32"

    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "cache"))
    assert mfu.peak_cache_file() == tmp_path / "cache" / "peak_flops.json"
    calls, rates = [], iter([5e10, 4e10, 7e10, 6e10, 3e10, 5e10, 2e10])

    def probe(device, dtype, budget_s=0.3):
        calls.append((dtype, budget_s))
        return next(rates)

    monkeypatch.setattr(mfu, "measure_peak", probe)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one probe per start
    cpu = torch.device("cpu")
    first = mfu.device_peak(cpu, "float32")  # no cached number: the full probe
    assert first.flops == 5e10 and "measured by a matmul probe" in first.source
    assert calls == [(torch.float32, mfu.FIRST_PROBE_BUDGET_S)]
    # a later start probes again, cheaply; a slower probe (a busy machine) keeps the best
    lower = mfu.device_peak(cpu, "float32")
    assert lower.flops == 5e10 and "the best matmul probe so far" in lower.source
    assert "this start's probe: 40 GFLOP/s" in lower.source
    assert calls[1] == (torch.float32, mfu.REPROBE_BUDGET_S) and mfu.REPROBE_BUDGET_S <= 0.05
    # a cached low probe (taken on a busy machine) is raised by a later, faster one
    raised = mfu.device_peak(cpu, "float32")
    assert raised.flops == 7e10 and "above the 50 GFLOP/s cached" in raised.source
    cache = json.loads(mfu.peak_cache_file().read_text())
    (key,) = cache
    assert cache[key] == 7e10
    assert mfu.device_peak(cpu, "float32").flops == 7e10  # 6e10 probed: the best stays
    assert json.loads(mfu.peak_cache_file().read_text()) == {key: 7e10}
    # the key is the machine's identity: CPU model, ISA, cores, dtype, threads, torch version
    assert key == (f"{mfu.device_name(cpu)} | float32 | 1 threads | torch {torch.__version__}")
    assert key.startswith("cpu ") and f"{os.cpu_count()} cores" in key
    mfu.device_peak(cpu, "bfloat16")  # another dtype: another full measurement
    assert calls[-1] == (torch.bfloat16, mfu.FIRST_PROBE_BUDGET_S)
    # a home folder copied to another machine (another CPU): measured in full there, and
    # the first machine's number is neither read nor replaced
    monkeypatch.setattr(mfu, "device_name", lambda device: "cpu Other CPU (AVX2, 8 cores)")
    other = mfu.device_peak(cpu, "float32")
    assert other.flops == 5e10 and calls[-1] == (torch.float32, mfu.FIRST_PROBE_BUDGET_S)
    assert json.loads(mfu.peak_cache_file().read_text())[key] == 7e10
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch: measured in full
    mfu.device_peak(cpu, "float32")
    assert calls[-1] == (torch.float32, mfu.FIRST_PROBE_BUDGET_S) and len(calls) == 7
    assert len(json.loads(mfu.peak_cache_file().read_text())) == 4

    mfu.peak_cache_file().write_text("not json")  # a damaged cache is measured again in full
    monkeypatch.setattr(mfu, "measure_peak", lambda device, dtype, budget_s=0.3: 5e10)
    assert mfu.device_peak(cpu, "float32").flops == 5e10

    monkeypatch.delenv("UNMASK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mfu.peak_cache_file() == tmp_path / "xdg" / "unmask" / "peak_flops.json"


def test_a_probe_with_several_threads_is_at_least_one_threads_rate(tmp_path, monkeypatch):
    """On a busy machine the threads of one GEMM wait for each other: the probe also runs
    on one thread and keeps the better rate, and the thread count is restored."""
    from unmask.train import mfu

    monkeypatch.setenv("UNMASK_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        monkeypatch.setattr(mfu, "measure_peak", lambda device, dtype, budget_s=0.3: seen.append(
            torch.get_num_threads()) or {2: 1e9, 1: 3e10}[torch.get_num_threads()])  # fmt: skip
        assert mfu.probe_peak(torch.device("cpu"), "float32", 0.01) == 3e10
        assert seen == [2, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_matmul_probe_measures_a_plausible_rate():
    from unmask.train.mfu import measure_peak

    flops = measure_peak(torch.device("cpu"), torch.float32, budget_s=0.1)
    assert 1e8 < flops < 1e14  # between a very slow core and far beyond any 2-core CPU


def test_the_peak_probe_leaves_the_global_rng_as_it_was():
    """The probe runs at every start; a resumed run has just restored the global RNG
    (dropout draws from it), so the probe must not draw from it."""
    from unmask.train.mfu import measure_peak

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert measure_peak(torch.device("cpu"), torch.float32, budget_s=0.01) > 0
    assert torch.equal(torch.rand(4), expected)
