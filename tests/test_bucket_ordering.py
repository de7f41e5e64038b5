"""The bucket orders of the layer-wise optimizer (`orthoptim.parallel.layerwise.ordering`) on
small integer layouts, each checked by hand: which slot goes where, and how much padding."""

from types import SimpleNamespace

import torch
from torch import nn

from orthoptim.parallel.assignment import MAX_PADDING
from orthoptim.parallel.layerwise.ordering import adjacent, natural_order, rank_major_order
from orthoptim.parallel.layerwise.slots import Slot, by_param


def whole(name: str, numel: int, owner: int, unit: int = 0) -> Slot:
    return Slot(name, nn.Parameter(torch.zeros(numel)), unit, owner)


def runs(name: str, bounds: list[tuple[int, int, int]], unit: int = 0) -> list[Slot]:
    """One parameter cut in runs (rank, lo, hi), as a sharded AdamW unit."""
    p = nn.Parameter(torch.zeros(bounds[-1][2]))
    return [Slot(name, p, unit, r, flat=(lo, hi)) for r, lo, hi in bounds]


def experts(name: str, parts: list[tuple[int, int, int]], n_expert: int = 4) -> list[Slot]:
    """One [E, 2, 3] stack cut in expert slices (owner, first, stop)."""
    p = nn.Parameter(torch.zeros(n_expert, 2, 3))
    return [Slot(name, p, 0, r, part=(a, b)) for r, a, b in parts]


def names(order: list) -> list:
    return [x if isinstance(x, int) else x.name for x in order]


def test_one_rank_has_no_rank_major_order():
    assert rank_major_order([[whole("a", 4, 0)]], 1) is None


def test_rank_major_shards_pad_the_short_one_at_its_end():
    # shard 0 = a (100), shard 1 = b (99) + 1 element of padding (within MAX_PADDING of 199)
    a, b = whole("a", 100, 0), whole("b", 99, 1)
    laid = rank_major_order([[a], [b]], 2)
    assert laid is not None
    order, width = laid
    assert (names(order), width) == (["a", "b", 1], 100)


def test_rank_major_groups_each_ranks_units_in_its_shard():
    # owners 1, 0, 1: shard 0 = b (100), shard 1 = a (50) + c (49) + 1 of padding
    a, b, c = whole("a", 50, 1), whole("b", 100, 0), whole("c", 49, 1)
    order, width = rank_major_order([[a], [b], [c]], 2)
    assert (names(order), width) == (["b", "a", "c", 1], 100)


def test_rank_major_refuses_more_padding_than_max_padding():
    # 100 and 1 elements: 99 of padding, far above MAX_PADDING of 101
    assert MAX_PADDING * 101 < 99
    assert rank_major_order([[whole("a", 100, 0)], [whole("b", 1, 1)]], 2) is None


def test_rank_major_runs_continue_across_shards():
    # v (10 elements) cut at 6: rank 0's run ends shard 0, rank 1's run starts shard 1, then
    # rank 1's whole unit w (2): shards of 6, no padding, v back to back at 0..10
    v = runs("v", [(0, 0, 6), (1, 6, 10)])
    w = whole("w", 2, 1, unit=1)
    order, width = rank_major_order([v, [w]], 2)
    assert (names(order), width) == (["v{0:6}", "v{6:10}", "w"], 6)


def test_rank_major_refuses_runs_out_of_rank_order():
    v = runs("v", [(1, 0, 5), (0, 5, 10)])
    assert rank_major_order([v], 2) is None


def test_rank_major_refuses_expert_slices_of_several_owners():
    e = experts("e", [(0, 0, 2), (1, 2, 4)])
    assert rank_major_order(by_param(e), 2) is None


def test_natural_order_puts_a_continued_parameter_first_and_a_continuing_one_last():
    # e[2:4] continues a stack begun in the bucket before: first; f[0:2] goes on into the
    # next bucket: last; the whole units between by owner (b's 0 before a's 1)
    e = experts("e", [(0, 2, 4)])
    f = experts("f", [(1, 0, 2)])
    a, b = whole("a", 3, 1), whole("b", 3, 0)
    order = natural_order([f, [a], e, [b]])
    assert names(order) == ["e[2:4]", "b", "a", "f[0:2]"]


def test_natural_order_keeps_a_parameters_slots_back_to_back_in_element_order():
    e = experts("e", [(1, 2, 4), (0, 0, 2)])
    order = natural_order(by_param(e))
    assert names(order) == ["e[0:2]", "e[2:4]"]


def bucket(*units: int) -> SimpleNamespace:
    return SimpleNamespace(slots=[SimpleNamespace(unit=u) for u in units], units=units)


def test_adjacent_keeps_consecutive_buckets_in_order():
    a, b, c = bucket(4, 5), bucket(0, 1), bucket(2, 3)
    assert [x.units for x in adjacent([a, b, c])] == [(0, 1), (2, 3), (4, 5)]


def test_adjacent_puts_buckets_inside_another_range_last():
    # (3) lies inside (2, 4)'s range, (6) inside (5, 7)'s: both after every other bucket,
    # in unit order
    order = adjacent([bucket(5, 7), bucket(6), bucket(2, 4), bucket(3)])
    assert [x.units for x in order] == [(2, 4), (5, 7), (3,), (6,)]
