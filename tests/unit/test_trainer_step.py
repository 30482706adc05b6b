"""The training step against its plain form: the loss scaled before backward equals the
gradients scaled after it."""

import pytest
import torch
from conftest import deep_update

from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


class CountAfterForward:
    """An objective without `count`: the trainer then takes its plain path (sum the losses,
    backward, divide every gradient by the count afterwards)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        if name == "count":
            raise AttributeError(name)
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
        if step == 0 or maskable_per_row is not None:  # same parameters: the same loss
            assert stats[0]["loss"] == stats[1]["loss"]
        else:
            assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-6)
    moved = 0
    for (name, p), q in zip(scaled.model.named_parameters(), plain.model.parameters()):
        if maskable_per_row is not None:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        moved += not torch.equal(p, q)
    if maskable_per_row is None:
        assert moved > 0  # the two paths round differently: they are different code
