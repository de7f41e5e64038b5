"""What one rank of the layer-wise optimizer holds, by category, modelled on the real code.

The categories are those a dry run of the real code measures (`memory_per_rank`):

    params     every parameter the rank holds (its stage's, its TP shards, its EP rank's
               experts), in the parameter dtype
    grads      their `.grad` (autograd accumulates a full local gradient of every parameter;
               the owned units' reduced gradients are views of the bucket buffers)
    masters    a copy of every owned element when the gather dtype rounds (`gather_dtype`)
    state      the inner optimizers' state of what the rank owns: Muon's momentum (one per
               element), AdamW's two moments on its runs, in the state dtype (`state_dtype`)
    buffers    the buckets' flat buffers (`layerwise._Bucket`): a bucket of several owners
               holds grad_flat (N shards of `width`), grad_shard and gather_in (`width`
               each) and, when the gather dtype differs, a gather_flat of N·width; a bucket
               of one owner holds a grad_flat of `width`, and its owner a gather_flat too;
               a bucket of a group of one rank (an expert group when ep = dp) holds none
    transient  the step's own peak above that: Muon's Nesterov updates of every owned
               matrix (alive through the whole batched call), the orthogonalized outputs
               of the batches done so far, and the batch in flight, a chunk of at most
               `Layout.ns_batch_mb` of a same-shape stack (its fp32 stack when several
               blocks are stacked, its output, the iteration-dtype copy X and one step's
               X·Xᵀ, b·A + c·A·A and B·X); or AdamW's temporaries
               (foreach on CUDA: a square root of every owned second moment); whichever
               is larger, or the non-finite check of the widest gradient shard
    peak       params + grads + masters + state + buffers + transient: an upper bound by
               the owned whole parameters' gradients, which the step re-points at views of
               the buckets (freeing autograd's copies)

`Layout.device` picks the paths: same-shape matrices stacked except on "cpu"
(`stacking_pays`), the Gram form where `ns_path` takes it, foreach AdamW on "cuda" only.

`Layout.optimizer` "soap": SOAP's state (two moments, a Kronecker factor and an eigenbasis
of each side per matrix) and its step's temporaries (`_soap_transient`). `Layout.fsdp`:
`FSDPOptimizer` over FSDP2 (`fsdp_rows`). `Layout.tp` > 1: the tensor-parallel
orthogonalizer's gathers and Gram buffers per `Layout.tp_mode` (`_tp_transient`, checked
against the dry run of the real code).

What is not modelled: SOAP's first step (a full `eigh` per factor) and its refresh steps
(every `precondition_frequency`), Muon's `split` blocks of fused matrices, FSDP2's forward
and backward beyond the `fsdp_gather` estimate, and the model's activations.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from orthoptim.newton_schulz import GRAM_FORM_RESTART, batch_chunks, batch_limit
from orthoptim.parallel.assignment import MatrixCost
from orthoptim.plan.model import Matrix

# The planner's types (`planner.Layout`, its groups and slots), not imported: the planner
# imports this module.
Layout = Any
Group = Any

CATEGORIES = ("params", "grads", "masters", "state", "buffers", "transient")


def _step_iterate(x: int, square: int, steps: int, into_out: bool) -> int:
    """Peak bytes of the plain iteration on a batch whose X takes `x` bytes and each m×m
    matrix `square`: X, A = X·Xᵀ, B = b·A + c·A·A and the next X, which the last step writes
    into the output when the dtypes agree (`into_out`)."""
    return (x if steps == 1 and into_out else 2 * x) + 2 * square


def _gram_iterate(x: int, square: int, steps: int, into_out: bool) -> int:
    """Peak bytes of `newton_schulz_gram_form` (runs of GRAM_FORM_RESTART steps): the input
    X (kept by the caller) and, after the first run, the X it made; the m×m matrices of a run
    (A, Q, R and the two products A·Q·Q in flight: 5 from its second step on when a third
    follows, 4 in a run of two, 2 in a run of one; 4 when a run starts while the last one's
    A, Q, R are alive); and R·X made afresh except in the last run when it writes into the
    output (`into_out`)."""
    runs = [min(GRAM_FORM_RESTART, steps - s) for s in range(0, steps, GRAM_FORM_RESTART)]
    peak = 0
    for j, r in enumerate(runs):
        held = x if j == 0 else 2 * x
        squares = 5 if r >= 3 else (4 if r == 2 else 2)
        if j:
            squares = max(squares, 4 if runs[j - 1] >= 2 else 3)
        peak = max(peak, held + squares * square)
        if j < len(runs) - 1 or not into_out:
            peak = max(peak, held + x + 3 * square)
    return peak


def _bucket_buffers(g: Group, pb: int, gb: int, rounds: bool) -> tuple[list[int], list[int]]:
    """Per rank of `g`'s world: the bytes of bucket buffers it holds (`layerwise._Bucket`),
    with `pb` the parameter (gradient) element size, `gb` the gather's and `rounds` whether
    the gather dtype differs; and the widest gradient shard it checks for non-finite values."""
    a, n = g.assignment, g.world
    numels = [math.prod(u.shape) for u in g.units]
    out = [0] * n
    widest = [0] * n
    for b, bucket in enumerate(a.buckets):
        share = [0] * n
        for i in bucket:
            if a.owners[i] >= 0:
                share[a.owners[i]] += numels[i]
        if b < len(a.adamw_split) and a.adamw_split[b]:
            share = [s + x for s, x in zip(share, a.adamw_split[b], strict=True)]
        holders = [r for r in range(n) if share[r]]
        if not holders:
            continue  # no slot has elements: the optimizer makes no bucket
        if n == 1:
            # nothing is sent: the gradients are used (and checked) where autograd left them
            widest[0] = max(widest[0], *(numels[i] for i in bucket))
            continue
        width = max(share)
        for r in holders:
            widest[r] = max(widest[r], width)
        if len(holders) == 1:  # single: reduced to its owner, broadcast from it
            for r in range(n):
                # grad_flat; a gather_flat of its own where the gather rounds, and on the
                # owner, whose gradients are views of its grad_flat
                out[r] += width * pb + (width * gb if rounds or r == holders[0] else 0)
            continue
        common = n * width * pb + width * pb + width * gb  # grad_flat, grad_shard, gather_in
        if rounds:
            common += n * width * gb  # gather_flat of its own
        for r in range(n):
            out[r] += common
    return out, widest


def _muon_transient(
    owned: Sequence[tuple[int, tuple[int, ...]]],
    layout: Layout,
    sb: int,
    cb: int,
    fresh_updates: bool = True,
) -> int:
    """Peak bytes of one Muon step over the owned matrices, given as (forward position,
    local shape): `sb` the state (update) element size, `cb` the iteration's; the Nesterov
    updates counted unless the caller holds them already (`fresh_updates` False). A stack
    goes in chunks of at most `batch_limit(rows, cols, layout.ns_batch_mb)` matrices
    (`orthogonalize_blocks`): per chunk its concatenation (of several blocks), its output and
    the iteration; a block cut by a chunk boundary gets a buffer of its own at its first
    chunk, and a chunk's output stays only while a whole block in it is a view of it."""
    stack = layout.device != "cpu"  # `newton_schulz.stacking_pays`
    price = MatrixCost(layout.device, layout.ns_dtype, layout.ns_steps)
    batches: dict[tuple[int, int], list[int]] = {}
    updates = 0
    for _, shape in sorted(owned):
        k = math.prod(shape[:-2]) if len(shape) > 2 else 1
        updates += math.prod(shape) * sb  # the Nesterov update, a fresh tensor
        if stack:
            batches.setdefault(shape[-2:], []).append(k)
        else:
            batches.setdefault((len(batches), *shape[-2:]), []).append(k)
    done, peak = 0, 0
    for key, blocks in batches.items():
        rows, cols = key[-2:]
        m, n = sorted((rows, cols))
        form, _ = price.path(m, n)
        limit = batch_limit(rows, cols, layout.ns_batch_mb) if stack else None
        for chunk in batch_chunks(blocks, limit):
            k = sum(take for _, _, take in chunk)
            out = k * m * n * sb
            cat = out if len(chunk) > 1 else 0
            x, square = k * m * n * cb, k * m * m * cb
            iterate = (_gram_iterate if form == "gram" else _step_iterate)(
                x, square, layout.ns_steps, cb == sb
            )
            peak = max(peak, done + out + cat + iterate)
            whole = any(take == blocks[e] for e, _, take in chunk)
            # the buffer of a block cut here, made at its first piece
            cut = sum(blocks[e] for e, first, take in chunk if take < blocks[e] and first == 0)
            peak = max(peak, done + out + cut * m * n * sb)
            done += cut * m * n * sb + (out if whole else 0)
    return (updates if fresh_updates else 0) + peak


