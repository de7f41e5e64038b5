"""The layer-wise distributed optimizer: every matrix is owned whole by one data-parallel rank,
the AdamW parameters (embeddings, head, vectors) are sharded element-wise over all of them.

One training step::

    backward ──► per bucket, as soon as its gradients are ready: one async reduce-scatter
                 of a flat buffer laid out rank by rank (shard r = the matrices rank r
                 owns, then its run of the bucket's AdamW elements, padded to the bucket's
                 largest shard), so each owner receives the summed gradient of exactly what
                 it owns; a bucket owned by one rank is reduced to it instead
    step()   ──► wait, average by world size, agree on non-finite gradients, on which
                 parameters had a gradient anywhere and on whether a rank refuses the step
                 (one small all-reduce, one host read; under pipeline parallelism one more,
                 of two counts, across the stages),
                 owners run the inner optimizer (Muon, SOAP, AdamW, the hybrid) on what they own
             ──► all-gather of the updated parameters per bucket (optionally in bf16),
                 asynchronous: the forward pre-hook of each module waits for its buckets

The model is not wrapped; the optimizer's gradient sync registers the hooks it needs.

`reproducible=True` (`docs/reproducible.md`): the same bits at every power-of-two
data-parallel size for the accumulation loop that gives each rank a contiguous block of the
global batch's micro-batches: each rank sums its micro-batches in the binary tree over their
index (`accumulation`), the owners sum the ranks' slices in the binary tree over the rank
index (`reduction.OrderedReduction`), so the whole sum is one tree over the global
micro-batch index; the clip norm is summed in fixed trees (`clip.ordered_norm`), every
matrix is orthogonalized on its own, and the AdamW units are owned whole.

AdamW is element-wise, so its parameters need no single owner (`shard_adamw`, ZeRO-1 style):
in every bucket each rank's shard ends with a run of the bucket's AdamW elements (the AdamW
parameters flattened back to back, rank 0's run first), so the same reduce-scatter brings
each rank the summed gradient of its run, its inner AdamW steps the run (a 1-D view of the
parameter, named `name{lo:hi}`, state and master copy shaped like it), and the same
all-gather returns it. The runs' lengths level the optimizer state per rank
(`assignment.deal_adamw`). State dicts join and cut runs by name (`orthoptim.checkpoint`).

Tensor parallelism (a (dp, tp) mesh, the model `parallelize_module`d over mesh["tp"], the
optimizer given `process_group=mesh["dp"].get_group()`): buckets hold the local shards of
DTensor parameters, ownership is over the dp group and computed from global shapes (the
same on every tp rank), so the tp ranks of an owner step the same matrices and run a
`TensorParallelOrthogonalizer` together; the non-finite agreement also spans the tp group.

A `ParallelMesh` (`layout=`, `orthoptim.parallel.layout`) hands out every group at once: dense
weights over its dp group, expert weights over its expert-data-parallel group when ep > 1
(their gradients, which the token all-to-all's backward already summed over the ep group, are
summed over the expert group and divided by dp, so they are the single-process gradients),
the agreement and `clip_grad_norm_` also across its pp group when pp > 1; over a model cut by
`expert_parallelize` the state dicts name the experts by their global slices (`state_view`),
so they are the single-process optimizer's at any --ep. The step skeleton, the agreement
groups and the state-dict surface are `orthoptim.parallel.base`'s; this package holds how the
bytes move, one module per job:

- `slots`: where each unit (or each rank's run of a sharded AdamW unit) lives in its bucket;
- `ordering`: the order of a bucket's slots and of a group's buckets (pure functions);
- `buffers`: a bucket's layout and parameter gather, the flat buffers the parameters view,
  laid out a segment at a time;
- `sync`: the gradient sync, the driver's own DDP layer (`GradSync`, public as
  `opt.grad_sync`): it owns the buckets, the flat buffers, the hooks, the byte counter, the
  reduce launches, `no_sync`, DDP detection and the state of a step's gradients (`SyncState`);
- `reduction`: its pluggable reduction, the backend's ring (default) or the ordered
  all-to-all summed in a fixed tree (`reproducible=True`);
- `accumulation`: under `reproducible`, each rank's micro-batches summed in a binary tree;
- `ownership`: the unit groups and their assignments;
- `optimizer`: ownership, masters, the inner optimizer and the step;
- `view`: the checkpoint state view;
- `saving`: the model's state-dict hook that gives every entry a storage of its own, so
  savers that keep one tensor per storage (safetensors) write the whole model.
"""

from orthoptim.parallel.assignment import MAX_PADDING
from orthoptim.parallel.layerwise.optimizer import LayerwiseDistributedOptimizer
from orthoptim.parallel.layerwise.ordering import adjacent as _adjacent
from orthoptim.parallel.layerwise.ownership import UnitGroup
from orthoptim.parallel.layerwise.ownership import carried_load as _carried_load
from orthoptim.parallel.layerwise.slots import unit_label

__all__ = [
    "MAX_PADDING",
    "LayerwiseDistributedOptimizer",
    "UnitGroup",
    "_adjacent",
    "_carried_load",
    "unit_label",
]
