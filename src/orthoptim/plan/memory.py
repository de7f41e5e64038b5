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
               of one owner holds a grad_flat of `width`, and its owner a gather_flat too
    transient  the step's own peak above that: Muon's Nesterov updates of every owned
               matrix (alive through the whole batched call), the orthogonalized outputs
               of the batches done so far, and the batch in flight (its fp32 stack when
               several same-shape matrices are stacked, its output, the iteration-dtype
               copy X and one step's X·Xᵀ, b·A + c·A·A and B·X); or AdamW's temporaries
               (foreach on CUDA: a square root of every owned second moment); whichever
               is larger, or the non-finite check of the widest gradient shard
    peak       params + grads + masters + state + buffers + transient: an upper bound by
               the owned whole parameters' gradients, which the step re-points at views of
               the buckets (freeing autograd's copies)

`Layout.device` picks the paths: same-shape matrices stacked except on "cpu"
(`stacking_pays`), the Gram form where `ns_path` takes it, foreach AdamW on "cuda" only.

What is not modelled: FSDP2 (`FSDPOptimizer`), the tensor-parallel orthogonalizer's gathers,
Muon's `split` blocks of fused matrices, and the model's activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from orthoptim.newton_schulz import GRAM_FORM_RESTART
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
        width = max(share)
        for r in holders:
            widest[r] = max(widest[r], width)
        if len(holders) == 1 and n > 1:  # single: reduced to its owner, broadcast from it
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
    owned: Sequence[tuple[int, tuple[int, ...]]], layout: Layout, sb: int, cb: int
) -> int:
    """Peak bytes of one Muon step over the owned matrices, given as (forward position,
    local shape): `sb` the state (update) element size, `cb` the iteration's."""
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
        k = sum(blocks)
        out = k * m * n * sb
        cat = out if len(blocks) > 1 else 0
        form, _ = price.path(m, n)
        x, square = k * m * n * cb, k * m * m * cb
        iterate = (_gram_iterate if form == "gram" else _step_iterate)(
            x, square, layout.ns_steps, cb == sb
        )
        peak = max(peak, done + out + cat + iterate)
        done += out
    return updates + peak


def _adamw_transient(runs: Sequence[int], layout: Layout, sb: int) -> int:
    """Peak bytes of torch's AdamW step over owned pieces of `runs` elements: foreach on
    CUDA (a square root of every second moment at once), else one parameter at a time
    (its square root and the denominator made from it)."""
    if not runs:
        return 0
    if layout.device == "cuda":
        return sum(runs) * sb
    return 2 * max(runs) * sb


def memory_per_rank(
    slots: Sequence[Sequence[tuple[Group, int]]],
    by_stage: Sequence[Sequence[Group]],
    matrices: Sequence[Matrix],
    layout: Layout,
    dtype_bytes: dict[str, int],
) -> dict[str, Any]:
    """Bytes per category on every (stage, DP rank) of the layout, as the layer-wise
    optimizer holds them (module docstring), with rank 0's, the last rank's and the
    maximum over ranks of each category."""
    pb = dtype_bytes[layout.grad_dtype]  # parameters and gradients: the reduced dtype
    gather = layout.gather_dtype or layout.grad_dtype
    gb = dtype_bytes[gather]
    sb = max(pb, 4)  # `state_dtype`: float32 for half-precision parameters
    cb = dtype_bytes[layout.ns_dtype]
    masters = gb != pb
    position = {m: i for i, m in enumerate(matrices)}
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
        muon: list[tuple[int, tuple[int, ...]]] = []
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
                if m.kind == "muon":
                    state += numel * sb
                    muon.append((position[m], u.shape))
                else:
                    state += 2 * numel * sb
                    adamw.append(numel)
            runs = [split[gr] for split in d.assignment.adamw_split if split and split[gr]]
            owned_elements += sum(runs)
            state += 2 * sum(runs) * sb
            adamw += runs
        row = {
            "params": held * pb,
            "grads": held * pb,
            "masters": owned_elements * pb if masters else 0,
            "state": state,
            "buffers": buf,
            "transient": max(
                _muon_transient(muon, layout, sb, cb),
                _adamw_transient(adamw, layout, sb),
                # the non-finite check of a gradient shard: isfinite(x) is composite,
                # (x == x) * (x.abs() != inf), all four alive at once
                widest * (pb + 3),
            ),
        }
        row["steady"] = sum(row[k] for k in CATEGORIES if k != "transient")
        row["peak"] = row["steady"] + row["transient"]
        rows.append(row)
    worst = max(range(len(rows)), key=lambda r: rows[r]["peak"])
    return {
        "rank_0": {"rank": 0, **rows[0]},
        "rank_last": {"rank": len(rows) - 1, **rows[-1]},
        "max": {k: max(r[k] for r in rows) for k in rows[0]},
        "max_peak_rank": worst,
        "peak_per_rank": [r["peak"] for r in rows],
        "gather_dtype": gather,
        "ranks": "(pipeline stage, data-parallel rank), stage-major; one TP rank of each",
    }
