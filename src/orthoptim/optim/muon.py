"""Muon: momentum orthogonalized by Newton-Schulz (Jordan et al. 2024).

Per matrix parameter W with gradient G, one step is::

    W ← W − lr·wd·W                                  (decoupled weight decay)
    M ← μ·M + (1−μ)·G                                (momentum, EMA form)
    U ← (1−μ)·G + μ·M  if nesterov else M
    W ← W − lr·scale(rows, cols)·orthogonalize(U)

Same-shape matrices (and the experts of a 3-D parameter) are orthogonalized in one batched
call. A fused parameter (QKV, gate/up, per-head blocks) is orthogonalized block by block: the
`split` option maps its name to the row sizes of its blocks (`qkv_split` builds them); each
block joins the batch of its own shape and gets the LR scale of its own shape.

Muon never talks to a process group: a tensor-parallel orthogonalizer plugs in through
`orthogonalizer`. DTensor parameters (e.g. from `parallelize_module`) stay DTensors here:
shapes, and so LR scales, are global, and the orthogonalizer gets the stacked DTensor batch.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from orthoptim._validate import (
    check_choice,
    check_dtype_or_auto,
    check_nonnegative,
    check_positive,
    check_unit_interval,
)
from orthoptim.newton_schulz import (
    NS_BATCH_MB,
    CoefficientsLike,
    NSDtype,
    batch_chunks,
    batch_limit,
    coefficient_schedule,
    newton_schulz,
    stacking_pays,
)
from orthoptim.ns_cost import NS_STEPS
from orthoptim.optim import telemetry
from orthoptim.optim.base import (
    NonfinitePolicy,
    check_nonfinite_policy,
    check_params,
    compute_dtype,
    param_names,
)
from orthoptim.optim.contract import Directions, Group, MatrixOptimizer, Prepared, StateKind
from orthoptim.optim.lean import (
    STREAM_KEY,
    check_plain,
    check_rounding_seed,
    check_state_dtype,
    store_,
    stream_start,
    take_generator,
)
from orthoptim.optim.shapes import matrix_view, stack_shape
from orthoptim.optim.state import base_name
from orthoptim.shards import is_dtensor

# LR-scale conventions by their published names; LR_SCALE_ALIASES maps other libraries' spellings
# (NVIDIA Emerging-Optimizers' `scale_mode`, torch.optim.Muon's `adjust_lr_fn`) onto them.
LRScaleName = Literal["keller", "unit_rms_norm", "sqrt_max_dim", "match_adamw_rms", "none"]
LR_SCALES: tuple[LRScaleName, ...] = get_args(LRScaleName)
LR_SCALE_ALIASES: dict[str, LRScaleName] = {
    "shape_scaling": "keller",  # Emerging-Optimizers
    "spectral": "sqrt_max_dim",  # Emerging-Optimizers (warns until 0.2.0: LR_SCALE_CHANGED)
    "original": "keller",  # torch.optim.Muon
    "match_rms_adamw": "match_adamw_rms",  # torch.optim.Muon
}
#: what `lr_scale` accepts: a published name or an alias (the keys of LR_SCALE_ALIASES)
LRScale = LRScaleName | Literal["shape_scaling", "spectral", "original", "match_rms_adamw"]

Orthogonalizer = Callable[[Tensor], Tensor]

Split = tuple[int, ...]


def qkv_split(
    n_head: int, head_dim: int, n_kv_head: int | None = None, per_head: bool = False
) -> Split:
    """Row sizes of a fused [q; k; v] weight for `Muon(split=...)`.

    Grouped-query attention: `n_kv_head` key/value heads (default `n_head`). `per_head`
    gives one block per head (q heads, then k heads, then v heads), else three blocks q, k, v.
    """
    kv = n_head if n_kv_head is None else n_kv_head
    if min(n_head, head_dim, kv) < 1:
        raise ValueError(
            f"qkv_split needs n_head, head_dim, n_kv_head >= 1, got {n_head}, {head_dim}, {kv}"
        )
    if per_head:
        return (head_dim,) * (n_head + 2 * kv)
    return (n_head * head_dim, kv * head_dim, kv * head_dim)


def split_of(group: dict[str, Any], name: str) -> Split | None:
    """The row blocks of parameter (or piece label) `name` in a Muon param group (None: one)."""
    split = group.get("split") or {}
    return split.get(name, split.get(base_name(name)))


def is_transposed(group: dict[str, Any], name: str) -> bool:
    """Whether parameter `name` of a Muon param group is stored [in, out] (`transposed`)."""
    names = group.get("transposed", ())
    return name in names or base_name(name) in names


def orthogonalize_blocks(
    items: list[tuple[Tensor, Split | None]],
    orthogonalize: Orthogonalizer,
    lr_scale: LRScale,
    stack: Callable[[torch.device], bool] = lambda device: True,
    batch_mb: float | None = None,
    in_place: Sequence[bool] | None = None,
) -> list[tuple[int, int | None, Tensor, float]]:
    """Orthogonalize matrix stacks [k, rows, cols], each whole or by row blocks (`split`).

    Returns (item index, first row of the block or None for a whole stack, the orthogonalized
    block, the LR-scale factor of the block's shape) per block. Blocks of one shape (and one
    DTensor layout) go through one `orthogonalize` call when `stack(device)` says so, else one
    call each (no copy into a stack). `batch_mb` caps a stack: its matrices go in consecutive
    chunks of at most `batch_limit(rows, cols, batch_mb)`, one call each (a block cut by a
    chunk boundary is put back together in a buffer of its own); None, a DTensor stack, or
    a lone block where `stack(device)` says no, goes whole. `in_place` (per item; None: for
    none): each call's result is copied into the blocks of those items it came from as soon
    as it is made, and those blocks themselves come back, so that the inputs (which the
    caller gives up) are the outputs and no more than one call's result is alive at a time
    beside them (local tensors only: a DTensor result may be laid out otherwise). A list,
    not a generator: `torch.compile` traces it.
    """
    into = list(in_place) if in_place is not None else [False] * len(items)
    for (mats, _), flag in zip(items, into, strict=True):
        if flag and is_dtensor(mats):
            raise ValueError(
                "orthogonalize_blocks(in_place=...) writes into local tensors only, got a "
                "DTensor stack (its result may be laid out otherwise): pass False for it"
            )
    # (rows, cols, device, layout) → [(item, first row, block)]; a DTensor's layout (mesh,
    # placements) is part of the key so a batch never mixes shardings.
    batches: dict[tuple[Any, ...], list[tuple[int, int | None, Tensor]]] = defaultdict(list)
    for i, (mats, sizes) in enumerate(items):
        layout = (mats.device_mesh, tuple(mats.placements)) if is_dtensor(mats) else (None, ())
        if sizes is None:
            batches[(mats.shape[-2], mats.shape[-1], mats.device, layout)].append((i, None, mats))
            continue
        if layout[0] is not None:
            raise NotImplementedError("Muon split of a DTensor parameter is not supported")
        row = 0
        for block in mats.split(list(sizes), dim=-2):
            batches[(block.shape[-2], mats.shape[-1], mats.device, layout)].append((i, row, block))
            row += block.shape[-2]
    done: list[tuple[int, int | None, Tensor, float]] = []
    for (rows, cols, device, layout), entries in batches.items():
        scale = lr_scale_factor(lr_scale, rows, cols)
        if len(entries) > 1 and not stack(device):
            for i, row, block in entries:
                o = orthogonalize(block)
                done.append((i, row, block.copy_(o) if into[i] else o, scale))
                del o  # in place: the copy goes before the next block's is made
            continue
        capped = layout[0] is None and stack(device)
        limit = batch_limit(rows, cols, batch_mb) if capped else None
        parts: dict[int, Tensor] = {}  # entry → the buffer a block cut by chunks is put into
        blocks = [block for _, _, block in entries]
        for chunk in batch_chunks([b.shape[0] for b in blocks], limit):
            pieces = [
                blocks[e] if k == blocks[e].shape[0] else blocks[e][first : first + k]
                for e, first, k in chunk
            ]
            ortho = orthogonalize(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
            offset = 0
            for (e, first, k), piece in zip(chunk, pieces):
                i, row, block = entries[e]
                o = ortho[offset : offset + k]
                offset += k
                if into[i]:
                    piece.copy_(o)
                    if first + k == block.shape[0]:
                        done.append((i, row, block, scale))
                    continue
                if k == block.shape[0]:
                    done.append((i, row, o, scale))
                    continue
                if first == 0:
                    parts[e] = torch.empty(block.shape, dtype=o.dtype, device=o.device)
                parts[e][first : first + k] = o
                if first + k == block.shape[0]:
                    done.append((i, row, parts.pop(e), scale))
            del ortho, o  # a chunk copied whole into buffers goes before the next one is made
    return done


def check_split(name: str, sizes: Any, rows: int) -> Split:
    """Validate one `split` entry against the rows of the parameter's matrices."""
    if isinstance(sizes, int) or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(f"split[{name!r}] must be a tuple of positive row sizes, got {sizes!r}")
    if sum(sizes) != rows:
        raise ValueError(
            f"split[{name!r}] = {tuple(sizes)} sums to {sum(sizes)} rows, but {name} has "
            f"{rows} rows per matrix"
        )
    return tuple(sizes)


