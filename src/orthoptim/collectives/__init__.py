"""Every collective orthoptim issues goes through here, so bytes can be counted per step.

Byte accounting: every wrapper records in a `CommStats` the bytes each rank sends and
receives under the bandwidth-optimal ring or chain algorithm of its kind
(`orthoptim.comm_bytes`, where the formulas live and are explained).

Devices: a tensor handed to a collective must live on a device the group's backend serves —
CUDA for NCCL (and "cuda:gloo"), CPU or CUDA for plain gloo, both for "cpu:gloo,cuda:nccl".
`device_for(group)` names the device for tensors made for a collective (flags, sizes,
serialised objects, metrics), and every wrapper here refuses a tensor on another device with a
`CollectiveDeviceError` naming both, before the backend sees it.

Failures: every torch.distributed call is made inside `issuing`, which turns what the call
(or the wait of its work) raises into a `CollectiveError` ("another rank probably died or
stalled"): that is how a rank learns a peer died (gloo: connection closed) or stalled (the
process-group timeout; NCCL's watchdog, `dist.DistError`). Out-of-memory and a device the
backend does not serve are local and stay what they are. `phase(name)` names the step a
failure happened in: a `CollectiveError` gets the name in its message, any other exception
(a local bug, an out-of-memory while packing a buffer) is re-raised as itself with a note
naming the phase, so it is not blamed on another rank.

The modules, each importing only those above it:

- `groups`: a rank and the group's size (`world`), group and global ranks;
- `devices`: the devices a group's backend serves (`backend_config`, `backend_devices`,
  `device_for`, `check_device`, `to_backend`) and `CollectiveDeviceError`;
- `errors`: `CollectiveError`, `issuing`, `phase`, `wait`, and `issue`, through which every
  torch.distributed call is made (`issuing_kind` names the one in flight);
- `ops`: the counted tensor collectives (`all_reduce`, `reduce_scatter`, `all_gather`,
  `all_gatherv`, `reduce`, `broadcast`, `all_to_all`, `all_to_all_rows`, `unshard`,
  `all_reduce_symmetric`, `all_reduce_max`, `barrier`);
- `agreement`: what every rank agrees on before a step (`agree`, `agree_nonfinite`,
  `Verdict`) and the loop's host-side numbers (`sum_floats`, `gather_floats`);
- `objects`: Python objects across ranks (`all_gather_object`, `gather_object`);
- `store`: `rendezvous` through the key-value store, bounded by
  `store.RENDEZVOUS_TIMEOUT_S`;
- `teardown`: the exit handler that lands what is in flight and ends the process group
  (`finish_at_exit`).

The names here are the modules' own objects, re-exported: a call inside the package looks a
function up in the module that holds it, so a setting or a test's replacement goes there
(`store.RENDEZVOUS_TIMEOUT_S`, `agreement.agree`), not here. The shard helpers and the byte
formulas are imported from `orthoptim.shards` and `orthoptim.comm_bytes`.
"""

from orthoptim.collectives.agreement import (
    Verdict,
    agree,
    agree_nonfinite,
    gather_floats,
    sum_floats,
)
from orthoptim.collectives.devices import (
    CollectiveDeviceError,
    backend_config,
    backend_devices,
    check_device,
    device_for,
    to_backend,
)
from orthoptim.collectives.errors import CollectiveError, issuing, issuing_kind, phase, wait
from orthoptim.collectives.groups import global_rank, group_rank, world
from orthoptim.collectives.objects import all_gather_object, gather_object
from orthoptim.collectives.ops import (
    all_gather,
    all_gatherv,
    all_reduce,
    all_reduce_max,
    all_reduce_symmetric,
    all_to_all,
    all_to_all_rows,
    barrier,
    broadcast,
    reduce,
    reduce_scatter,
    unshard,
)
from orthoptim.collectives.store import rendezvous
from orthoptim.collectives.teardown import finish_at_exit

__all__ = [
    "CollectiveDeviceError",
    "CollectiveError",
    "Verdict",
    "agree",
    "agree_nonfinite",
    "all_gather",
    "all_gather_object",
    "all_gatherv",
    "all_reduce",
    "all_reduce_max",
    "all_reduce_symmetric",
    "all_to_all",
    "all_to_all_rows",
    "backend_config",
    "backend_devices",
    "barrier",
    "broadcast",
    "check_device",
    "device_for",
    "finish_at_exit",
    "gather_floats",
    "gather_object",
    "global_rank",
    "group_rank",
    "issuing",
    "issuing_kind",
    "phase",
    "reduce",
    "reduce_scatter",
    "rendezvous",
    "sum_floats",
    "to_backend",
    "unshard",
    "wait",
    "world",
]
