"""What only a GPU can show of the training step's CUDA paths (`pytest -m cuda`; skipped on a
CPU; benchmarks/gpu.py --profile runs them): the head's bf16 GEMMs with float32 outputs
(`out_dtype`) against the widened path, the pinned host copy of the masked count, and the
step's host syncs as CUDA itself reports them (torch.cuda.set_sync_debug_mode) against the
CPU audit's count: the non-finite guard's one read."""

import warnings

import torch
import yaml
from conftest import NEEDS_CUDA, TINY, deep_update

import unmask.diffusion.loss as loss_module
from unmask.config import load_config
from unmask.diffusion.loss import weighted_cross_entropy
from unmask.host import HostCopy
from unmask.train.trainer import Trainer

pytestmark = NEEDS_CUDA


def test_the_head_takes_bf16_gemms_with_float32_outputs_on_cuda():
    """On CUDA the logits and both gradients come out of the bf16 GEMMs in float32
    (`_wide_output`), within bf16 rounding of the float32 head, and closer to it than the
    widened bf16 products (what a CPU computes)."""
    g = torch.Generator().manual_seed(3)
    n, h, v = 512, 256, 4096
    hidden = torch.randn(n, h, generator=g).cuda().to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) / 16).cuda()
    targets = torch.randint(0, v, (n,), generator=g).cuda()
    coef = torch.rand(n, generator=g).cuda()
    assert loss_module._wide_output(hidden, torch.empty(1, device="cuda"))

    def run(precision: str, widen: bool):
        hid = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        saved = dict(loss_module._WIDE_OUTPUT)
        if not widen:
            loss_module._WIDE_OUTPUT[(hid.device, torch.bfloat16, torch.float32)] = False
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = weighted_cross_entropy(hid if precision == "bf16" else hid.float(), w,
                                              targets, coef)  # fmt: skip
            loss.backward()
        finally:
            loss_module._WIDE_OUTPUT.clear()
            loss_module._WIDE_OUTPUT.update(saved)
        return loss.float(), hid.grad.float(), w.grad

    wide, rounded, exact = run("bf16", True), run("bf16", False), run("float32", True)
    for got, want in zip(wide, exact):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    assert (wide[0] - exact[0]).abs() <= (rounded[0] - exact[0]).abs() + 1e-6


def test_a_host_copy_is_pinned_and_read_after_its_event():
    value = torch.arange(5, device="cuda").sum()
    copy = HostCopy(value)
    assert copy.tensor().is_pinned() and copy.item() == 10 and copy.ready()


def test_a_steady_state_step_syncs_once_as_cuda_reports_it(tmp_path):
    """Dense and MoE, bf16: the synchronizing CUDA calls of the second step, as torch's sync
    debug mode reports them, are the guard's one read of its flag."""
    for extra in ({}, {"model": {"model_type": "llada_moe", "num_experts": 4,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32}}):  # fmt: skip
        tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), "bf16": True,
                                            "overwrite_output_dir": True},
                                  "model": {"attn_implementation": "sdpa"}})  # fmt: skip
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(deep_update(tree, extra)))
        trainer = Trainer(load_config(path))
        assert trainer.device.type == "cuda"
        for index in range(2):
            batches = [next(trainer.loader)]
            if index == 0:
                trainer.train_step(batches)
                continue
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    trainer.train_step(batches)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
        trainer.loader.close()


def test_expert_counts_need_no_sync():
    from unmask.models.moe import expert_counts

    chosen = torch.randint(0, 8, (4096,), device="cuda").sort().values
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = expert_counts(chosen, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.sum().item() == 4096
    assert torch.equal(counts.cpu(), torch.bincount(chosen.cpu(), minlength=8))


def test_batches_of_a_cuda_run_arrive_pinned(tmp_path):
    """In-process loading (dataloader_num_workers 0) pins each micro-batch, as DataLoader
    workers do: the step's copy to the GPU is asynchronous."""
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run")}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    trainer = Trainer(load_config(path))
    batch = next(trainer.loader)
    assert all(value.is_pinned() for value in batch.values())
    trainer.loader.close()
