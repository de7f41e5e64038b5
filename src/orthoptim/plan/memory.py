"""What one rank of the layer-wise optimizer holds, by category, modelled on the real code.

The categories are those a dry run of the real code measures (`memory_per_rank`):

    params     every parameter the rank holds (its stage's, its TP shards, its EP rank's
               experts), in the parameter dtype (`param_dtype`): the buckets' flat
               parameter buffers, their padding included (`BucketLayout`)
    grads      their gradients, the buckets' flat gradient buffers in the gradient dtype
               (`grad_dtype`), padding included; a group of one rank (an expert group
               when ep = dp) makes no flats: its parameters stay the model's and its
               gradients autograd's, in the parameter dtype
    masters    an fp32 copy of every owned element where the owners keep one
               (`Layout.masters`: parameters below fp32, or a gather that rounds them)
    state      the inner optimizers' state of what the rank owns: Muon's momentum (one per
               element), AdamW's two moments on its runs, fp32 (`Layout.state_dtype` "bf16":
               2 bytes each; the step's temporaries then `_lean_transient`'s)
    buffers    what the buckets hold beyond the parameters and gradients: a gather buffer
               (the bucket's elements in the gather dtype, padding included) on every rank
               of a group of several where the gather dtype differs from the parameters';
               nothing else
    transient  the step's own peak above that: Muon's Nesterov updates of every owned
               matrix (alive through the step, each taking its own orthogonalized result
               in place), and the batch in flight, a chunk of at most
               `Layout.ns_batch_mb` of a same-shape stack (its fp32 stack when several
               blocks are stacked, its output, the iteration-dtype copy X and one step's
               X·Xᵀ, b·A + c·A·A and B·X); or AdamW's temporaries
               (foreach on CUDA: a square root of every owned second moment); whichever
               is larger, or the non-finite check of the widest gradient shard. Where the
               gradients of a group of one rank are autograd's in bf16 and its masters
               fp32, each bucket of them is converted and stepped on its own: that
               bucket's fp32 gradients and its step's peak, the largest bucket's counting
    backward   autograd's gradient of the rank's largest parameter in backward (a whole
               expert stack; in the parameter dtype), made afresh (`zero_grad` set it to
               None) while every other gradient is held, until its hook copies it into
               the bucket's flat gradients; nothing for a group of one rank, whose
               gradients are autograd's own. A stage holding an embedding much larger than
               what a rank orthogonalizes peaks here (kimi-k2 --dp 256 --ep 64 --pp 16,
               stage 0: its 4.4 GiB embedding against a 1.6 GiB step)
    peak       params + grads + masters + state + buffers + the larger of transient and
               backward

`Layout.device` picks the paths: same-shape matrices stacked except on "cpu"
(`stacking_pays`), the Gram form where `ns_path` takes it, foreach AdamW on "cuda" only.

`Layout.optimizer` "adamw": every unit AdamW, sharded element-wise (`planner.plan_matrices`:
a parameter's experts on one EP rank one unit), no matrix step. "soap": SOAP's state (two
moments, a Kronecker factor and an eigenbasis of each side per matrix) and its step's
temporaries (`_soap_transient`). `Layout.fsdp`:
`FSDPOptimizer` over FSDP2 (`fsdp_rows`). `Layout.tp` > 1: the tensor-parallel
orthogonalizer's gathers and Gram buffers per `Layout.tp_mode` (`_tp_transient`, checked
against the dry run of the real code).

What is not modelled: SOAP's first step (a full `eigh` per factor) and its refresh steps
(every `precondition_frequency`), Muon's `split` blocks of fused matrices, FSDP2's forward
and backward beyond the `fsdp_gather` estimate (the activations are
`orthoptim.plan.activations`').
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orthoptim.newton_schulz import batch_chunks, batch_limit
from orthoptim.ns_cost import iterate_bytes
from orthoptim.parallel.assignment import MatrixCost
from orthoptim.parallel.tensor_parallel import TP_MODES
from orthoptim.parallel.tp_model import TPBatch, local_transient
from orthoptim.plan.model import Matrix

# The planner's types (`planner.Layout`, its groups and slots), not imported: the planner
# imports this module.
Layout = Any
Group = Any

CATEGORIES = ("params", "grads", "masters", "state", "buffers", "transient", "backward")
HELD = CATEGORIES[:5]


def _shares(g: Group, bucket: int) -> list[int]:
    """The elements each rank of `g` owns in bucket `bucket` (an index into
    `g.assignment.buckets`): its whole units and its run of the sharded AdamW elements."""
    a, n = g.assignment, g.world
    share = [0] * n
    for i in a.buckets[bucket]:
        if a.owners[i] >= 0:
            share[a.owners[i]] += math.prod(g.units[i].shape)
    if bucket < len(a.adamw_split) and a.adamw_split[bucket]:
        share = [s + x for s, x in zip(share, a.adamw_split[bucket], strict=True)]
    return share


@dataclass(frozen=True)
class BucketLayout:
    """One bucket of a group as the layer-wise optimizer lays it out, worked out once per
    plan (`bucket_layouts`): the elements each rank owns in it (`_shares`), the padding
    elements of each of its flat buffers (a rank-major bucket pads every shard to the
    largest, at most `MAX_PADDING` of its bytes, `Assignment.rank_major`; any other is
    unpadded), and the runs of its sharded AdamW units (`Assignment.adamw_runs`)."""

    share: list[int]
    padding: int
    runs: dict[int, list[tuple[int, int, int]]]


def bucket_layouts(g: Group) -> list[BucketLayout]:
    """Every bucket of `g`'s assignment laid out (`BucketLayout`), one `rank_major` and one
    `adamw_runs` call each: the memory model reads these for every rank of the group."""
    a, out = g.assignment, []
    for b in range(len(a.buckets)):
        share = _shares(g, b)
        padded = g.world > 1 and a.rank_major(b, g.units)
        padding = g.world * max(share) - sum(share) if padded and share else 0
        out.append(BucketLayout(share, padding, a.adamw_runs(b)))
    return out


def _widest_slots(g: Group, bucket: int, runs: dict[int, list[tuple[int, int, int]]]) -> list[int]:
    """Per rank of `g`, the elements of the largest slot it owns in bucket `bucket` (a whole
    unit, or its piece of a sharded AdamW unit's run, `runs`): what checking its gradients for
    non-finite values at once costs (`_Bucket.shards`)."""
    a, n = g.assignment, g.world
    widest = [0] * n
    for i in a.buckets[bucket]:
        if a.owners[i] >= 0:
            widest[a.owners[i]] = max(widest[a.owners[i]], math.prod(g.units[i].shape))
    for pieces in runs.values():
        for r, lo, hi in pieces:
            widest[r] = max(widest[r], hi - lo)
    return widest


def _flats(
    g: Group,
    layouts: Sequence[BucketLayout],
    param_bytes: int,
    grad_bytes: int,
    gather_bytes: int | None,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per rank of `g`'s world, what its buckets (`layouts`, `bucket_layouts(g)`) hold beyond
    the parameters' and gradients' own elements: the padding of the flat parameters
    (`param_bytes`-byte elements) and of the flat gradients (`grad_bytes`), the gather buffer
    when the gather dtype (`gather_bytes`) differs from the parameters' (None: it does not),
    and the bytes of the non-finite check of the largest gradient slot the rank checks
    (`_widest_slots`). A group of one rank makes no flat: its gradients are checked where
    autograd left them, in the parameter dtype."""
    a, n = g.assignment, g.world
    numels = [math.prod(u.shape) for u in g.units]
    params, grads, gather, check = [0] * n, [0] * n, [0] * n, [0] * n
    for b, bucket in enumerate(a.buckets):
        laid = layouts[b]
        if not any(laid.share):
            continue  # no slot has elements: the optimizer makes no bucket
        if n == 1:
            # isfinite(x) is composite, (x == x) * (x.abs() != inf), all four alive at once
            check[0] = max(check[0], *(numels[i] * (param_bytes + 3) for i in bucket))
            continue
        for r, widest in enumerate(_widest_slots(g, b, laid.runs)):
            check[r] = max(check[r], widest * (grad_bytes + 3))
        gathered = 0
        if gather_bytes is not None:
            gathered = (sum(numels[i] for i in bucket) + laid.padding) * gather_bytes
        for r in range(n):
            params[r] += laid.padding * param_bytes
            grads[r] += laid.padding * grad_bytes
            gather[r] += gathered
    return params, grads, gather, check


def _muon_transient(
    owned: Sequence[tuple[int, tuple[int, ...]]],
    layout: Layout,
    state_bytes: int,
    ns_bytes: int,
    fresh_updates: bool = True,
) -> int:
    """Peak bytes of one Muon step over the owned matrices, given as (forward position,
    local shape): `state_bytes` the state (update) element size, `ns_bytes` the iteration's;
    the Nesterov updates counted unless the caller holds them already (`fresh_updates`
    False). Each
    update is a fresh tensor (Muon's default, Nesterov, `Muon.owns_updates`) that takes its
    own orthogonalized result, so the updates are alive through the step and the results
    add nothing to them. A stack goes in chunks of at most `batch_limit(rows, cols,
    layout.ns_batch_mb)` matrices (`orthogonalize_blocks`): per chunk its concatenation (of
    several blocks), its output and the iteration, gone once the output is copied into the
    updates, before the next chunk's are made."""
    # `newton_schulz.stacking_pays`; never under `reproducible` (`batch_matrices`)
    stack = layout.device != "cpu" and not layout.reproducible
    price = MatrixCost(layout.device, layout.ns_dtype, layout.ns_steps)
    batches: dict[tuple[int, int], list[int]] = {}
    updates = 0
    for _, shape in sorted(owned):
        k = math.prod(shape[:-2]) if len(shape) > 2 else 1
        updates += math.prod(shape) * state_bytes  # the Nesterov update, a fresh tensor
        if stack:
            batches.setdefault(shape[-2:], []).append(k)
        else:
            batches.setdefault((len(batches), *shape[-2:]), []).append(k)
    peak = 0
    for key, blocks in batches.items():
        rows, cols = key[-2:]
        m, n = sorted((rows, cols))
        form, _ = price.path(m, n)
        limit = batch_limit(rows, cols, layout.ns_batch_mb) if stack else None
        for chunk in batch_chunks(blocks, limit):
            k = sum(take for _, _, take in chunk)
            out = k * m * n * state_bytes
            cat = out if len(chunk) > 1 else 0
            x, square = k * m * n * ns_bytes, k * m * m * ns_bytes
            iterate = iterate_bytes(form, x, square, layout.ns_steps, ns_bytes == state_bytes)
            peak = max(peak, out + cat + iterate)
    return (updates if fresh_updates else 0) + peak


def _soap_transient(owned: Sequence[tuple[int, tuple[int, ...]]], state_bytes: int) -> int:
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
        x = k * m * n * state_bytes
        peak = max(peak, done + 3 * x + k * (m * m + n * n) * state_bytes)
        done += x
    return peak


def _soap_state(shape: tuple[int, ...], state_bytes: int) -> int:
    """SOAP's state of an owned matrix: two moments, and per matrix a Kronecker factor and
    an eigenbasis of each side (`SOAP.state_numel`; every side within `max_precond_dim`)."""
    k = math.prod(shape[:-2]) if len(shape) > 2 else 1
    m, n = shape[-2:]
    return (2 * math.prod(shape) + 2 * k * (m * m + n * n)) * state_bytes


def _adamw_transient(runs: Sequence[int], layout: Layout, state_bytes: int) -> int:
    """Peak bytes of torch's AdamW step over owned pieces of `runs` elements: foreach on
    CUDA (a square root of every second moment at once), else one parameter at a time
    (its square root and the denominator made from it)."""
    if not runs:
        return 0
    if layout.device == "cuda":
        return sum(runs) * state_bytes
    return 2 * max(runs) * state_bytes


def _lean_transient(
    owned: Sequence[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]],
    runs: Sequence[int],
    state_bytes: int,
) -> int:
    """Peak bytes of the elementwise work of a step whose state is stored lower than it
    computes (`state_dtype=torch.bfloat16`), one parameter at a time: Muon's momentum in the
    compute dtype and the int32 random bits of its stochastic rounding; `LeanAdamW`'s two
    moments and the random bits (its denominator is made in the second moment's copy)."""
    muon = max((math.prod(shape) for _, shape, _, _ in owned), default=0)
    return max(2 * muon, 3 * max(runs, default=0)) * state_bytes