# Spellings whose meaning changed: {spelling: (the release it changed in, the name of what it
# meant before)}. Each warns once per process for one minor release (CHANGELOG.md), then stays
# a plain alias. The names they resolve to never warn, so code that says what it means is quiet.
LR_SCALE_CHANGED = {"spectral": ("0.1.0", "unit_rms_norm")}
_WARNED: set[str] = set()


def lr_scale_name(convention: str) -> str:
    """The name of an LR-scale convention given by its name or an alias (`LR_SCALE_ALIASES`);
    raises ValueError naming `lr_scale` and every accepted spelling. A spelling whose meaning
    changed (`LR_SCALE_CHANGED`) gives a FutureWarning, once per process."""
    check_choice("lr_scale", convention, (*LR_SCALES, *LR_SCALE_ALIASES))
    name = LR_SCALE_ALIASES.get(convention, convention)
    if convention in LR_SCALE_CHANGED and convention not in _WARNED:
        _WARNED.add(convention)
        release, before = LR_SCALE_CHANGED[convention]
        warnings.warn(
            f"lr_scale={convention!r} changed meaning in orthoptim {release}: it is now "
            f"{name!r}, √max(rows, cols) (Emerging-Optimizers' {convention!r}); what it meant "
            f"before, √(rows/cols), is lr_scale={before!r}. Pass lr_scale={name!r} (or "
            f"{before!r} for the old scale) to say which without this warning, or silence it "
            f"with warnings.filterwarnings('ignore', message=\"lr_scale={convention!r}\")",
            FutureWarning,
            stacklevel=3,  # the caller of Muon(...) or of lr_scale_factor
        )
    return name


