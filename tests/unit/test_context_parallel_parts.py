"""Context parallelism's pure pieces without a process group: a row's slices, padding of
rows cut to a random length, the all-to-all byte count."""

import torch

from unmask.models.transformer import document_positions
from unmask.parallel.context import ContextShard, alltoall_bytes, pad_rows


def shard(rank: int, size: int = 2) -> ContextShard:
    return ContextShard(group=None, size=size, rank=rank)


def test_slices_keep_global_positions_and_whole_noise_levels():
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    batch = {"input_ids": torch.arange(8)[None], "doc_ids": doc, "t": torch.tensor([0.3])}
    parts = [shard(r).shard_batch(batch) for r in range(2)]
    assert [p["input_ids"].tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # positions restart per document and continue across the slice boundary
    assert [p["position_ids"].tolist() for p in parts] == [[[0, 1, 2, 0]], [[1, 2, 3, 0]]]
    assert torch.cat([p["position_ids"] for p in parts], 1).equal(document_positions(doc))
    assert all(p["t"] is batch["t"] for p in parts)  # (B,) kept whole
    assert all(p["doc_ids"].shape == (1, 4) for p in parts)  # the model gathers them


def test_padding_is_its_own_document_never_masked_nor_maskable():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    batch = {"input_ids": ids, "noisy_input_ids": ids, "masked": torch.ones(2, 3, dtype=bool)}
    padded = pad_rows(batch, 4)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 10, 0]]
    assert padded["doc_ids"].tolist() == [[0, 0, 0, 1], [0, 0, 0, 1]]
    assert padded["maskable"].tolist() == [[True, True, True, False]] * 2
    assert padded["masked"].tolist() == [[True, True, True, False]] * 2
    # real tokens keep positions 0..2, as in the unpadded row
    assert document_positions(padded["doc_ids"])[:, :3].tolist() == [[0, 1, 2]] * 2
    assert pad_rows(batch, 3) is batch  # already a multiple


def test_alltoall_bytes_formula():
    # cp=2, 4 q heads and 2 K/V heads of 32, 2 layers, 16k tokens: per layer and direction a
    # rank sends half of its (8k tokens x (2*4 + 2*2) heads x 32 x 4 B)
    per_pass = 2 * (8192 * (2 * 4 + 2 * 2) * 32 * 4) // 2
    assert alltoall_bytes(16384, 4, 2, 32, 2, 2) == 2 * per_pass == 24 * 2**20
    assert alltoall_bytes(16384, 4, 2, 32, 2, 1) == 0
    # K/V heads fewer than cp are repeated up to cp
    assert alltoall_bytes(1024, 4, 1, 8, 1, 4) == alltoall_bytes(1024, 4, 4, 8, 1, 4)
