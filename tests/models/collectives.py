"""What every collective refuses under a CUDA-only backend, shared by the CPU and GPU
collective tests."""

import torch
import torch.distributed as dist


def cpu_tensor_refusals(world_size):
    """Under a CUDA-only backend ("cuda:gloo", NCCL): every wrapper, and the layer-wise
    optimizer's construction, refuses a CPU tensor itself; {call: its message}."""
    from torch import nn

    from orthoptim import collectives as C
    from orthoptim.parallel import LayerwiseDistributedOptimizer

    cpu = torch.ones(2 * world_size)
    calls = {
        "all_reduce": lambda: C.all_reduce(cpu),
        "reduce_scatter": lambda: C.reduce_scatter(torch.empty(2), cpu),
        "all_gather": lambda: C.all_gather(torch.empty(2 * world_size), cpu[:2]),
        "all_gatherv": lambda: C.all_gatherv(cpu[:2], [2] * world_size),
        "broadcast": lambda: C.broadcast(cpu, src=0),
        "reduce": lambda: C.reduce(cpu, dst=0),
        "all_to_all": lambda: C.all_to_all(cpu.clone(), cpu, [2] * world_size, [2] * world_size),
        "optimizer": lambda: LayerwiseDistributedOptimizer(nn.Linear(4, 4)),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
        except C.CollectiveDeviceError as exc:
            errors[name] = str(exc)
    # The backend's own refusal, met inside a named phase, is reported as a device problem.
    try:
        with C.phase("probe", None):
            dist.all_reduce(cpu)
    except C.CollectiveDeviceError as exc:
        errors["phase"] = str(exc)
    return errors