def _matrix_transient(
    owned: Sequence[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]],
    layout: Layout,
    state_bytes: int,
    ns_bytes: int,
) -> int:
    """The matrix optimizer's step over the owned matrices, given as (forward position,
    local shape, TP-split dim, global shape): Muon's (`_muon_transient`, or through the
    tensor-parallel orthogonalizer, `_tp_transient`) or SOAP's."""
    if layout.optimizer == "soap":
        return _soap_transient([(pos, shape) for pos, shape, _, _ in owned], state_bytes)
    if layout.tp > 1:
        return _tp_transient(owned, layout, state_bytes, ns_bytes)
    # the layer-wise optimizer's reduced gradients take the Nesterov updates
    # (`MatrixOptimizer.consumes_grads`)
    pairs = [(pos, shape) for pos, shape, _, _ in owned]
    return _muon_transient(pairs, layout, state_bytes, ns_bytes, fresh_updates=False)


def _finish(rows: list[dict[str, int]], gather: str) -> dict[str, Any]:
    for row in rows:
        row["steady"] = sum(row[k] for k in HELD)
        row["peak"] = row["steady"] + max(row["transient"], row["backward"])
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


Flats = tuple[list[int], list[int], list[int], list[int]]


def memory_per_rank(
    slots: Sequence[Sequence[tuple[Group, int]]],
    by_stage: Sequence[Sequence[Group]],
    matrices: Sequence[Matrix],
    layout: Layout,
    dtype_bytes: dict[str, int],
) -> dict[str, Any]:
    """Bytes per category on every (stage, DP rank) of the layout, as the layer-wise
    optimizer (or with `layout.fsdp` the FSDP one, `fsdp_rows`) holds them in its flat
    layout (module docstring), with rank 0's, the last rank's and the maximum over ranks of
    each category, and every rank's state and master copies (`state_per_rank`,
    `masters_per_rank`)."""
    param_bytes = dtype_bytes[layout.param_dtype]
    grad_bytes = dtype_bytes[layout.grad_dtype]
    gather = layout.gather
    gather_bytes = dtype_bytes[gather] if gather != layout.param_dtype else None
    state_bytes = dtype_bytes["fp32"]  # optimizer state and master copies
    ns_bytes = dtype_bytes[layout.ns_dtype]
    position = {m: i for i, m in enumerate(matrices)}
    if layout.fsdp:
        rows = fsdp_rows(by_stage, position, layout, param_bytes, grad_bytes, state_bytes, ns_bytes)
        return _finish(rows, gather)
    dealt = {}
    flats: dict[int, Flats] = {}
    laid: dict[int, list[BucketLayout]] = {}
    for stage_groups in by_stage:
        for g in stage_groups:
            for s in g.siblings or [g]:
                d = s.dealt(layout.masters)
                dealt[id(s)] = d
                laid[id(s)] = bucket_layouts(d)
                flats[id(s)] = _flats(d, laid[id(s)], param_bytes, grad_bytes, gather_bytes)
    widths = (param_bytes, grad_bytes, state_bytes, ns_bytes)
    store = dtype_bytes[layout.state_dtype]
    rows = [
        _layerwise_row(slot, dealt, flats, laid, position, layout, widths, store) for slot in slots
    ]
    return {
        **_finish(rows, gather),
        "stepped_tensors_per_rank": stepped_tensors(slots, dealt, laid),
    }


