import itertools
import math

import pytest
import torch
from torch import nn

from orthoptim.parallel.assignment import (
    Assignment,
    Unit,
    assign,
    make_buckets,
    unit_cost,
    units_from_model,
)


def test_unit_cost_formulas():
    assert unit_cost((768, 3072), "muon") == 3072 * 768**2
    assert unit_cost((3072, 768), "muon") == 3072 * 768**2
    assert unit_cost((8, 64, 32), "muon") == 8 * 64 * 32**2  # 8 experts
    assert unit_cost((16, 3, 5, 5), "muon") == 75 * 16**2  # conv as (out, in·kh·kw)
    assert unit_cost((64, 32), "soap") == 64**3 + 32**3
    assert unit_cost((4, 64, 32), "soap") == 4 * (64**3 + 32**3)
    assert unit_cost((64, 32), "adamw") == 64 * 32
    assert unit_cost((100,), "muon") == 100  # vectors cost their size whatever the kind


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kind"):
        unit_cost((4, 4), "sgd")
    units = [Unit("w", (4, 4), "muon", 64)]
    with pytest.raises(ValueError, match="balance"):
        assign(units, 2, balance="greedy")
    with pytest.raises(ValueError, match="world_size"):
        assign(units, 0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        assign(units, 2, bucket_bytes=0)


def _brute_force_best_max(costs, n):
    best = math.inf
    for owners in itertools.product(range(n), repeat=len(costs)):
        load = [0.0] * n
        for c, r in zip(costs, owners):
            load[r] += c
        best = min(best, max(load))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_cost_balance_within_lpt_bound_of_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    n = 3
    shapes = [tuple(int(x) for x in torch.randint(8, 200, (2,), generator=g)) for _ in range(8)]
    units = [Unit(f"w{i}", s, "muon", 4 * s[0] * s[1]) for i, s in enumerate(shapes)]
    # one unit per bucket (nothing to pad): plain longest-processing-time first
    a = assign(units, n, balance="cost", bucket_bytes=1)
    assert all(len(b) == 1 for b in a.buckets)
    opt = _brute_force_best_max([u.cost for u in units], n)
    # Graham's bound for longest-processing-time first.
    assert max(a.rank_cost) <= (4 / 3 - 1 / (3 * n)) * opt * (1 + 1e-12)
    assert sorted(set(a.owners)) == list(range(n))


def _kimi_k2_like_units():
    """Kimi K2's matrices (61 layers, MLA attention, 384 experts of 7168×2048 + 1 shared,
    first layer dense), one unit per expert matrix, in backward order."""
    d, e_ff, n_exp = 7168, 2048, 384
    units = []
    for layer in range(61):
        p = f"layers.{layer}."
        mats = [
            ("q_a", (1536, d)),
            ("q_b", (64 * 192, 1536)),
            ("kv_a", (576, d)),
            ("kv_b", (64 * 256, 512)),
            ("o", (d, 64 * 128)),
        ]
        if layer == 0:
            mats += [("up", (18432, d)), ("gate", (18432, d)), ("down", (d, 18432))]
        else:
            mats += [
                ("shared_up", (e_ff, d)),
                ("shared_gate", (e_ff, d)),
                ("shared_down", (d, e_ff)),
            ]
            for w, shape in (("w1", (e_ff, d)), ("w3", (e_ff, d)), ("w2", (d, e_ff))):
                for e in range(n_exp):
                    units.append(Unit(p + w, (1, *shape), "muon", 2 * d * e_ff, (e, e + 1)))
        units += [Unit(p + n, s, "muon", 2 * s[0] * s[1]) for n, s in mats]
    units.append(Unit("embed", (163840, d), "adamw", 2 * 163840 * d))
    units.append(Unit("lm_head", (163840, d), "adamw", 2 * 163840 * d))
    return units[::-1]


def test_cost_balance_on_a_large_moe_beats_the_baselines():
    units = _kimi_k2_like_units()
    cost = assign(units, 64, balance="cost")
    rr = assign(units, 64, balance="round_robin")
    capped = assign(units, 64, balance="capped")
    assert cost.imbalance <= 1.03
    assert cost.imbalance < rr.imbalance
    assert cost.imbalance < capped.imbalance
    assert sum(cost.rank_cost) == pytest.approx(sum(u.cost for u in units))


def test_assignment_is_deterministic_and_consistent():
    units = _kimi_k2_like_units()[:3000]
    a, b = assign(units, 8), assign(list(units), 8)
    assert a.owners == b.owners and a.buckets == b.buckets
    for r in range(8):
        mine = a.units_of(r)
        assert a.rank_cost[r] == pytest.approx(sum(units[i].cost for i in mine))
        assert a.rank_bytes[r] == sum(units[i].nbytes for i in mine)


def test_round_robin_deals_size_sorted_units():
    sizes = [10, 40, 30, 20, 50]
    units = [Unit(f"w{i}", (s,), "adamw", s) for i, s in enumerate(sizes)]
    a = assign(units, 2, balance="round_robin")
    # sorted by size: 50(4), 40(1), 30(2), 20(3), 10(0) → ranks 0, 1, 0, 1, 0
    assert a.owners == [0, 1, 0, 1, 0]


def test_capped_fills_ranks_in_order_up_to_the_cap():
    units = [Unit(f"w{i}", (10,), "adamw", 40) for i in range(8)]
    a = assign(units, 4, balance="capped", bucket_bytes=10**9)
    # mean per rank 20, cap 26: two units per rank, in order.
    assert a.owners == [0, 0, 1, 1, 2, 2, 3, 3]
    b = assign(units, 4, balance="capped", bucket_bytes=40)
    # one unit per bucket: each bucket starts after the rank the previous one ended on
    assert b.buckets == [[i] for i in range(8)]
    assert b.owners == [0, 1, 2, 3, 0, 1, 2, 3]


def test_buckets_cover_every_unit_once_and_are_bounded():
    nbytes = [5, 5, 20, 3, 3, 3, 9, 1]
    buckets = make_buckets(nbytes, 10)
    assert sorted(i for b in buckets for i in b) == list(range(len(nbytes)))
    assert [b[0] for b in buckets] == sorted(b[0] for b in buckets)
    for b in buckets:
        assert len(b) == 1 or sum(nbytes[i] for i in b) <= 10
    assert buckets == [[0, 1], [2], [3, 4, 5], [6, 7]]  # an oversized unit goes alone
    # at N ranks a bucket may grow to 2·N × its largest unit, so whole units fill N shards;
    # the oversized unit does not cut the bucket being filled
    wide = make_buckets(nbytes, 10, world_size=2)
    assert wide == [[0, 1, 3, 4, 5, 6, 7], [2]]


def _gpt_units(layers=12, d=768, vocab=50304):
    """A GPT's units in backward order: per layer q, k, v, o (d×d), fc (4d×d), proj (d×4d)."""
    units = [Unit("embed", (vocab, d), "adamw", 4 * vocab * d)]
    for i in range(layers):
        for name, shape in (
            ("q", (d, d)),
            ("k", (d, d)),
            ("v", (d, d)),
            ("o", (d, d)),
            ("fc", (4 * d, d)),
            ("proj", (d, 4 * d)),
        ):
            units.append(Unit(f"{i}.{name}", shape, "muon", 4 * shape[0] * shape[1]))
        units.append(Unit(f"{i}.norm", (d,), "adamw", 4 * d))
    units.append(Unit("head", (vocab, d), "adamw", 4 * vocab * d))
    return units[::-1]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_cost_balance_keeps_bucket_shards_even(world_size):
    units = _gpt_units()
    total = sum(u.nbytes for u in units)
    a = assign(units, world_size)
    # padding of the communicated buckets stays small ...
    assert a.padded_bytes() <= 1.12 * total
    # ... and below what balancing cost alone over the same buckets gives
    lpt_owners = assign(units, world_size, bucket_bytes=1).owners
    lpt = Assignment(lpt_owners, a.rank_cost, a.rank_bytes, a.buckets, a.unit_bytes)
    assert a.padded_bytes() <= lpt.padded_bytes()
    assert a.imbalance <= 1.06


def test_padded_bytes_layout_formula():
    units = [Unit(f"w{i}", (s,), "adamw", 4 * s) for i, s in enumerate([6, 2, 3, 5])]
    a = assign(units, 2, balance="round_robin", bucket_bytes=10**9)
    # owners by size: 6→0, 5→1, 3→0, 2→1 → shards rank0 = 36 B, rank1 = 28 B, padded to 36.
    assert a.bucket_shard_bytes(0) == [36, 28]
    assert a.padded_bytes() == 72


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.fc = nn.Linear(8, 16)
        self.experts = nn.Parameter(torch.zeros(4, 16, 8))
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.lm_head = nn.Linear(8, 50, bias=False)
        self.lm_head.weight = self.embed.weight  # tied


def test_units_from_model_backward_order_routing_and_expert_slices():
    m = _Tiny()
    units = units_from_model(m)
    # named_parameters: experts, embed.weight, fc.weight, fc.bias (frozen and tied left out)
    assert [u.name for u in units] == ["fc.bias", "fc.weight", "embed.weight", "experts"]
    assert [u.kind for u in units] == ["adamw", "muon", "adamw", "muon"]
    assert units[1].nbytes == 16 * 8 * 4 and units[3].part is None
    split = units_from_model(m, split_experts=3)
    experts = [u for u in split if u.name == "experts"]
    assert [u.part for u in experts] == [(0, 3), (3, 4)]
    assert [u.shape for u in experts] == [(3, 16, 8), (1, 16, 8)]
    assert sum(u.nbytes for u in experts) == 4 * 16 * 8 * 4
    assert all(u.kind == "adamw" for u in units_from_model(m, optimizer="adamw"))