def _soap_transient(owned: Sequence[tuple[int, tuple[int, ...]]], sb: int) -> int:
    """Peak bytes of one SOAP step (not a refresh one) over the owned matrices, given as
    (forward position, shape), one after the other (`SOAP._direction`): the directions of
    those done so far and, for the one in flight, its rotated gradient G', the denominator
    and its direction with both Kronecker factors' outer products G·Gᵀ and Gᵀ·G (the first
    still referenced while the second is made). That is above the five m×n of rotating the
    Adam step back, as m² + n² ≥ 2·m·n."""
    done, peak = 0, 0
    for _, shape in sorted(owned):
        k = math.prod(shape[:-2]) if len(shape) > 2 else 1
        m, n = shape[-2:]
        x = k * m * n * sb
        peak = max(peak, done + 3 * x + k * (m * m + n * n) * sb)
        done += x
    return peak


def _soap_state(shape: tuple[int, ...], sb: int) -> int:
    """SOAP's state of an owned matrix: two moments, and per matrix a Kronecker factor and
    an eigenbasis of each side (`SOAP.state_numel`; every side within `max_precond_dim`)."""
    k = math.prod(shape[:-2]) if len(shape) > 2 else 1
    m, n = shape[-2:]
    return (2 * math.prod(shape) + 2 * k * (m * m + n * n)) * sb