def stepped_tensors(
    slots: Sequence[Sequence[tuple[Group, int]]],
    dealt: dict[int, Group],
    laid: dict[int, list[BucketLayout]],
) -> dict[str, list[int]]:
    """Tensors each (stage, DP rank) hands its optimizer step: "matrix", the Muon units it
    owns whole; "elementwise", its other whole units and its piece of each sharded AdamW
    unit (`BucketLayout.runs`: one tensor each, as the step takes them). The step's cost per
    tensor multiplies these (`plan.steptime`)."""
    pieces: dict[int, Counter[int]] = {}  # per group, each rank's pieces: counted once
    out: dict[str, list[int]] = {"matrix": [], "elementwise": []}
    for slot in slots:
        matrix = elementwise = 0
        for g, gr in slot:
            d = dealt[id(g)]
            if id(g) not in pieces:
                runs = (x for b in laid[id(g)] for x in b.runs.values())
                pieces[id(g)] = Counter(r for x in runs for r, _, _ in x)
            kinds = [d.matrices[i].kind for i in d.owned(gr)]
            matrix += kinds.count("muon")
            elementwise += len(kinds) - kinds.count("muon") + pieces[id(g)][gr]
        out["matrix"].append(matrix)
        out["elementwise"].append(elementwise)
    return out


