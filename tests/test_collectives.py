import itertools

import pytest
import torch
import torch.distributed as dist

from models.collectives import cpu_tensor_refusals
from orthoptim.collectives import all_gatherv, all_reduce, all_reduce_symmetric, reduce_scatter
from orthoptim.comm_bytes import (
    CommStats,
    broadcast_bytes,
    reduce_bytes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
)
from orthoptim.shards import pack_upper, packed_triangle_size, unpack_upper

from distributed import run_ranks


def test_pack_unpack_round_trip():
    X = torch.randn(3, 7, 5)
    A = X @ X.mT
    packed = pack_upper(A)
    assert packed.shape == (3, packed_triangle_size(7))
    torch.testing.assert_close(unpack_upper(packed, 7), A)


def _collectives(rank, world_size):
    stats = CommStats()
    g = torch.Generator().manual_seed(rank)
    X = torch.randn(6, 9, generator=g)
    A = X @ X.T
    summed = all_reduce_symmetric(A, stats=stats)
    packed_bytes = stats.as_dict()["all_reduce"]["sent"]
    t = torch.full((4,), float(rank + 1))
    all_reduce(t, stats=stats)
    sizes = [3 + 2 * r for r in range(world_size)]
    parts = all_gatherv(
        torch.full((sizes[rank],), float(rank)), sizes, stats=stats, async_op=True
    ).wait()
    out = torch.empty(2)
    reduce_scatter(out, torch.arange(2.0 * world_size) * (rank + 1), stats=stats)
    return {
        "A": A,
        "summed": summed,
        "packed_bytes": packed_bytes,
        "t": t,
        "parts": parts,
        "rs": out,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_against_local_sums(world_size):
    res = run_ranks(_collectives, world_size)
    total_A = sum(r["A"] for r in res)
    n = world_size
    for rank, r in enumerate(res):
        torch.testing.assert_close(r["summed"], total_A)
        assert r["packed_bytes"] == pytest.approx(2 * (n - 1) / n * packed_triangle_size(6) * 4)
        assert torch.equal(r["t"], torch.full((4,), float(sum(range(1, n + 1)))))
        for src, part in enumerate(r["parts"]):
            assert torch.equal(part, torch.full((3 + 2 * src,), float(src)))
        full = torch.arange(2.0 * n) * sum(range(1, n + 1))
        torch.testing.assert_close(r["rs"], full[2 * rank : 2 * rank + 2])
    assert dist.is_available()


def _device_checks(rank, world_size):
    """Under "cuda:gloo" (CUDA tensors only, like NCCL) on a machine without a GPU."""
    from orthoptim import collectives as C

    errors = cpu_tensor_refusals(world_size)
    return {
        "devices": C.backend_devices(),
        "device_for": C.device_for().type,
        "device_for_cpu": C.device_for(like=torch.device("cpu")).type,
        "errors": errors,
    }


def test_cuda_only_backend_refuses_cpu_tensors_by_name():
    res = run_ranks(_device_checks, 2, backend="cuda:gloo")
    for r in res:
        assert r["devices"] == ("cuda",)
        assert r["device_for"] == r["device_for_cpu"] == "cuda"
        assert set(r["errors"]) == {
            "all_reduce", "reduce_scatter", "all_gather", "all_gatherv", "broadcast", "reduce",
            "all_to_all", "optimizer", "phase",
        }  # fmt: skip
        for name, msg in r["errors"].items():
            assert "cpu" in msg and "cuda:gloo" in msg, (name, msg)
            assert "died" not in msg, (name, msg)
        assert "parameter 'weight'" in r["errors"]["optimizer"]


def _gloo_devices(rank, world_size):
    from orthoptim import collectives as C

    return {
        "devices": C.backend_devices(),
        "device_for": C.device_for(),
        "cuda_like": C.device_for(like=torch.device("cuda", 0)),
        "objects": C.all_gather_object({"rank": rank, "t": torch.arange(rank + 1)}),
        "rank0": C.gather_object(rank * 10, dst=0),
        "agree": C.agree([rank == 0, False], [False, rank == 1]),
    }


def test_gloo_serves_cpu_and_cuda_and_objects_round_trip():
    res = run_ranks(_gloo_devices, 2)
    for rank, r in enumerate(res):
        assert r["devices"] == ("cpu", "cuda")
        assert r["device_for"] == torch.device("cpu")
        assert r["cuda_like"] == torch.device("cuda", 0)
        assert [o["rank"] for o in r["objects"]] == [0, 1]
        assert torch.equal(r["objects"][1]["t"], torch.arange(2))
        assert r["rank0"] == ([0, 10] if rank == 0 else None)
        assert r["agree"] == ([True, False], [False, True])


# --- byte accounting against an independent count ----------------------------------------
#
# `_Wire` runs the ring / chain algorithms step by step on N virtual ranks: real tensors are
# cut into chunks and passed from rank to rank, every message is counted (its numel × element
# size) for the rank that sends it and the rank that receives it, and the result is checked
# (so the simulated algorithm is a genuine reduce-scatter, all-gather, all-reduce, reduce or
# broadcast). Nothing here uses comm_bytes.py's formulas.


class _Wire:
    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = [0] * n
        self.received = [0] * n

    def send(self, src: int, dst: int, t: torch.Tensor) -> torch.Tensor:
        assert src != dst
        b = t.numel() * t.element_size()
        self.sent[src] += b
        self.received[dst] += b
        return t.clone()

    def reduce_scatter(self, inputs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        """Ring: at step k rank r passes its partial sum of chunk r−1−k to rank r+1, which adds
        its own; after N−1 steps rank r holds the full sum of chunk r."""
        n = self.n
        part = [list(x.clone().split(sizes)) for x in inputs]
        for k in range(n - 1):
            msgs = [(r, (r - 1 - k) % n, self.send(r, (r + 1) % n, part[r][(r - 1 - k) % n]))
                    for r in range(n)]  # fmt: skip
            for r, c, t in msgs:
                part[(r + 1) % n][c] += t
        return [part[r][r] for r in range(n)]

    def all_gather(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Ring: at step k rank r passes chunk r−k (its own first) to rank r+1."""
        n = self.n
        have = [{r: chunks[r]} for r in range(n)]
        for k in range(n - 1):
            msgs = [(r, (r - k) % n, self.send(r, (r + 1) % n, have[r][(r - k) % n]))
                    for r in range(n)]  # fmt: skip
            for r, c, t in msgs:
                have[(r + 1) % n][c] = t
        return [torch.cat([have[r][c] for c in range(n)]) for r in range(n)]

    def all_reduce(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Ring reduce-scatter, then ring all-gather, over N element chunks."""
        sizes = [c.numel() for c in inputs[0].tensor_split(self.n)]
        return self.all_gather(self.reduce_scatter(inputs, sizes))

    def reduce(self, inputs: list[torch.Tensor], dst: int, pieces: int = 3) -> torch.Tensor:
        """Pipelined chain dst+1 → dst+2 → … → dst, piece by piece, each rank adding its own."""
        n = self.n
        chain = [(dst + 1 + i) % n for i in range(n)]
        out = []
        for p in range(pieces):
            acc = inputs[chain[0]].tensor_split(pieces)[p].clone()
            for a, b in itertools.pairwise(chain):
                acc = self.send(a, b, acc) + inputs[b].tensor_split(pieces)[p]
            out.append(acc)
        return torch.cat(out)

    def broadcast(self, t: torch.Tensor, src: int, pieces: int = 3) -> list[torch.Tensor]:
        """Pipelined chain src → src+1 → … → src−1, piece by piece."""
        n = self.n
        chain = [(src + i) % n for i in range(n)]
        got: dict[int, list[torch.Tensor]] = {src: list(t.tensor_split(pieces))}
        for a, b in itertools.pairwise(chain):
            got[b] = [self.send(a, b, x) for x in got[a]]
        return [torch.cat(got[r]) for r in range(n)]


def _replay(wire: _Wire, call: dict) -> None:
    """Run one logged collective on `wire` with random data of its size; check the result."""
    n, numel, dtype, root = wire.n, call["numel"], call["dtype"], call["root"]
    g = torch.Generator().manual_seed(numel)
    xs = [torch.randint(-8, 8, (numel,), generator=g).to(dtype) for _ in range(n)]
    total = sum(x.double() for x in xs)
    fn = call["fn"]
    if fn == "all_reduce":
        for y in wire.all_reduce(xs):
            assert torch.equal(y.double(), total)
    elif fn == "reduce_scatter":  # numel: the input, N equal chunks
        ys = wire.reduce_scatter(xs, [numel // n] * n)
        assert torch.equal(torch.cat(ys).double(), total)
    elif fn == "all_gather":  # numel: one rank's (padded) input
        for y in wire.all_gather(xs):
            assert torch.equal(y, torch.cat(xs))
    elif fn == "reduce":
        assert torch.equal(wire.reduce(xs, root).double(), total)
    elif fn == "broadcast":
        for y in wire.broadcast(xs[root], root):
            assert torch.equal(y, xs[root])
    else:
        raise AssertionError(f"no simulator for {fn}")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_accounting_helpers_equal_simulated_algorithms(n):
    """Per rank, the byte formulas orthoptim.collectives records with (`comm_bytes`) equal
    what the simulated ring and chain algorithms move, for uneven chunks and every root;
    sent = received summed."""
    sizes = [3 + 2 * r for r in range(n)]
    xs = [torch.randn(sum(sizes), dtype=torch.float64) for _ in range(n)]
    w = _Wire(n)
    ys = w.reduce_scatter(xs, sizes)
    torch.testing.assert_close(torch.cat(ys), sum(xs))
    assert list(zip(w.sent, w.received)) == ring_reduce_scatter_bytes([8 * s for s in sizes])
    w = _Wire(n)
    w.all_gather(list(torch.ones(sum(sizes)).split(sizes)))
    assert list(zip(w.sent, w.received)) == ring_all_gather_bytes([4 * s for s in sizes])
    w = _Wire(n)
    w.all_reduce([torch.ones(6 * n) for _ in range(n)])
    assert w.sent == w.received == [ring_all_reduce_bytes(4 * 6 * n, n)] * n
    for root in range(n):
        w = _Wire(n)
        torch.testing.assert_close(w.reduce(xs, root), sum(xs))
        assert list(zip(w.sent, w.received)) == reduce_bytes(8 * sum(sizes), n, root)
        w = _Wire(n)
        w.broadcast(xs[root], root)
        assert list(zip(w.sent, w.received)) == broadcast_bytes(8 * sum(sizes), n, root)
        assert sum(w.sent) == sum(w.received) == (n - 1) * 8 * sum(sizes)


def _logged_step(rank, world_size):
    """One real LayerwiseDistributedOptimizer step (fp32 and bf16 gathers) with buckets of one
    owner (reduce + broadcast) and a rank-major one (reduce-scatter + all-gather), and a
    reduce and broadcast on the subgroup [1, 2] (group ranks ≠ global).
    Every torch.distributed collective it issues is logged with its group, size and root."""
    from torch import nn

    from orthoptim import collectives as C
    from orthoptim.collectives import ops
    from orthoptim.parallel import LayerwiseDistributedOptimizer

    log, phase = [], ["setup"]

    def logged(fn_name, original, root_kw=None, numel_of=0):
        def call(*args, **kw):
            t = args[numel_of] if len(args) > numel_of else kw["tensor"]
            group = kw.get("group")
            root = kw.get(root_kw, args[1] if root_kw and len(args) > 1 else None)
            log.append({
                "phase": phase[0], "fn": fn_name, "numel": t.numel(), "dtype": t.dtype,
                "root": root, "ranks": tuple(dist.get_process_group_ranks(group or
                                                                        dist.group.WORLD)),
            })  # fmt: skip
            return original(*args, **kw)

        return call

    dist.all_reduce = logged("all_reduce", dist.all_reduce)
    dist.reduce = logged("reduce", dist.reduce, "dst")
    dist.broadcast = logged("broadcast", dist.broadcast, "src")
    ops._REDUCE_SCATTER = logged("reduce_scatter", ops._REDUCE_SCATTER, numel_of=1)
    ops._ALL_GATHER = logged("all_gather", ops._ALL_GATHER, numel_of=1)

    out = {}
    for gather in (None, torch.bfloat16):
        phase[0] = "setup"
        torch.manual_seed(0)
        # 64×64 ≥ 0.01 MiB: alone in a bucket (reduce + broadcast), as are the 32×32 pairs;
        # the AdamW head, 32×15, is dealt in 3 equal runs: one rank-major bucket
        # (reduce-scatter + all-gather)
        model = nn.Sequential(
            nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False),
            *[nn.Linear(32, 32, bias=False) for _ in range(6)], nn.Linear(32, 15, bias=False),
        )  # fmt: skip
        opt = LayerwiseDistributedOptimizer(
            model, optimizer="muon", lr=0.02, bucket_mb=0.01, gather_dtype=gather
        )
        phase[0] = str(gather)
        torch.manual_seed(rank)
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.wait_for_params()
        out[str(gather)] = opt.comm_stats()
    phase[0] = "subgroup"
    sub = dist.new_group([1, 2])
    stats = CommStats()
    if rank in (1, 2):
        C.reduce(torch.ones(7), dst=2, group=sub, stats=stats)
        C.reduce(torch.ones(3), dst=1, group=sub, stats=stats)
        C.broadcast(torch.ones(7), src=2, group=sub, stats=stats)
        C.broadcast(torch.ones(5, dtype=torch.float64), src=1, group=sub, stats=stats)
    out["subgroup"] = stats.as_dict()
    out["log"] = log
    return out


def test_comm_stats_of_a_real_step_equal_simulated_algorithms():
    """3 gloo ranks: the bytes CommStats recorded in a real layer-wise step (and subgroup
    reduce / broadcast), per rank and collective kind, equal what the simulated algorithms
    move for the collectives the step actually issued; summed over ranks, sent = received for
    every kind. (Under the old accounting the middle rank of each reduce / broadcast chain
    counted nothing, and summed sent = received held only by luck of the owner's position.)"""
    n = 3
    res = run_ranks(_logged_step, n)
    for phase in ("None", "torch.bfloat16", "subgroup"):
        # The same collectives in the same order on every member of a group: replay each once.
        calls: dict[tuple[int, ...], list[list[dict]]] = {}
        for rank, r in enumerate(res):
            for c in r["log"]:
                if c["phase"] == phase:
                    per = calls.setdefault(c["ranks"], [[] for _ in range(n)])
                    per[rank].append(c)
        want = [dict() for _ in range(n)]
        slack = [dict() for _ in range(n)]
        for ranks, per in calls.items():
            members = [per[g] for g in ranks]
            assert all(len(m) == len(members[0]) for m in members), ranks
            for seq in zip(*members):
                assert len({(c["fn"], c["numel"], c["dtype"], c["root"]) for c in seq}) == 1
                c = dict(seq[0])
                c["root"] = None if c["root"] is None else ranks.index(c["root"])
                w = _Wire(len(ranks))
                _replay(w, c)
                es = torch.empty(0, dtype=c["dtype"]).element_size()
                uneven = c["fn"] == "all_reduce" and c["numel"] % len(ranks)
                for g, global_rank in enumerate(ranks):
                    d = want[global_rank].setdefault(c["fn"], [0, 0])
                    d[0] += w.sent[g]
                    d[1] += w.received[g]
                    # all_reduce is recorded as the mean over ranks when N ∤ numel
                    s = slack[global_rank]
                    s[c["fn"]] = s.get(c["fn"], 0) + (2 * es if uneven else 0)
        got = [{k: v for k, v in r[phase].items() if k != "total"} for r in res]
        kinds = {"None": {"reduce", "broadcast", "reduce_scatter", "all_gather", "all_reduce"},
                 "torch.bfloat16": {"reduce", "broadcast", "reduce_scatter", "all_gather",
                                    "all_reduce"},
                 "subgroup": {"reduce", "broadcast"}}[phase]  # fmt: skip
        assert set().union(*(set(g) for g in got)) == kinds, phase
        for rank in range(n):
            assert set(got[rank]) == set(want[rank]), (phase, rank)
            for kind, (sent, received) in want[rank].items():
                tol = slack[rank][kind] + 1e-9
                assert abs(got[rank][kind]["sent"] - sent) <= tol, (phase, rank, kind)
                assert abs(got[rank][kind]["received"] - received) <= tol, (phase, rank, kind)
        for kind in kinds:
            sent = sum(g[kind]["sent"] for g in got if kind in g)
            received = sum(g[kind]["received"] for g in got if kind in g)
            assert sent == pytest.approx(received, rel=1e-12), (phase, kind)
    # the single-owner buckets went through reduce + broadcast to every rank as owner
    roots = {c["root"] for c in res[0]["log"] if c["fn"] == "reduce" and c["phase"] == "None"}
    assert roots == {0, 1, 2}
