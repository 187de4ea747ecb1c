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


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_sampler_loader_gives_empty_shards_as_zero_sample_batches(parts):
    # 5 samples in batches of 2 and 1: with 3 or 7 parts some ranks hold nothing of a batch.
    x = torch.arange(10.0, dtype=torch.float64).reshape(5, 2)
    y = torch.arange(5.0, dtype=torch.float64)
    ds = torch.utils.data.TensorDataset(x, y)
    loaders = [md.ShardSampler(5, 2, i, parts, shuffle=False).loader(ds) for i in range(parts)]
    sizes = md.ShardSampler(5, 2, shuffle=False).batch_sizes()
    per_rank = [list(dl) for dl in loaders]
    for b, n in enumerate(sizes):
        shards = [per_rank[i][b] for i in range(parts)]
        for xs, ys in shards:
            assert xs.shape[1:] == (2,) and xs.dtype == torch.float64 and ys.shape == xs.shape[:1]
        # The shards' shares of the batch's mean add up to it (float64 sums of at most 2
        # numbers in another order: a few ulps).
        total = sum(md.share(ys, n) for _, ys in shards)
        assert total.item() == pytest.approx(y[b * 2 : b * 2 + n].mean().item(), rel=1e-15)
        assert torch.equal(torch.cat([xs for xs, _ in shards]), x[b * 2 : b * 2 + n])
    if parts > 2:
        assert per_rank[0][0][0].shape == (0, 2)  # an empty shard, shaped like the items


@pytest.mark.parametrize("call", [
    lambda: md.generator_for(0, 0.5),
    lambda: md.Batch.local(torch.zeros(3, 1), torch.zeros(3), 5.7),
    lambda: md.share(torch.ones(3), 5.7),
    lambda: md.shard_range(10.0, 0, 2),
    lambda: md.ShardSampler(10, 2.5),
    lambda: md.MetaBatch.shard(4.0, lambda i: None),
])
def test_counts_and_indices_must_be_whole_numbers(call):
    # A float count used to be truncated (or divide a loss by a count no batch has).
    with pytest.raises(TypeError, match="must be a whole number"):
        call()