def _layerwise_row(
    slot: Sequence[tuple[Group, int]],
    dealt: dict[int, Group],
    flats: dict[int, Flats],
    laid: dict[int, list[BucketLayout]],
    position: dict[Matrix, int],
    layout: Layout,
    widths: tuple[int, int, int, int],
    store_bytes: int = 4,
) -> dict[str, int]:
    """The categories of one (stage, DP rank) under the layer-wise optimizer: `slot` its
    (group, rank in it) pairs, `dealt` and `flats` every group's AdamW deal and flat
    buffers (`_flats`), `widths` the bytes of a parameter, gradient, state (the step's) and
    Newton-Schulz iteration element, `store_bytes` of a stored Muon or AdamW state element."""
    param_bytes, grad_bytes, state_bytes, _ = widths
    # every unit of the rank's groups, in its local (TP-shard) shape
    held = {id(g): sum(math.prod(u.shape) for u in g.units) for g, _ in slot}
    params = sum(held[id(g)] * param_bytes + flats[id(g)][0][gr] for g, gr in slot)
    # a group of one rank makes no flat gradients: autograd's, in the parameter dtype
    grads = sum(
        held[id(g)] * (param_bytes if g.world == 1 else grad_bytes) + flats[id(g)][1][gr]
        for g, gr in slot
    )
    owned_elements, state = 0, 0
    # what each inner step of the rank steps: the gradients ready in the stepped dtype
    # (key None), then one step per bucket whose gradients are converted
    owned: dict[Any, list[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]]] = {}
    adamw: dict[Any, list[int]] = {None: []}
    converted: dict[Any, int] = {None: 0}
    buf, check = 0, 0
    for g, gr in slot:
        d = dealt[id(g)]
        buf += flats[id(g)][2][gr]
        check = max(check, flats[id(g)][3][gr])
        bucket_of = {i: b for b, ids in enumerate(d.assignment.buckets) for i in ids}
        for i in d.owned(gr):
            m, u = d.matrices[i], d.units[i]
            numel = math.prod(u.shape)
            owned_elements += numel
            key = None
            if g.world == 1 and param_bytes != state_bytes:
                # a group of one rank's gradients are autograd's: the step hands the
                # masters their copies in the state dtype one bucket at a time
                key = (id(g), bucket_of[i])
                converted[key] = converted.get(key, 0) + numel * state_bytes
            if m.kind != "muon":
                state += 2 * numel * store_bytes
                adamw.setdefault(key, []).append(numel)
                continue
            full = u.shape[:-2] + m.shape[-2:]
            owned.setdefault(key, []).append((position[m], u.shape, m.tp_dim, full))
            if layout.optimizer == "soap":
                state += _soap_state(u.shape, state_bytes)
            else:
                state += numel * store_bytes
        for b, split in enumerate(d.assignment.adamw_split):
            run = split[gr] if split else 0
            if not run:
                continue
            owned_elements += run
            state += 2 * run * store_bytes
            key = None
            if g.world == 1 and param_bytes != state_bytes:  # as the owned units' above
                key = (id(g), b)
                converted[key] = converted.get(key, 0) + run * state_bytes
            # the rank's piece of each AdamW unit of the bucket, one tensor each to the step
            pieces = laid[id(g)][b].runs.values()
            adamw.setdefault(key, []).extend(hi - lo for x in pieces for r, lo, hi in x if r == gr)
    masters = owned_elements * state_bytes if layout.masters else 0
    construction = _construction(slot, held, masters, params, grads, param_bytes)
    steps = (
        converted[k]
        + _step_transient(owned.get(k, []), adamw.get(k, []), layout, widths, store_bytes)
        for k in converted
    )
    return {
        "params": params,
        "grads": grads,
        "masters": masters,
        "state": state,
        "buffers": buf,
        "transient": max(check, *steps),
        "backward": (
            _ordered_backward(slot, dealt, laid, param_bytes, grad_bytes)
            if layout.reproducible
            else _largest_fresh_gradient(slot) * param_bytes
        ),
        "fsdp_gather": 0,
        "construction": construction,
    }


