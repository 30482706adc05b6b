"""Blends: the block mixer meets the weights, the mixed loader resumes exactly, reads only
its rank's rows and takes each source's rows in that source's own seeded order; the noise of
a rank's slice equals the same rows of the whole batch's noise."""

import pytest
import torch
from conftest import taken, value_rows

from unmask.data import MixedLoader
from unmask.data.mixing import BlockMixer, block_counts
from unmask.diffusion import DiffusionConfig, build_objective
from unmask.errors import InputError


def test_block_counts_sum_to_the_block_and_follow_the_weights():
    assert block_counts([1, 1, 2], 8) == [2, 2, 4]
    assert sum(block_counts([0.2, 0.3, 0.5])) == 4096
    assert block_counts([1, 2], 3) == [1, 2]
    with pytest.raises(InputError, match="weights must be positive"):
        block_counts([1, 0])


def test_proportions_over_10000_rows_are_within_2_points():
    weights = [0.5, 0.3, 0.2]
    source, count = BlockMixer(weights, seed=3).assign(torch.arange(12_345, 22_345))
    observed = torch.bincount(source, minlength=3).double() / 10_000
    assert (observed - torch.tensor(weights, dtype=torch.float64)).abs().max() <= 0.02
    # counts number each source's positions 0, 1, 2, ... without gaps or repeats
    full_source, full_count = BlockMixer(weights, seed=3).assign(torch.arange(0, 22_345))
    for s in range(3):
        assert full_count[full_source == s].tolist() == list(range(int((full_source == s).sum())))


def test_mixed_loader_resumes_and_ranks_split_the_global_batch():
    sources = [value_rows(7, 0), value_rows(11, 100), value_rows(5, 1000)]
    weights = [2.0, 1.0, 1.0]
    straight = MixedLoader(sources, weights, batch_size=6, seed=4)
    reference = [taken(next(straight)) for _ in range(12)]
    seen = [r for batch in reference for r in batch]
    assert {r // 100 for r in seen} == {0, 1, 10}  # every source appears
    first = MixedLoader(sources, weights, batch_size=6, seed=4)
    for _ in range(5):
        next(first)
    resumed = MixedLoader(sources, weights, batch_size=6, seed=4)
    resumed.load_state_dict(first.state_dict())
    assert [taken(next(resumed)) for _ in range(7)] == reference[5:]
    ranks = [MixedLoader(sources, weights, 2, 4, rank=r, world_size=3) for r in range(3)]
    for batch in reference[:4]:
        assert sum((taken(next(loader)) for loader in ranks), []) == batch
    # each source's rows come in its own permutation: the first 7 rows of source 0 are a
    # permutation of it
    zeros = [r for r in seen if r < 100][:7]
    assert sorted(zeros) == list(range(7))


def test_workers_give_the_same_batches():
    sources = [value_rows(9, 0), value_rows(4, 100)]
    inline = MixedLoader(sources, [1, 1], batch_size=3, seed=1)
    workers = MixedLoader(sources, [1, 1], batch_size=3, seed=1, num_workers=2)
    assert [taken(next(inline)) for _ in range(8)] == [taken(next(workers)) for _ in range(8)]
    workers.close()


@pytest.mark.parametrize("t_sampling", ["uniform", "antithetic"])
@pytest.mark.parametrize("min_masked", [0, 1])
def test_a_slice_gets_the_noise_of_its_rows_in_the_whole_batch(t_sampling, min_masked):
    cfg = DiffusionConfig(t_sampling=t_sampling, min_masked=min_masked)
    objective = build_objective(cfg, mask_id=99)
    ids = torch.randint(0, 50, (6, 9), generator=torch.Generator().manual_seed(0))
    maskable = torch.rand(6, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    whole = objective.with_noise({"input_ids": ids, "maskable": maskable},
                                 torch.Generator().manual_seed(5))  # fmt: skip
    for rank in range(3):
        rows = slice(2 * rank, 2 * rank + 2)
        part = objective.with_noise({"input_ids": ids[rows], "maskable": maskable[rows]},
                                    torch.Generator().manual_seed(5), rows=(2 * rank, 6))  # fmt: skip
        for key in ("t", "noisy_input_ids", "masked"):
            assert torch.equal(part[key], whole[key][rows]), (key, rank)
