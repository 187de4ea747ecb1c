"""Splitting by global index: no padding, uneven and empty shards, independent of world size."""

import pytest
import torch

import metaddp as md


@pytest.mark.parametrize("n", [0, 1, 2, 7, 13, 100])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_shards_cover_every_index_once_and_differ_by_at_most_one(n, parts):
    ranges = [md.shard_range(n, i, parts) for i in range(parts)]
    assert [j for r in ranges for j in r] == list(range(n))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_fewer_items_than_parts_leaves_empty_shards():
    assert [len(md.shard_range(2, i, 4)) for i in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("bad", [(0, 0), (3, 3), (-1, 2)])
def test_a_part_that_does_not_exist_is_an_error(bad):
    with pytest.raises(ValueError, match="does not exist"):
        md.shard_range(10, *bad)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_sampler_shards_reassemble_the_same_global_batches(parts):
    def global_batches(p):
        samplers = [md.ShardSampler(23, 8, i, p, seed=5) for i in range(p)]
        per_rank = [list(s) for s in samplers]
        return [sum((per_rank[i][b] for i in range(p)), []) for b in range(len(samplers[0]))]

    assert global_batches(parts) == global_batches(1)
    assert [len(b) for b in global_batches(parts)] == [8, 8, 7]  # no padding: 23 = 8 + 8 + 7
    assert sorted(sum(global_batches(parts), [])) == list(range(23))


def test_sampler_epochs_reshuffle_and_drop_last_drops():
    s = md.ShardSampler(23, 8, 0, 1, seed=5, drop_last=True)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first and len(first) == 2


def test_task_streams_depend_on_seed_and_global_index_only():
    a = torch.rand(3, generator=md.generator_for(7, 11, 2))
    b = torch.rand(3, generator=md.generator_for(7, 11, 2))
    c = torch.rand(3, generator=md.generator_for(7, 11, 3))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_task_split_is_the_global_task_cut_in_pieces():
    x, y = torch.arange(13.0)[:, None], torch.arange(13.0)
    task = md.Task(md.Batch(x, y, 13), md.Batch(x[:5], y[:5], 5))
    parts = [task.split(i, 4) for i in range(4)]
    assert torch.equal(torch.cat([p.support.x for p in parts]), x)
    assert [p.query.n for p in parts] == [5] * 4 and sum(len(p.query.x) for p in parts) == 5
    with pytest.raises(ValueError, match="only a whole task"):
        parts[0].split(0, 2)
