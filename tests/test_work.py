"""The verdicts on what a checked step computed (metaddp.distributed._work), from rows made
as the ranks make them: every correct way to make shares passes, each mistake is named."""

import torch
import torch.nn.functional as F

from metaddp._share import Logged, ShareOf, loss_print
from metaddp.distributed._work import PLACES, judge, work_block

ALONE = "alone {held} of {n}"


def row(shares, *, group=0, unsure=False, prints=()):
    """One rank's record: its shares as (held, n, source, call site), in the order made."""
    logged = [Logged(ShareOf(held, n, source), site, k) for k, (held, n, source, site) in enumerate(shares)]
    return group, logged, unsure, list(prints)


def verdict(*rows):
    """The verdict every rank reaches on the SUM of the ranks' blocks."""
    world, groups = len(rows), 1 + max(r[0] for r in rows)
    cpu = torch.device("cpu")
    blocks = [work_block(rank, world, g, groups, s, u, p, cpu) for rank, (g, s, u, p) in enumerate(rows)]
    return judge(sum(blocks), world, ALONE)


def test_parts_that_add_up_pass_in_any_order_chunked_or_skipped():
    # Rank 0 holds 3 of 5 in two chunks, rank 1 holds 2; a masked term over the whole count
    # (a count, holding fewer) made by rank 1 only.
    a = row([(2, 5, "shard", 1), (1, 5, "shard", 1)])
    b = row([(2, 5, "shard", 1), (1, 5, "count", 2)])
    assert verdict(a, b) is None
    # Several batches of one size: parts add up to a multiple.
    assert verdict(row([(3, 5, "shard", 1)] * 2), row([(2, 5, "shard", 1)] * 2)) is None


def test_a_count_of_the_ranks_own_samples_is_named():
    uneven = verdict(row([(3, 3, "count", 1)]), row([(2, 2, "count", 1)]))
    assert "different global sample counts" in uneven
    even = verdict(row([(2, 2, "count", 1)]), row([(2, 2, "count", 1)]))
    assert "more than its 2" in even


def test_parts_that_do_not_add_up_are_named_and_unsure_records_are_not_judged():
    short = [row([(2, 6, "shard", 1)]), row([(2, 6, "shard", 1)])]
    assert "hold 4 samples in all" in verdict(*short)
    assert verdict(row([(2, 6, "shard", 1)], unsure=True), short[1]) is None
    # Where a sample group is one rank (whole tasks per rank): the rest is nowhere.
    assert verdict(row([(3, 5, "shard", 1)]), row([(5, 5, "shard", 1)], group=1)) == "alone 3 of 5"


def test_shares_are_compared_place_by_place_only_as_far_as_the_row_holds():
    many = [(1, 2, "count", 1)] * (PLACES + 3)
    assert verdict(row(many), row(many)) is None


def test_prints_of_the_same_shapes_are_compared_and_others_are_not():
    p, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    ce = lambda w: lambda p, y: w * F.cross_entropy(p, y, ignore_index=0, reduction="none")  # noqa: E731
    one, two = loss_print(ce(1.0), p, y), loss_print(ce(2.0), p, y)
    # Made-up targets take classes 0 and 1 in turn: a weight shows past ignore_index=0.
    assert not torch.equal(one, two)
    # Prints of the step's first meta_loss over global tasks (call 1): compared over the mesh.
    assert verdict(row([], prints=[(1, one)]), row([], group=1, prints=[(1, one)])) is None
    assert "compute different losses" in verdict(row([], prints=[(1, one)]), row([], group=1, prints=[(1, two)]))
    # The same loss on inputs of other shapes (tasks of other lengths) prints otherwise.
    other = loss_print(ce(2.0), torch.randn(4, 5, dtype=torch.float64), y)
    assert verdict(row([], prints=[(1, one)]), row([], prints=[(1, other)])) is None
    # Grouped by shapes: two ranks of one shape still compared beside a third of another.
    assert "compute different" in verdict(*(row([], prints=[(1, q)]) for q in (one, two, other)))


def test_prints_outside_a_meta_loss_over_global_tasks_are_compared_within_a_sample_group():
    p, y = torch.randn(4, 1, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    one, two = (loss_print(lambda p, y, w=w: w * (p - y) ** 2, p, y) for w in (1.0, 2.0))
    # Task groups run other tasks, which may each have a loss of their own (adapt, hand loops).
    assert verdict(row([], group=0, prints=[(0, one)]), row([], group=1, prints=[(0, two)])) is None
    assert "compute different" in verdict(row([], prints=[(0, one)]), row([], prints=[(0, two)]))
    # A rank that ran no task in the first meta_loss: its second meta_loss's print is not
    # compared with the others' first.
    assert verdict(row([], prints=[(1, one), (2, two)]), row([], group=1, prints=[(2, two)])) is None
