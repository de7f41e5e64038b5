"""The parallel layout of a run: pipeline stages × data-parallel ranks × tensor-parallel ranks,
with expert parallelism inside the data-parallel dimension, and the process groups of each.

`ParallelDims` holds the sizes alone (no process group: `orthoptim plan` and the dry run use
it as they are); `ParallelDims.build()` makes every group once, on every rank, and returns the
`ParallelMesh` the model, the optimizers and the training loop take their groups from.

Sizes and rank order (as Megatron-LM, torchtitan's `ParallelDims` and `orthoptim plan`)::

    world = pp · dp · tp          ep divides dp; edp = dp / ep (expert data parallelism)
    rank  = ((pp_i · edp + edp_i) · ep + ep_i) · tp + tp_i

so the ranks of a tensor-parallel group are adjacent, then those of an expert-parallel group
(token dispatch stays between neighbours), and the data-parallel index within a stage is
`edp_i · ep + ep_i`. The groups of a rank:

- `dp`: its stage's ranks with its tp index (size dp): dense weights are replicated over it;
- `edp`: those of them with its ep index too (size dp / ep): the ranks holding the same
  experts, over which expert weights are owned, reduced and gathered;
- `ep`: its stage's ranks with its edp and tp indices (size ep): the all-to-all of tokens;
- `tp`: its tensor-parallel group (size tp), also as a 1-D DeviceMesh (`tp_mesh`);
- `pp`: the ranks with its dp and tp indices, one per stage (size pp);
- `stage`: every rank of its stage (size dp · tp); `world`: every rank of the layout;
- under FSDP2's hybrid sharding (`dp_replicate` > 1, HSDP): `dp_shard`, the ranks of its dp
  group in its replica (dp / dp_replicate adjacent dp indices, over which FSDP2 shards), and
  `dp_replicate`, those with its shard index in every replica; `fsdp_mesh` is the 2-D
  (replicate, shard) DeviceMesh `fully_shard` takes (1-D over dp without replication).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

from orthoptim._validate import check_positive_int

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

Dim = Literal["pp", "dp", "edp", "ep", "tp", "stage", "world", "dp_shard", "dp_replicate"]
DIMS: tuple[Dim, ...] = get_args(Dim)


# A size named in a layout's refusal (`ParallelDims` speaks its own argument names), where
# it stands for a value: followed by one, by "must", "×", "exceeds", "is", "out" or ":".
_SIZE_NAME = re.compile(
    r"(?<![\w-])(dp_replicate|world_size|dp|tp|ep|pp)(?= (?:\d|must\b|×|exceeds\b|is\b|out\b)|:)"
)
_FLAGS = {"dp_replicate": "--dp-replicate", "world_size": "--nproc"}


def flag_words(message: str) -> str:
    """A layout refusal in the command line's words: each size named as its flag of
    `orthoptim train` and `orthoptim plan` (dp → --dp, world_size → --nproc, ...)."""
    return _SIZE_NAME.sub(lambda m: _FLAGS.get(m[1], f"--{m[1]}"), message)


@contextlib.contextmanager
def as_flags() -> Iterator[None]:
    """Inside, a `ValueError` of the layout is re-raised in flag words (`flag_words`): for the
    command lines, whose users set the sizes as flags."""
    try:
        yield
    except ValueError as e:
        raise ValueError(flag_words(str(e))) from e


class Coordinate(NamedTuple):
    """A rank's place in the layout: its stage, its data-parallel index within the stage (and
    that index's expert-data-parallel and expert-parallel parts), its tensor-parallel index."""

    pp: int
    dp: int
    edp: int
    ep: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of a parallel layout (see the module docstring for the rank order).

    `dp`: data-parallel ranks per stage (each its own batch); `tp`: tensor-parallel ranks;
    `ep`: expert-parallel ranks, inside dp (each holds 1/ep of every layer's experts);
    `pp`: pipeline stages; `dp_replicate`: FSDP2's replicas within dp (hybrid sharding:
    parameters sharded over dp / dp_replicate ranks, replicated over dp_replicate)."""

    dp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "ep", "pp", "dp_replicate"):
            check_positive_int(field, getattr(self, field))
        if self.dp % self.dp_replicate:
            raise ValueError(
                f"dp_replicate {self.dp_replicate} must divide dp {self.dp}: FSDP2 shards "
                "over dp / dp_replicate ranks in each replica"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"ep {self.ep} must divide dp {self.dp}: expert parallelism runs inside the "
                f"data-parallel ranks of a stage (each expert-parallel group of {self.ep} ranks "
                f"holds every expert once); pick an ep that divides dp {self.dp}"
            )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        ep: int = 1,
        pp: int = 1,
        dp: int | None = None,
        dp_replicate: int = 1,
    ) -> ParallelDims:
        """The layout of `world_size` ranks: `dp` given, it must make pp · dp · tp ranks;
        else it is world_size / (pp · tp)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        check_positive_int("tp", tp)
        check_positive_int("pp", pp)
        if dp is None:
            if world_size % (pp * tp):
                raise ValueError(
                    f"world_size {world_size} must be a multiple of pp {pp} × tp {tp} (ranks "
                    "form pp stages of dp data-parallel × tp tensor-parallel ranks)"
                )
            dp = world_size // (pp * tp)
        dims = cls(dp=dp, tp=tp, ep=ep, pp=pp, dp_replicate=dp_replicate)
        if dims.world != world_size:
            raise ValueError(
                f"pp {pp} × dp {dp} × tp {tp} is {dims.world} ranks, but world_size is "
                f"{world_size}; pass world_size {dims.world} or leave dp out (it is then "
                "world_size / (pp · tp))"
            )
        return dims

    @property
    def world(self) -> int:
        """The number of ranks the layout spans: pp · dp · tp."""
        return self.pp * self.dp * self.tp

    @property
    def expert_dp(self) -> int:
        """The ranks of a stage that hold the same experts: dp / ep."""
        return self.dp // self.ep

    @property
    def expert_gradient_divide_factor(self) -> int:
        """What the summed gradients of expert weights are divided by to be the mean over the
        stage's batch: dp. The token all-to-all's backward already summed them over the ep
        group and the reduce over the expert-data-parallel group sums the rest of the dp
        ranks, so dividing by that group's size (dp / ep) would leave them ep times too large."""
        return self.dp

    @property
    def dp_shard(self) -> int:
        """The ranks of one FSDP2 replica, over which it shards: dp / dp_replicate."""
        return self.dp // self.dp_replicate

    def check(self, *, n_layer: int | None = None, n_expert: int | None = None) -> None:
        """Refuse a layout the model cannot take, naming the size: more stages than layers,
        expert parallelism over a model without experts or an ep not dividing the experts."""
        if n_layer is not None and self.pp > n_layer:
            raise ValueError(
                f"pp {self.pp} exceeds the model's {n_layer} layers (each stage holds at "
                f"least one); use pp {n_layer} or fewer"
            )
        if self.ep > 1 and not n_expert:
            raise ValueError(
                f"ep {self.ep}: the model has no routed experts; use ep 1 or a "
                "mixture-of-experts config"
            )
        if n_expert and n_expert % self.ep:
            raise ValueError(
                f"ep {self.ep} must divide the model's {n_expert} experts per layer (each "
                "expert-parallel rank holds the same number)"
            )

    def coordinate(self, rank: int) -> Coordinate:
        """Where `rank` sits in the layout."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the layout's {self.world} ranks")
        tp_i, rest = rank % self.tp, rank // self.tp
        ep_i, rest = rest % self.ep, rest // self.ep
        edp_i, pp_i = rest % self.expert_dp, rest // self.expert_dp
        return Coordinate(pp_i, edp_i * self.ep + ep_i, edp_i, ep_i, tp_i)

    def rank_of(self, pp: int, dp: int, tp: int = 0) -> int:
        """The rank at stage `pp`, data-parallel index `dp`, tensor-parallel index `tp`."""
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, dim: Dim, rank: int) -> list[int]:
        """The ranks of `rank`'s group along `dim` (see the module docstring), ascending."""
        if dim not in DIMS:
            raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
        c = self.coordinate(rank)
        if dim == "world":
            return list(range(self.world))
        if dim == "stage":
            return list(range(c.pp * self.dp * self.tp, (c.pp + 1) * self.dp * self.tp))
        if dim == "tp":
            return [self.rank_of(c.pp, c.dp, t) for t in range(self.tp)]
        if dim == "pp":
            return [self.rank_of(s, c.dp, c.tp) for s in range(self.pp)]
        if dim == "dp":
            return [self.rank_of(c.pp, d, c.tp) for d in range(self.dp)]
        if dim == "ep":
            return [self.rank_of(c.pp, c.edp * self.ep + e, c.tp) for e in range(self.ep)]
        n = self.dp_shard
        if dim == "dp_shard":
            return [self.rank_of(c.pp, c.dp // n * n + i, c.tp) for i in range(n)]
        if dim == "dp_replicate":
            return [self.rank_of(c.pp, r * n + c.dp % n, c.tp) for r in range(self.dp_replicate)]
        return [self.rank_of(c.pp, e * self.ep + c.ep, c.tp) for e in range(self.expert_dp)]

    def all_group_ranks(self, dim: Dim) -> list[list[int]]:
        """Every group along `dim`, each once, ordered by its lowest rank: the order in which
        every rank creates them."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world):
            ranks = self.group_ranks(dim, r)
            seen.setdefault(ranks[0], ranks)
        return [seen[k] for k in sorted(seen)]

    def describe(self) -> str:
        """The layout as flags: "--pp 2 --dp 4 --ep 2 --tp 1" (and "--dp-replicate R" when
        FSDP2 replicates)."""
        flags = f"--pp {self.pp} --dp {self.dp} --ep {self.ep} --tp {self.tp}"
        return flags + (f" --dp-replicate {self.dp_replicate}" if self.dp_replicate > 1 else "")

    def build(self, device_type: str = "cpu", rank: int | None = None) -> ParallelMesh:
        """Make every group of the layout (collective: every rank of the default process
        group calls it, which must have `world` ranks) and return this rank's `ParallelMesh`.
        `device_type`: the device of the tensor-parallel DeviceMesh ("cpu", "cuda")."""
        import torch.distributed as dist

        from orthoptim import collectives as C

        here, size = C.world()
        if size != self.world:
            raise ValueError(
                f"the layout {self.describe()} spans {self.world} ranks, but the process "
                f"group has {size}; start {self.world} ranks (--nproc {self.world})"
            )
        rank = here if rank is None else rank
        groups: dict[str, Any] = {}
        hybrid = ("dp_shard", "dp_replicate") if self.dp_replicate > 1 else ()
        for dim in ("dp", "edp", "ep", "tp", "pp", "stage", *hybrid):
            for ranks in self.all_group_ranks(dim):
                # A group of every rank is the default group itself (no second communicator).
                g = None if len(ranks) == size else dist.new_group(ranks) if size > 1 else None
                if rank in ranks:
                    groups[dim] = g
        return ParallelMesh(self, rank, groups, device_type)


class ParallelMesh:
    """One rank's groups of a `ParallelDims` layout (`ParallelDims.build`). A group that
    spans every rank is None, which every orthoptim collective reads as the default group."""

    def __init__(self, dims: ParallelDims, rank: int, groups: dict[str, Any], device_type: str):
        self.dims, self.rank = dims, rank
        self.coord = dims.coordinate(rank)
        self._groups = groups
        self._device_type = device_type
        self._tp_mesh: DeviceMesh | None = None

    def group(self, dim: Dim) -> Any:
        """This rank's process group along `dim` (None: the default group, every rank)."""
        if dim == "world":
            return None
        return self._groups[dim]

    @property
    def dp_group(self) -> Any:
        return self.group("dp")

    @property
    def expert_group(self) -> Any:
        """The expert data-parallel group when there is expert parallelism, else None (the
        experts are then dense weights, over `dp_group`)."""
        return self.group("edp") if self.dims.ep > 1 else None

    @property
    def expert_gradient_divide_factor(self) -> int:
        """`ParallelDims.expert_gradient_divide_factor` of this layout."""
        return self.dims.expert_gradient_divide_factor

    @property
    def ep_group(self) -> Any:
        return self.group("ep")

    @property
    def tp_group(self) -> Any:
        return self.group("tp")

    @property
    def pp_group(self) -> Any:
        return self.group("pp")

    @property
    def stage_group(self) -> Any:
        return self.group("stage")

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D DeviceMesh of this rank's tensor-parallel group (for `parallelize` and
        DTensor), made on first use from the group made by `build`."""
        if self._tp_mesh is None:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            ranks = self.dims.group_ranks("tp", self.rank)
            self._tp_mesh = DeviceMesh.from_group(
                _real(self.tp_group),
                self._device_type,
                mesh=torch.tensor(ranks),
                mesh_dim_names=("tp",),
            )
        return self._tp_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The DeviceMesh FSDP2's `fully_shard` takes over this rank's dp group: 1-D
        ("shard",), or under hybrid sharding 2-D ("replicate", "shard")."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        dims = self.dims
        ranks = torch.tensor(dims.group_ranks("dp", self.rank))
        if dims.dp_replicate == 1:
            return DeviceMesh.from_group(
                _real(self.dp_group), self._device_type, mesh=ranks, mesh_dim_names=("shard",)
            )
        return DeviceMesh.from_group(
            [_real(self.group("dp_replicate")), _real(self.group("dp_shard"))],
            self._device_type,
            mesh=ranks.view(dims.dp_replicate, dims.dp_shard),
            mesh_dim_names=("replicate", "shard"),
        )

    def __repr__(self) -> str:
        return f"ParallelMesh({self.dims.describe()}, rank {self.rank}, {self.coord})"


def _real(group: ProcessGroup | None) -> ProcessGroup | None:
    """`group` as a process group object: None (a group spanning every rank) is the default
    group, which DeviceMesh needs by name."""
    import torch.distributed as dist

    return group if group is not None else dist.group.WORLD


def expert_gradient_divisor(
    layout: ParallelMesh | None, dispatched: bool, dense_size: int, expert_size: int
) -> int:
    """What the summed gradients of expert weights are divided by: the layout's
    `expert_gradient_divide_factor`; without a layout, for a model whose experts were
    dispatched by an all-to-all (cut by `expert_parallelize`, groups given one by one), the
    dense group's size `dense_size` (the same dp), else the expert group's `expert_size`
    (a plain mean over it)."""
    if layout is not None:
        return layout.expert_gradient_divide_factor
    return dense_size if dispatched else expert_size