def _largest_fresh_gradient(slot: Sequence[tuple[Group, int]]) -> int:
    """Elements of the largest gradient autograd makes afresh in backward where it goes into
    flats: each parameter whole (an expert stack is one) of a group of several ranks."""
    fresh: dict[str, int] = {}
    for g, _ in slot:
        if g.world > 1:
            for m, u in zip(g.matrices, g.units, strict=True):
                fresh[m.param] = fresh.get(m.param, 0) + math.prod(u.shape)
    return max(fresh.values(), default=0)


def _ordered_backward(
    slot: Sequence[tuple[Group, int]],
    dealt: dict[int, Group],
    laid: dict[int, list[BucketLayout]],
    param_bytes: int,
    grad_bytes: int,
) -> int:
    """`reproducible`'s backward peak above the steady state, from the backward's timeline:
    parameters' gradients arrive in backward order, a bucket launches once its gradients and
    every earlier bucket's are in (launches go in bucket order), and the ordered reduction
    keeps the inboxes of the last two buckets launched (`OrderedReduction.IN_FLIGHT`; N times
    the rank's share, a rank-major bucket's padded share, in the gradient dtype). Each fresh
    gradient (with, where it goes into a buffer of another dtype, its copy in that dtype,
    the micro-batch tree's leaf) arrives beside the inboxes alive then; each launch holds
    the new inbox beside the one before."""
    peak = 0
    fresh_bytes = param_bytes + (grad_bytes if grad_bytes != param_bytes else 0)
    for s, gr in slot:
        g, layouts = dealt[id(s)], laid[id(s)]
        if g.world == 1:
            continue
        arrival: dict[str, int] = {}  # parameter → when its gradient is in (its last unit)
        numel: dict[str, int] = {}
        for i, (m, u) in enumerate(zip(g.matrices, g.units, strict=True)):
            arrival[m.param] = i
            numel[m.param] = numel.get(m.param, 0) + math.prod(u.shape)
        launches: dict[int, list[int]] = {}  # arrival → the inboxes it launches, in order
        ready = -1
        for ids, bucket in zip(g.assignment.buckets, layouts, strict=True):
            share = bucket.share
            if not any(share):
                continue  # no bucket is made
            ready = max([ready, *(arrival[g.matrices[i].param] for i in ids)])
            # a rank-major bucket's shards are all the largest (equal ones pad nothing)
            width = max(share) if bucket.padding else share[gr]
            launches.setdefault(ready, []).append(g.world * width * grad_bytes)
        alive: list[int] = []
        for param, t in sorted(arrival.items(), key=lambda x: x[1]):
            peak = max(peak, numel[param] * fresh_bytes + sum(alive))
            for inbox in launches.get(t, []):
                alive = [*alive[-1:], inbox]
                peak = max(peak, sum(alive))
    return peak