def _adamw_transient(runs: Sequence[int], layout: Layout, sb: int) -> int:
    """Peak bytes of torch's AdamW step over owned pieces of `runs` elements: foreach on
    CUDA (a square root of every second moment at once), else one parameter at a time
    (its square root and the denominator made from it)."""
    if not runs:
        return 0
    if layout.device == "cuda":
        return sum(runs) * sb
    return 2 * max(runs) * sb


def _matrix_transient(
    owned: Sequence[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]],
    layout: Layout,
    sb: int,
    cb: int,
) -> int:
    """The matrix optimizer's step over the owned matrices, given as (forward position,
    local shape, TP-split dim, global shape): Muon's (`_muon_transient`, or through the
    tensor-parallel orthogonalizer, `_tp_transient`) or SOAP's."""
    if layout.optimizer == "soap":
        return _soap_transient([(pos, shape) for pos, shape, _, _ in owned], sb)
    if layout.tp > 1:
        return _tp_transient(owned, layout, sb, cb)
    return _muon_transient([(pos, shape) for pos, shape, _, _ in owned], layout, sb, cb)


def _finish(rows: list[dict[str, int]], gather: str) -> dict[str, Any]:
    for row in rows:
        row["steady"] = sum(row[k] for k in CATEGORIES if k != "transient")
        row["peak"] = row["steady"] + row["transient"]
    worst = max(range(len(rows)), key=lambda r: rows[r]["peak"])
    return {
        "rank_0": {"rank": 0, **rows[0]},
        "rank_last": {"rank": len(rows) - 1, **rows[-1]},
        "max": {k: max(r[k] for r in rows) for k in rows[0]},
        "max_peak_rank": worst,
        "per_rank": rows,  # every slot's categories, in slot order
        "peak_per_rank": [r["peak"] for r in rows],
        "state_per_rank": [r["state"] for r in rows],
        "masters_per_rank": [r["masters"] for r in rows],
        "gather_dtype": gather,
        "ranks": "(pipeline stage, data-parallel rank), stage-major; one TP rank of each",
    }


