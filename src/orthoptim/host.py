"""Every value a training step reads from the device to the host goes through `read`.

Each read is a device→host stall on a GPU, so a step should make as few as it can: the
distributed optimizers stack their non-finite and agreement flags on the device and read
them once. Flags are encoded as counts of bad things, so zero is the normal answer (a dry
run on data-less tensors answers every read with zeros). `host_reads()` counts the reads by
what they were for, so tests and the dry run can hold a step to its budget.
"""

from __future__ import annotations

from collections import Counter

from torch import Tensor

_reads: Counter[str] = Counter()


def read(t: Tensor, what: str) -> Tensor:
    """`t` on the CPU (one device→host read, counted under `what`), ready for `.tolist()`."""
    _reads[what] += 1
    return t.detach().cpu()


def host_reads() -> dict[str, int]:
    """Reads made through `read` since the last `reset_host_reads()`, by `what`."""
    return dict(_reads)


def reset_host_reads() -> None:
    """Forget the reads counted so far."""
    _reads.clear()