def _step_transient(
    owned: Sequence[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]],
    adamw: Sequence[int],
    layout: Layout,
    widths: tuple[int, int, int, int],
    store_bytes: int,
) -> int:
    """The peak of one inner step over `owned` matrices and `adamw` runs: the matrix
    optimizer's or the elementwise part's (torch's AdamW, or with state stored lower than
    it computes the lean step's), whichever is larger."""
    _, _, state_bytes, ns_bytes = widths
    elementwise = (
        _adamw_transient(adamw, layout, state_bytes)
        if store_bytes == state_bytes
        else _lean_transient(owned, adamw, state_bytes)
    )
    return max(_matrix_transient(owned, layout, state_bytes, ns_bytes), elementwise)


BUILT_BYTES = 4  # the model is built in fp32, the optimizer moves it to `param_dtype`


def _construction(
    slot: Sequence[tuple[Group, int]],
    held: dict[int, int],
    masters: int,
    params: int,
    grads: int,
    param_bytes: int,
) -> int:
    """The peak while the layer-wise optimizer is built over a model built in fp32 (as
    `orthoptim train` and the dry run build it): the masters first, then the parameters
    moving into the flat buffers one segment at a time (the model as built and the largest
    segment, or a group of one rank's largest parameter, in the parameter dtype), then the
    flat gradients (the parameters in their dtype and every gradient buffer)."""
    built = sum(held[id(g)] for g, _ in slot) * BUILT_BYTES
    largest = 0
    for g, _ in slot:
        numel = {m.param: 0 for m in g.matrices}
        for m, u in zip(g.matrices, g.units, strict=True):
            numel[m.param] += math.prod(u.shape)
        if g.world == 1:
            largest = max(largest, *numel.values(), 0)
            continue
        names = [{g.matrices[i].param for i in ids} for ids in g.assignment.buckets]
        sizes = [sum(math.prod(g.units[i].shape) for i in ids) for ids in g.assignment.buckets]
        run = 0
        for k, size in enumerate(sizes):
            run = size + (run if k and names[k] & names[k - 1] else 0)
            largest = max(largest, run)
    flat_grads = grads - sum(held[id(g)] * param_bytes for g, _ in slot if g.world == 1)
    return masters + max(built + largest * param_bytes, params + flat_grads)


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
            if m.expert is not None:  # one expert, or a stack of them (`plan_matrices`)
                width = m.part[1] - m.part[0] if m.part is not None else 1
                entry[1] = (entry[1][0] + width, *entry[1][1:])
            entry[3] = min(entry[3], position[m])
    return [tuple(v) for v in out.values()]  # type: ignore[misc]