def memory_per_rank(
    slots: Sequence[Sequence[tuple[Group, int]]],
    by_stage: Sequence[Sequence[Group]],
    matrices: Sequence[Matrix],
    layout: Layout,
    dtype_bytes: dict[str, int],
) -> dict[str, Any]:
    """Bytes per category on every (stage, DP rank) of the layout, as the layer-wise
    optimizer (or with `layout.fsdp` the FSDP one, `fsdp_rows`) holds them (module
    docstring), with rank 0's, the last rank's and the maximum over ranks of each category,
    and every rank's state and master copies (`state_per_rank`, `masters_per_rank`)."""
    pb = dtype_bytes[layout.grad_dtype]  # parameters and gradients: the reduced dtype
    gather = layout.gather_dtype or layout.grad_dtype
    gb = dtype_bytes[gather]
    sb = max(pb, 4)  # `state_dtype`: float32 for half-precision parameters
    cb = dtype_bytes[layout.ns_dtype]
    position = {m: i for i, m in enumerate(matrices)}
    if layout.fsdp:
        return _finish(fsdp_rows(by_stage, position, layout, pb, sb, cb), gather)
    masters = layout.masters
    dealt = {}
    buffers: dict[int, tuple[list[int], list[int]]] = {}
    for stage_groups in by_stage:
        for g in stage_groups:
            for s in g.siblings or [g]:
                d = s.dealt(masters)
                dealt[id(s)] = d
                buffers[id(s)] = _bucket_buffers(d, pb, gb, masters)
    rows: list[dict[str, int]] = []
    for slot in slots:
        # every unit of the rank's groups, in its local (TP-shard) shape
        held = sum(math.prod(u.shape) for g, _ in slot for u in g.units)
        owned_elements, state = 0, 0
        owned: list[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]] = []
        adamw: list[int] = []
        buf, widest = 0, 0
        for g, gr in slot:
            d = dealt[id(g)]
            buf += buffers[id(g)][0][gr]
            widest = max(widest, buffers[id(g)][1][gr])
            for i in d.owned(gr):
                m, u = d.matrices[i], d.units[i]
                numel = math.prod(u.shape)
                owned_elements += numel
                if m.kind != "muon":
                    state += 2 * numel * sb
                    adamw.append(numel)
                    continue
                full = u.shape[:-2] + m.shape[-2:]
                owned.append((position[m], u.shape, m.tp_dim, full))
                state += _soap_state(u.shape, sb) if layout.optimizer == "soap" else numel * sb
            runs = [split[gr] for split in d.assignment.adamw_split if split and split[gr]]
            owned_elements += sum(runs)
            state += 2 * sum(runs) * sb
            adamw += runs
        rows.append(
            {
                "params": held * pb,
                "grads": held * pb,
                "masters": owned_elements * pb if masters else 0,
                "state": state,
                "buffers": buf,
                "transient": max(
                    _matrix_transient(owned, layout, sb, cb),
                    _adamw_transient(adamw, layout, sb),
                    # the non-finite check of a gradient shard: isfinite(x) is composite,
                    # (x == x) * (x.abs() != inf), all four alive at once
                    widest * (pb + 3),
                ),
                "fsdp_gather": 0,
            }
        )
    return _finish(rows, gather)


def _fsdp_params(
    stage_groups: Sequence[Group], position: dict[Matrix, int]
) -> list[tuple[str, tuple[int, ...], str, int, int | None]]:
    """The stage's parameters as FSDP2 shards them, in backward order: (name, global shape,
    kind, forward position, layer), the routed experts of one parameter as one 3-D stack."""
    out: dict[str, list[Any]] = {}
    for g in stage_groups:
        for m in g.matrices:
            if m.param not in out:
                shape = m.shape if m.expert is None else (0, *m.shape)
                out[m.param] = [m.param, shape, m.kind, position[m], m.layer]
            entry = out[m.param]
            if m.expert is not None:
                entry[1] = (entry[1][0] + 1, *entry[1][1:])
            entry[3] = min(entry[3], position[m])
    return [tuple(v) for v in out.values()]  # type: ignore[misc]


