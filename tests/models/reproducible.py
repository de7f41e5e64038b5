"""The reproducible-training tests' run: the same global batches of micro-batches at any
data-parallel size, through the accumulation loop `reproducible=True` is defined for."""

import torch
import torch.nn.functional as F
from tests.models.layerwise import SEQ, VOCAB, TinyGPT

from orthoptim import LayerwiseDistributedOptimizer

MICRO, MICROBATCHES = 2, 8  # sequences per micro-batch, micro-batches per step


def micro_batch(step, index):
    """Global micro-batch `index` of `step`: the same sequences at every layout."""
    g = torch.Generator().manual_seed(7919 * step + index)
    idx = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def bits(t):
    """The bits of `t` (an integer view of its storage's dtype)."""
    t = t.detach().contiguous()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
    return t.view(view[t.dtype]).clone()


def train(
    rank, world_size, config, steps, micro_batches=MICROBATCHES, layers=3, resume=None, defect=None,
    dtype=torch.float32,
):  # fmt: skip
    """`steps` steps of the loop on this rank's contiguous block of each step's
    micro-batches; returns the parameters' and the state's bits and each step's clip norm.
    `config`: optimizer keyword arguments (`reproducible` among them), `clip` the max norm.
    `resume`: (a full state of the model and optimizer, the step to start from); `defect`:
    one `plant`s; `dtype`: the model's (float64: the clip norm comes back in float64, so a
    norm summed in another order shows)."""
    torch.manual_seed(0)
    model = TinyGPT(layers=layers).to(dtype)
    config = dict(config)
    max_norm = config.pop("clip", None)
    opt = LayerwiseDistributedOptimizer(model, **config)
    if defect is not None:
        plant(opt, rank, defect)
    first = 0
    if resume is not None:
        state, first = resume
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    k = micro_batches // world_size
    norms = []
    for step in range(first, steps):
        for i in range(k):
            x, y = micro_batch(step, rank * k + i)
            last = i == k - 1
            ctx = torch.enable_grad() if last else opt.no_sync()
            with ctx:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / k
                loss.backward()
        if max_norm is not None:
            norms.append(bits(opt.clip_grad_norm_(max_norm)))
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    state = opt.state_dict()
    flat_state = {
        f"{name}.{key}": bits(value)
        for name, entry in state["state"].items()
        for key, value in entry.items()
        if torch.is_tensor(value) and value.is_floating_point()
    }
    params = {n: bits(p) for n, p in model.named_parameters()}
    full = {"model": model.state_dict(), "opt": state}
    # the AdamW units cut into runs of several ranks
    runs = {}
    for b in opt.grad_sync.buckets:
        for s in b.slots:
            if s.flat is not None:
                runs.setdefault(s.unit, set()).add(s.owner)
    cut = sum(1 for owners in runs.values() if len(owners) > 1)
    return {"params": params, "state": flat_state, "norms": norms, "full": full, "cut": cut}


def plant(opt, rank, defect):
    """Put `defect` into `opt` on this rank (the tests' controls: each must break the bits):
    "linear", rank 1 sums its micro-batches in arrival order; "ring", the first bucket is
    reduced by the ring reduction on every rank."""
    from orthoptim.parallel.layerwise.accumulation import TreeAccumulator, _combine
    from orthoptim.parallel.layerwise.reduction import OrderedReduction, RingReduction

    class Linear(TreeAccumulator):
        @staticmethod
        def _put(stack, index, leaf):
            if stack:
                lo, count, left = stack.pop()
                stack.append((lo, count + 1, _combine(left, leaf)))
            else:
                stack.append((index, 1, leaf))

    class RingFirst(OrderedReduction):
        def __init__(self, first):
            super().__init__()
            self.first, self.ring = first, RingReduction()

        def launch(self, bucket, stats, async_op):
            (self.ring if bucket is self.first else super()).launch(bucket, stats, async_op)

        def finish(self, bucket):
            (self.ring if bucket is self.first else super()).finish(bucket)

    sync = opt.grad_sync
    if defect == "linear" and rank == 1:
        sync.tree = Linear()
    elif defect == "ring":
        sync.reduction = RingFirst(next(b for b in sync.buckets if b.n > 1))