def fsdp_rows(
    by_stage: Sequence[Sequence[Group]],
    position: dict[Matrix, int],
    layout: Layout,
    compute_bytes: int,
    reduce_bytes: int,
    state_bytes: int,
    ns_bytes: int,
) -> list[dict[str, int]]:
    """Bytes per category on every (stage, DP rank) under `FSDPOptimizer` over FSDP2, its
    sharded parameters fp32 (`state_bytes`-byte elements) in any case: with a lower `param_dtype`
    FSDP2's `MixedPrecisionPolicy` computes in it (`compute_bytes`-byte elements) and reduces
    gradients in `grad_dtype` (`reduce_bytes`), the sharded fp32 parameters being the masters:

    params, grads  every parameter's dim-0 shard padded as FSDP2 pads it (⌈d₀/N⌉ rows on
                   every rank, the last ranks' rows partly or wholly padding; gradients are
                   views of the reduce-scatter's output, padded alike), fp32
    masters        none: the fp32 sharded parameters are what the step updates
    state          Muon's momentum and AdamW's moments on the local (unpadded) shards; SOAP's
                   whole-matrix state on each matrix's owner (`assign` over the whole 3-D
                   parameters, default cost, as `FSDPOptimizer`)
    transient      the step: every shard's Nesterov update, each bucket's forward send and
                   receive buffers, the owner's whole matrices, then the owner's directions
                   (Newton-Schulz of the whole matrices, written into them, or SOAP's, apart),
                   or the directions with the back exchange's buffers (every bucket's, the
                   size of what it sent, and one bucket's return buffer at a time); or
                   AdamW's, or the non-finite check of the widest gradient shard
    fsdp_gather    FSDP2's own unsharded buffers during forward and backward, not part of
                   the step and so not of `transient` or `peak` (the step runs after FSDP2
                   has freed them): the root module's parameters (embeddings, head, final
                   norm, unsharded from forward to backward), two adjacent blocks'
                   parameters (the one computing and the one prefetched), in the compute
                   dtype, and one block's unsharded gradients (the reduce-scatter's input)
                   in the reduce dtype. An estimate: FSDP2's
                   forward and backward cannot run on meta tensors under the fake group.
    """
    rows: list[dict[str, int]] = []
    for stage_groups in by_stage:
        params = _fsdp_params(stage_groups, position)
        widths = (compute_bytes, reduce_bytes, state_bytes, ns_bytes)
        rows += _fsdp_stage_rows(params, layout, widths)
    return rows


def _rest(shape: tuple[int, ...]) -> int:
    """Elements of one dim-0 row of `shape`."""
    return math.prod(shape[1:])