def fsdp_rows(
    by_stage: Sequence[Sequence[Group]],
    position: dict[Matrix, int],
    layout: Layout,
    pb: int,
    sb: int,
    cb: int,
) -> list[dict[str, int]]:
    """Bytes per category on every (stage, DP rank) under `FSDPOptimizer` over FSDP2:

    params, grads  every parameter's dim-0 shard padded as FSDP2 pads it (⌈d₀/N⌉ rows on
                   every rank, the last ranks' rows partly or wholly padding; gradients are
                   views of the reduce-scatter's output, padded alike)
    state          Muon's momentum and AdamW's moments on the local (unpadded) shards; SOAP's
                   whole-matrix state on each matrix's owner (`assign` over the whole 3-D
                   parameters, default cost, as `FSDPOptimizer`)
    transient      the step: every shard's Nesterov update, each bucket's forward send and
                   receive buffers, the owner's whole matrices, then the owner's directions
                   (Newton-Schulz of the whole matrices, or SOAP's), or the directions with
                   the back exchange's buffers (every bucket's, the size of what it sent, and
                   one bucket's return buffer at a time); or AdamW's, or the non-finite check
                   of the widest gradient shard
    fsdp_gather    FSDP2's own unsharded buffers during forward and backward, not part of
                   the step and so not of `transient` or `peak` (the step runs after FSDP2
                   has freed them): the root module's parameters (embeddings, head, final
                   norm, unsharded from forward to backward), two adjacent blocks'
                   parameters (the one computing and the one prefetched) and one block's
                   unsharded gradients (the reduce-scatter's input). An estimate: FSDP2's
                   forward and backward cannot run on meta tensors under the fake group.
    """
    from orthoptim.parallel.assignment import Unit, assign

    dp = layout.dp
    rows: list[dict[str, int]] = []
    for stage_groups in by_stage:
        params = _fsdp_params(stage_groups, position)

        def rest(shape: tuple[int, ...]) -> int:
            return math.prod(shape[1:])

        chunk = [-(-shape[0] // dp) for _, shape, _, _, _ in params]
        matrices = [i for i, p in enumerate(params) if p[2] == "muon"]
        units = [
            Unit(params[i][0], params[i][1], layout.optimizer, chunk[i] * rest(params[i][1]) * pb)
            for i in matrices
        ]
        a = assign(units, dp, balance="cost", bucket_bytes=int(layout.bucket_mb * 2**20))
        padded = sum(c * rest(p[1]) for c, p in zip(chunk, params, strict=True))
        unsharded: dict[int | None, int] = {}
        for c, p in zip(chunk, params, strict=True):
            unsharded[p[4]] = unsharded.get(p[4], 0) + dp * c * rest(p[1]) * pb
        root = unsharded.pop(None, 0)
        blocks = [unsharded[k] for k in sorted(unsharded)]
        pairs = [x + y for x, y in itertools.pairwise(blocks)] or blocks or [0]
        gather = root + max(pairs) + (max(blocks) if blocks else 0)
        for r in range(dp):
            # rank r's rows of every parameter (torch.chunk's: the last ranks' may be fewer)
            rows_here = [
                max(0, min(c, p[1][0] - r * c)) for c, p in zip(chunk, params, strict=True)
            ]
            local = [n * rest(p[1]) for n, p in zip(rows_here, params, strict=True)]

            state = sum(2 * local[i] * sb for i, p in enumerate(params) if p[2] != "muon")
            owned = [(params[matrices[j]][3], params[matrices[j]][1])
                     for j, o in enumerate(a.owners) if o == r]  # fmt: skip
            if layout.optimizer == "soap":
                state += sum(_soap_state(shape, sb) for _, shape in owned)
                # SOAP's prepare is the gradient itself in the state dtype
                updates = 0 if pb == sb else sum(local[i] for i in matrices) * sb
                directions = _soap_transient(owned, sb)
            else:
                state += sum(local[i] for i in matrices) * sb
                updates = sum(local[i] for i in matrices) * sb  # the Nesterov updates
                directions = _muon_transient(owned, layout, sb, cb, fresh_updates=False)
            whole = sum(math.prod(shape) for _, shape in owned) * sb
            send = sum(local[i] for i in matrices) * sb
            # a bucket's back exchange: what its owners return (the size they received)
            back = max(
                (
                    sum(math.prod(units[j].shape) for j in bucket if a.owners[j] == r) * sb
                    for bucket in a.buckets
                ),
                default=0,
            )
            # held through the step: the updates, the send and receive buffers, the whole
            # matrices; then the directions, or those with the back exchange's send buffer
            # (one bucket's at a time) and every bucket's receive buffer
            step = updates + send + 2 * whole + max(directions, whole + back + send)
            widest = max((local[i] for i in range(len(params))), default=0)
            adamw = [local[i] for i, p in enumerate(params) if p[2] != "muon"]
            rows.append(
                {
                    "params": padded * pb,
                    "grads": padded * pb,
                    "masters": 0,
                    "state": state,
                    "buffers": 0,
                    "transient": max(step, _adamw_transient(adamw, layout, sb), widest * (pb + 3)),
                    "fsdp_gather": gather,
                }
            )
    return rows


def _tp_transient(
    owned: Sequence[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]],
    layout: Layout,
    sb: int,
    cb: int,
) -> int:
    """Peak bytes of one Muon step through the tensor-parallel orthogonalizer over the owned
    matrices, given as (forward position, local shape, TP-split dim, global shape). A custom
    orthogonalizer always gets a stack (`Muon.stacks`): same-shape matrices form one batch,
    in order of first appearance. Held through the step: every owned Nesterov update and
    the fp32 outputs of the batches done; per batch its stack (when it has several
    matrices) and the mode's own peak: in "distributed" the output copy (two when the split
    side is the rows: the transposed result is made contiguous apart), the last iterate
    and its p×p Gram in the iteration dtype (p the unsplit side), or the iteration itself
    (the iterate, the Gram, A·W and the next iterate); in "duplicated" the local shard and
    the gathered and concatenated whole stack in the iteration dtype with the iteration on
    the whole stack, then the local slice of its output; "blockwise" and unsplit matrices
    the local iteration (`_muon_transient`'s). "auto" is taken as "duplicated", the larger.
    Checked against the dry run (`tests/test_dryrun.py`: the peak within 5 % in every
    mode)."""
    mode = "duplicated" if layout.tp_mode == "auto" else layout.tp_mode
    price = MatrixCost(layout.device, layout.ns_dtype, layout.ns_steps)
    batches: dict[tuple[int, ...], list[tuple[tuple[int, ...], int | None, tuple[int, ...]]]] = {}
    updates = 0
    for _, shape, dim, full in sorted(owned):
        updates += math.prod(shape) * sb
        batches.setdefault((*shape[-2:], -1 if dim is None else dim), []).append((shape, dim, full))
    done, peak = 0, 0
    for entries in batches.values():
        shape, dim, full = entries[0]
        r, c = shape[-2:]
        k = sum(math.prod(s[:-2]) if len(s) > 2 else 1 for s, _, _ in entries)
        x = k * r * c
        cat = x * sb if len(entries) > 1 else 0
        if dim is None or mode == "blockwise":
            m, n = sorted((r, c))
            form, _ = price.path(m, n)
            iterate = (_gram_iterate if form == "gram" else _step_iterate)(
                x * cb, k * m * m * cb, layout.ns_steps, cb == sb
            )
            own = x * sb + iterate
        elif mode == "distributed":
            p = (r, c)[1 - dim]
            gram = k * p * p * cb
            copies = 2 if dim == 0 else 1
            own = max(copies * x * sb + x * cb + gram, 3 * x * cb + gram)
        else:
            rows, cols = full[-2:]
            m, n = sorted((rows, cols))
            whole = k * m * n * cb
            iterate = _step_iterate(whole, k * m * m * cb, layout.ns_steps, True)
            own = x * cb + 2 * whole + max(iterate, whole + x * sb)
        peak = max(peak, done + cat + own)
        done += x * sb
    return updates + peak