def lr_scale_factor(convention: LRScale, rows: int, cols: int) -> float:
    """The per-matrix learning-rate multiplier of an LR-scale convention (name or alias).

    keller (Jordan's Muon; EO `shape_scaling`, torch `original`): √max(1, rows/cols);
    unit_rms_norm (Bernstein's RMS→RMS norm; EO the same): √(rows/cols);
    sqrt_max_dim (EO `spectral`): √max(rows, cols);
    match_adamw_rms (Moonlight; torch `match_rms_adamw`): 0.2·√max(rows, cols), update RMS
    ≈ AdamW's, so AdamW learning rates and decay carry over; none: 1.
    Before 0.1.0 orthoptim called √(rows/cols) `spectral`; that is now `unit_rms_norm`, and
    `spectral` is EO's √max(rows, cols) (with a FutureWarning until 0.2.0).
    """
    convention = lr_scale_name(convention)
    if convention == "keller":
        return math.sqrt(max(1.0, rows / cols))
    if convention == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if convention == "sqrt_max_dim":
        return math.sqrt(max(rows, cols))
    if convention == "match_adamw_rms":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


class Muon(MatrixOptimizer):
    """Muon for matrix parameters (2-D, 3-D experts [E, out, in], conv weights as (out, rest)).

    1-D parameters are rejected: route them to AdamW with `orthoptim.build_optimizer`.
    `split` ({parameter name: row sizes}) orthogonalizes each row block of a fused matrix on
    its own (for a 3-D parameter: the rows of every expert); it needs named parameters. The
    LR-scale convention is applied per block shape (a q block of a fused QKV gets the scale
    a separate q matrix would get). `lr_scale` takes the published names or the
    Emerging-Optimizers / torch.optim.Muon spellings (`lr_scale_factor`; docs/optimizers.md,
    "LR scales").
    `transposed` names the 2-D weights stored [in, out] (Hugging Face's `Conv1D`, GPT-2's
    c_attn / c_fc / c_proj, which compute x·W + b): each is stepped as its [out, in]
    transpose, so it gets the LR scale (and `split` blocks, over its output features) an
    `nn.Linear` of the same map gets; `build_optimizer` finds them in the model.
    `coefficients`: "quintic" (default) repeats its last tuple past 5 steps, where
    Emerging-Optimizers cycles; "polar_express" normalises by ‖X‖_F without the paper's 1.01
    (`orthoptim.newton_schulz.COEFFICIENT_SETS`).
    The momentum buffer is kept in float32 for low-precision parameters (fp32 master state),
    whatever `ns_dtype` is; `state_dtype=torch.bfloat16` stores it in bfloat16 (2 bytes per
    element instead of 4), computed in float32 and stored by stochastic rounding from a
    stream seeded by `rounding_seed` and the parameter's name (`orthoptim.optim.lean`); None
    or torch.float32 (the default) keeps float32. The variants' whole-matrix state (NorMuon's,
    AdaMuon's moments) stays in the compute dtype. `ns_dtype` is the Newton-Schulz dtype,
    resolved per batch from the device of the matrices (`resolve_ns_dtype`): "auto" (default)
    is bfloat16 on CUDA and float32 elsewhere, float64 parameters stay float64; a torch dtype
    (e.g. torch.float32) forces it; None is float32 on every device (the default before
    "auto"). A custom `orthogonalizer` uses its own (`TensorParallelOrthogonalizer(ns_dtype=...)`).
    `ns_batch_mb` caps the same-shape stacks Newton-Schulz gets where stacking pays (GPUs,
    `stacking_pays`): at most `ns_batch_mb` MiB of float32 matrices per call (at least one
    matrix, `batch_limit`), so that the step's stack and its iteration copies stay that size,
    not that of every owned matrix of the shape; None: one call per shape.
    Newton-Schulz is per matrix, so the results do not depend on it (bitwise where the
    device's batched products do not split their work by batch size: the CPU's on one
    thread). The default, `NS_BATCH_MB` (1024 MiB), is measured on CPU (where chunks of any
    size down to one matrix were no slower than one stack) and estimated for GPUs (on an
    H200 a 1 GiB chunk keeps every product ≈1 ms long; figures at `NS_BATCH_MB`). A custom
    `orthogonalizer` gets whole stacks.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = NS_STEPS,
        coefficients: CoefficientsLike = "quintic",
        lr_scale: LRScale = "keller",
        ns_dtype: NSDtype = "auto",
        orthogonalizer: Orthogonalizer | None = None,
        nonfinite: NonfinitePolicy = "raise",
        eps: float = 1e-7,
        split: dict[str, Split] | None = None,
        transposed: Iterable[str] = (),
        ns_batch_mb: float | None = NS_BATCH_MB,
        state_dtype: torch.dtype | None = None,
        rounding_seed: int = 0,
    ) -> None:
        check_nonnegative("lr", lr)
        lean = check_state_dtype(state_dtype)
        check_rounding_seed(rounding_seed)
        check_unit_interval("momentum", momentum)
        check_nonnegative("weight_decay", weight_decay)
        check_positive("eps", eps)
        coefficient_schedule(coefficients, ns_steps, name="ns_steps")
        check_dtype_or_auto("ns_dtype", ns_dtype)
        if orthogonalizer is not None and not callable(orthogonalizer):
            raise TypeError(
                "orthogonalizer must be a callable (Tensor) -> Tensor or None, "
                f"got {orthogonalizer!r}"
            )
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self.orthogonalizer = orthogonalizer
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            coefficients=coefficients,
            lr_scale=lr_scale_name(lr_scale),
            ns_dtype=ns_dtype,
            eps=eps,
            split=dict(split or {}),
            ns_batch_mb=ns_batch_mb,
        )
        if isinstance(transposed, str):
            raise TypeError(f"transposed must be a collection of names, got {transposed!r}")
        if transposed:  # absent otherwise: the groups of checkpoints from before it match
            defaults["transposed"] = tuple(sorted(transposed))
        if lean is not None:  # absent otherwise, as `transposed`
            defaults.update(state_dtype=lean, rounding_seed=rounding_seed)
        super().__init__(params, defaults)

    #: whether every parameter must be a matrix (Scion also takes vectors)
    matrices_only: ClassVar[bool] = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but rejects parameters that are not matrices, naming them."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["lr_scale"] = lr_scale_name(group["lr_scale"])
        check_dtype_or_auto("ns_dtype", group["ns_dtype"])
        if group["ns_batch_mb"] is not None:
            check_positive("ns_batch_mb", group["ns_batch_mb"])
        me = type(self).__name__
        check_params(me, self.param_groups)
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if p.ndim < 2 and self.matrices_only:
                name = names[i] if names is not None else f"parameter {i} of the new group"
                raise ValueError(
                    f"{me} got {name} with shape {tuple(p.shape)}: {me} only optimizes matrices "
                    "(>= 2 dims). Route vectors, scalars and embeddings to AdamW with "
                    f"orthoptim.build_optimizer(model, optimizer='{me.lower()}')."
                )
            if p.is_complex():
                raise ValueError(
                    f"{me} does not support complex parameters (shape {tuple(p.shape)})"
                )
        for option in ("split", "transposed"):
            if group.get(option) and names is None:
                raise ValueError(
                    f"{me}({option}=...) names parameters: pass named parameters, e.g. "
                    f"{me}(model.named_parameters(), {option}=...)"
                )
        for name, p in zip(names or [], group["params"]):
            flipped = is_transposed(group, name)
            if flipped and p.ndim != 2:
                raise ValueError(
                    f"transposed names {name} with shape {tuple(p.shape)}: only 2-D weights "
                    "are stored [in, out]; leave it out of transposed"
                )
            sizes = split_of(group, name) if group["split"] else None
            if sizes is not None:
                check_split(name, sizes, p.shape[-1] if flipped else matrix_view(p).shape[-2])

    state_kinds: ClassVar[dict[str, StateKind]] = {
        "momentum_buffer": "elementwise",
        STREAM_KEY: "scalar",  # under state_dtype=torch.bfloat16 only
    }

    def init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """As `MatrixOptimizer.init_state`; a bfloat16 `state_dtype` takes plain tensors."""
        if group.get("state_dtype") is not None:
            check_plain(type(self).__name__, param)
        return super().init_state(param, group)

    def step_params(self, params: list[Tensor], group: dict[str, Any], names: list[str]) -> None:
        """As `MatrixOptimizer.step_params`, with every parameter's rounding stream started
        from its name under a bfloat16 `state_dtype`."""
        self.start_streams(params, group, names)
        super().step_params(params, group, names)

    def start_streams(
        self, params: Sequence[Tensor], group: dict[str, Any], names: Sequence[str]
    ) -> None:
        """Make the state of `params` (named `names`) with the seed of each one's first
        stochastic rounding (`orthoptim.optim.lean.stream_start`), where `group` stores its
        state in bfloat16 and a parameter has none yet."""
        if group.get("state_dtype") is None:
            return
        for p, name in zip(params, names, strict=True):
            state = self.state_of(p, group)
            if STREAM_KEY not in state:
                state[STREAM_KEY] = stream_start(group["rounding_seed"], name)

    def prepare(self, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """Momentum (EMA form) on any shard; returns the Nesterov update, or the buffer (under
        a bfloat16 `state_dtype`, the unrounded momentum in the compute dtype)."""
        buf = state["momentum_buffer"]
        if group.get("state_dtype") is not None:
            grad = grad.to(compute_dtype(grad))
            momentum = buf.to(grad.dtype).lerp_(grad, 1.0 - group["momentum"])
            store_(buf, momentum, take_generator(state, buf.device))
            buf = momentum
        else:
            grad = grad.to(buf.dtype)
            buf.lerp_(grad, 1.0 - group["momentum"])
        if not group["nesterov"]:
            return buf
        if self.consumes_grads:  # the gradient's storage takes the update
            return grad.lerp_(buf, group["momentum"])
        return grad.lerp(buf, group["momentum"])

    def directions(self, items: Prepared, group: Group, names: Sequence[str]) -> Directions:
        """`oriented_directions` of every matrix seen as [out, in]: a weight stored [in, out]
        (`transposed`, Hugging Face's Conv1D) is stepped as its transpose, so LR scales,
        `split` blocks and per-neuron statistics are those of the map it stands for (the
        orthogonalization itself does not care: the polar factor of Wᵀ is that of W,
        transposed)."""
        flip = [is_transposed(group, n) for n in names]
        oriented = [(u.mT if f else u, st) for (u, st), f in zip(items, flip)]
        found = self.oriented_directions(oriented, group, names)
        return [d.mT.contiguous() if f and d is not None else d for d, f in zip(found, flip)]

    def oriented_directions(
        self, items: Prepared, group: Group, names: Sequence[str]
    ) -> Directions:
        """orthogonalize(U)·scale(rows, cols) per matrix [out, in] (per row block of a split
        matrix), same-shape blocks batched; a variant post-processes each with `finish`."""
        ortho = self.orthogonalized([u for u, _ in items], group, names, self.block_scale(group))
        return [self.finish(o, u, st, group) for o, (u, st) in zip(ortho, items)]

    def lr_scale_factors(
        self, shape: Sequence[int], group: dict[str, Any], name: str
    ) -> tuple[float, ...]:
        """The LR-scale factors (`lr_scale`) of parameter `name` of stored `shape`, seen as
        [out, in]: one per row block of a `split` matrix whose blocks are scaled on their own,
        else one for the whole."""
        flip = is_transposed(group, name)
        _, rows, cols = stack_shape(tuple(shape)[::-1] if flip else shape)
        convention = group.get("lr_scale", "none")
        blocks = split_of(group, name) if group.get("split") else None
        if blocks is None or self.block_scale(group) == "none":  # scaled as a whole
            return (lr_scale_factor(convention, rows, cols),)
        return tuple(lr_scale_factor(convention, b, cols) for b in blocks)

    def lr_factor(self, param: Tensor, group: dict[str, Any], name: str) -> float:
        """`lr_scale_factors` of `param`, a split matrix's averaged over its row blocks,
        weighted by their rows."""
        factors = self.lr_scale_factors(param.shape, group, name)
        if len(factors) == 1:
            return factors[0]
        blocks = split_of(group, name)
        return sum(b * f for b, f in zip(blocks, factors)) / sum(blocks)

    def block_scale(self, group: dict[str, Any]) -> LRScale:
        """The LR-scale convention applied to each orthogonalized block (Muon: `lr_scale`)."""
        return group["lr_scale"]

    def finish(
        self, ortho: Tensor, update: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> Tensor | None:
        """A variant's whole-matrix step from the orthogonalized `ortho` of the prepared
        `update` (both shaped like the parameter); Muon's direction is `ortho` itself."""
        return ortho

    def matrix_state(self, oriented: Tensor) -> dict[str, Tensor]:
        """A variant's fresh whole-matrix state ("matrix" `state_kinds`) for a parameter whose
        oriented stack [k, rows, cols] is shaped, typed and placed like `oriented` (Muon has
        none). `finish` makes it on first sight of the matrix, `init_compiled_state` ahead of
        a compiled step."""
        return {}

    def init_compiled_state(self) -> None:
        """The elementwise state and `matrix_state` of every parameter with a gradient that
        lacks them, so that a compiled step is traced with all of its state in place."""
        super().init_compiled_state()
        names = param_names(self)
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            self.start_streams(live, group, [names[id(p)] for p in live])
        matrix_keys = [k for k, kind in self.state_kinds.items() if kind == "matrix"]
        if not matrix_keys:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if all(k in state for k in matrix_keys):
                    continue
                flipped = is_transposed(group, names[id(p)])
                shape = matrix_view(p.mT if flipped else p).shape
                state.update(self.matrix_state(p.new_empty(shape, dtype=compute_dtype(p))))

    def orthogonalized(
        self,
        updates: Sequence[Tensor],
        group: dict[str, Any],
        names: Sequence[str],
        scale: LRScale,
    ) -> list[Tensor]:
        """Each update orthogonalized as a stack of matrices (by row blocks where `split`
        names it), every block times the LR-scale factor of convention `scale` for its shape;
        same-shape blocks go through one `orthogonalize` call. Shaped like the updates.

        Newton-Schulz's results are written into the updates themselves where the step owns
        them (`owns_updates`), chunk by chunk, so that the step holds the updates or their
        results, not both; the updates are then the results. Only into a contiguous local
        update: a result is contiguous either way, as a variant's `finish` reduces over it
        (a transposed weight's update, seen as [out, in], is not: it gets a result of its
        own)."""
        mats = [
            (matrix_view(u), split_of(group, name) if group["split"] else None)
            for u, name in zip(updates, names)
        ]
        owned = self.orthogonalizer is None and self.owns_updates(group)
        in_place = [owned and not is_dtensor(m) and m.is_contiguous() for m, _ in mats]
        out: list[Tensor | None] = [m if own else None for (m, _), own in zip(mats, in_place)]
        blocks = orthogonalize_blocks(
            mats,
            lambda m: self.orthogonalize(m, group),
            scale,
            self.stacks,
            self.batch_mb(group),
            in_place=in_place,
        )
        # a custom (tensor-parallel) orthogonalizer's output may be a shard: not sampled
        record = telemetry.active() if self.orthogonalizer is None else None
        for i, row, o, factor in blocks:
            if record is not None:
                record.add_residual(names[i], updates[i].ndim, o)
            if factor != 1.0:
                o = o.mul_(factor) if self.owns_results() else o * factor
            if in_place[i]:
                continue  # a view of the update, which `out` holds whole
            if row is None:
                out[i] = o
                continue
            if out[i] is None:
                out[i] = torch.empty(mats[i][0].shape, dtype=o.dtype, device=o.device)
            out[i][:, row : row + o.shape[-2]] = o
        return [o.reshape(u.shape) for o, u in zip(out, updates)]  # type: ignore[union-attr]

    def owns_updates(self, group: dict[str, Any]) -> bool:
        """Whether the prepared updates `directions` gets for `group` are the step's own, so
        that `orthogonalized` may write their results into them: tensors `prepare` made
        afresh (Muon's Nesterov update; without Nesterov the update is the momentum buffer
        itself) that nothing reads once they are orthogonalized (a variant whose `finish`
        reads the update says no). A caller of `directions` reads no update after it
        (contract: `MatrixOptimizer.directions`)."""
        return bool(group["nesterov"])

    def owns_results(self) -> bool:
        """Whether what `orthogonalized` returns is the step's own, to scale and finish in
        place: Newton-Schulz's output is (fresh, or written into an update the step owns);
        a custom orthogonalizer's might be its input (the momentum buffer)."""
        return self.orthogonalizer is None

    def stacks(self, device: torch.device) -> bool:
        """Whether same-shape blocks on `device` go to the orthogonalizer as one stack: always
        for a custom one (one call, e.g. one collective, per shape), never when matrices must
        not be batched (`batch_matrices`), else where batched Newton-Schulz pays
        (`stacking_pays`)."""
        if self.orthogonalizer is not None:
            return True
        return self.batch_matrices and stacking_pays(device)

    def batch_mb(self, group: dict[str, Any]) -> float | None:
        """The cap on one stacked call (`ns_batch_mb`): Newton-Schulz's; a custom
        orthogonalizer gets whole stacks (one call, e.g. one collective, per shape)."""
        if self.orthogonalizer is not None:
            return None
        # a group loaded from a torch-format dict saved before the option lacks it
        return group.get("ns_batch_mb", NS_BATCH_MB)

    def orthogonalize(self, mats: Tensor, group: dict[str, Any]) -> Tensor:
        """The orthogonalized stack `mats` [k, rows, cols]: the custom orthogonalizer's, else
        Newton-Schulz with `group`'s steps, coefficients, eps and dtype."""
        if self.orthogonalizer is not None:
            return self.orthogonalizer(mats)
        return newton_schulz(
            mats,
            steps=group["ns_steps"],
            coefficients=group["coefficients"],
            eps=group["eps"],
            dtype=group["ns_dtype"],
            check_finite=False,  # the step checked the gradients: no host read per batch
        )