def _fsdp_stage_rows(
    params: Sequence[tuple[str, tuple[int, ...], str, int, int | None]],
    layout: Layout,
    widths: tuple[int, int, int, int],
) -> list[dict[str, int]]:
    """`fsdp_rows` of one stage's parameters (`_fsdp_params`), one row per DP rank; `widths`
    the bytes of a compute, reduce, state and Newton-Schulz iteration element."""
    compute_bytes, reduce_bytes, state_bytes, ns_bytes = widths
    from orthoptim.parallel.assignment import Unit, assign

    dp = layout.dp
    param_bytes = state_bytes  # the sharded parameters and their gradients
    chunk = [-(-shape[0] // dp) for _, shape, _, _, _ in params]
    matrices = [i for i, p in enumerate(params) if p[2] == "muon"]
    units = [
        Unit(
            params[i][0],
            params[i][1],
            layout.optimizer,
            chunk[i] * _rest(params[i][1]) * param_bytes,
        )
        for i in matrices
    ]
    a = assign(units, dp, balance="cost", bucket_bytes=int(layout.bucket_mb * 2**20))
    padded = sum(c * _rest(p[1]) for c, p in zip(chunk, params, strict=True))
    unsharded: dict[int | None, int] = {}  # elements per block
    for c, p in zip(chunk, params, strict=True):
        unsharded[p[4]] = unsharded.get(p[4], 0) + dp * c * _rest(p[1])
    root = unsharded.pop(None, 0)
    blocks = [unsharded[k] for k in sorted(unsharded)]
    pairs = [x + y for x, y in itertools.pairwise(blocks)] or blocks or [0]
    gather = (root + max(pairs)) * compute_bytes + (max(blocks) if blocks else 0) * reduce_bytes
    rows = []
    for r in range(dp):
        # rank r's rows of every parameter (torch.chunk's: the last ranks' may be fewer)
        rows_here = [max(0, min(c, p[1][0] - r * c)) for c, p in zip(chunk, params, strict=True)]
        local = [n * _rest(p[1]) for n, p in zip(rows_here, params, strict=True)]
        state, step = _fsdp_step(
            r, params, local, matrices, units, a, layout, state_bytes, ns_bytes
        )
        widest = max((local[i] for i in range(len(params))), default=0)
        adamw = [local[i] for i, p in enumerate(params) if p[2] != "muon"]
        rows.append(
            {
                "params": padded * param_bytes,
                "grads": padded * param_bytes,
                "masters": 0,
                "state": state,
                "buffers": 0,
                "transient": max(
                    step,
                    _adamw_transient(adamw, layout, state_bytes),
                    widest * (param_bytes + 3),
                ),
                "backward": 0,  # FSDP2's backward: `fsdp_gather`
                "fsdp_gather": gather,
            }
        )
    return rows


def _fsdp_step(
    r: int,
    params: Sequence[tuple[str, tuple[int, ...], str, int, int | None]],
    local: Sequence[int],
    matrices: Sequence[int],
    units: Sequence[Any],
    a: Any,
    layout: Layout,
    state_bytes: int,
    ns_bytes: int,
) -> tuple[int, int]:
    """(state, the step's peak) of rank `r` under `FSDPOptimizer`: `local` its elements of
    every parameter, `matrices` the matrix parameters' indices, `units` and `a` their
    assignment to owners."""
    param_bytes = state_bytes  # the sharded parameters and their gradients
    state = sum(2 * local[i] * state_bytes for i, p in enumerate(params) if p[2] != "muon")
    owned = [(params[matrices[j]][3], params[matrices[j]][1])
             for j, o in enumerate(a.owners) if o == r]  # fmt: skip
    whole = sum(math.prod(shape) for _, shape in owned) * state_bytes
    if layout.optimizer == "soap":
        state += sum(_soap_state(shape, state_bytes) for _, shape in owned)
        # SOAP's prepare is the gradient itself in the state dtype
        updates = 0 if param_bytes == state_bytes else sum(local[i] for i in matrices) * state_bytes
        directions = _soap_transient(owned, state_bytes)
        apart = whole  # SOAP's directions, tensors of their own
    else:
        state += sum(local[i] for i in matrices) * state_bytes
        updates = sum(local[i] for i in matrices) * state_bytes  # the Nesterov updates
        directions = _muon_transient(owned, layout, state_bytes, ns_bytes, fresh_updates=False)
        apart = 0  # Muon's are written into the whole matrices (`Muon.owns_updates`)
    send = sum(local[i] for i in matrices) * state_bytes
    # a bucket's back exchange: what its owners return (the size they received)
    back = max(
        (
            sum(math.prod(units[j].shape) for j in bucket if a.owners[j] == r) * state_bytes
            for bucket in a.buckets
        ),
        default=0,
    )
    # held through the step: the updates, the send and receive buffers, the whole
    # matrices; then the directions, or those (held `apart` from the whole matrices
    # or in them) with the back exchange's send buffer (one bucket's at a time) and
    # every bucket's receive buffer
    return state, updates + send + 2 * whole + max(directions, apart + back + send)


def _tp_transient(
    owned: Sequence[tuple[int, tuple[int, ...], int | None, tuple[int, ...]]],
    layout: Layout,
    state_bytes: int,
    ns_bytes: int,
) -> int:
    """Peak bytes of one Muon step through the tensor-parallel orthogonalizer over the owned
    matrices, given as (forward position, local shape, TP-split dim, global shape). A custom
    orthogonalizer always gets a stack (`Muon.stacks`): same-shape matrices form one batch,
    in order of first appearance. Held through the step: every owned Nesterov update and
    the fp32 outputs of the batches done; per batch its stack (when it has several
    matrices) and the mode's own peak, its entry's `transient` in the orthogonalizer's table
    (`tensor_parallel.TP_MODES`; `tp_model`'s functions); unsplit matrices the local
    iteration (`tp_model.local_transient`, `_muon_transient`'s). "auto" is taken as
    "duplicated", the larger. Checked against the dry run (`tests/test_dryrun.py`: the peak
    within 5 % in every mode)."""
    mode = "duplicated" if layout.tp_mode == "auto" else layout.tp_mode
    price = MatrixCost(layout.device, layout.ns_dtype, layout.ns_steps)
    batches: dict[tuple[int, ...], list[tuple[tuple[int, ...], int | None, tuple[int, ...]]]] = {}
    updates = 0
    for _, shape, dim, full in sorted(owned):
        updates += math.prod(shape) * state_bytes
        batches.setdefault((*shape[-2:], -1 if dim is None else dim), []).append((shape, dim, full))
    done, peak = 0, 0
    for entries in batches.values():
        shape, dim, full = entries[0]
        r, c = shape[-2:]
        k = sum(math.prod(s[:-2]) if len(s) > 2 else 1 for s, _, _ in entries)
        x = k * r * c
        cat = x * state_bytes if len(entries) > 1 else 0
        rows, cols = full[-2:]
        batch = TPBatch(
            k,
            (r, c),
            (rows, cols),
            dim,
            layout.ns_steps,
            ns_bytes,
            state_bytes,
            price.path(r, c)[0],
        )
        own = local_transient(batch) if dim is None else TP_MODES[mode].transient(batch)
        peak = max(peak, done + cat + own)
        done += x * state_bytes
    return updates + peak
