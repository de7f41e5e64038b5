"""Reading checkpoint files without running code they pickled: every value is read with
`torch.load(weights_only=True)` (tensors, numbers, strings, dtypes and containers of them),
and a DCP checkpoint's `.metadata` pickle with an unpickler that builds DCP's own records
only (`MetadataUnpickler`); anything else is refused with a `CheckpointLoadError` naming
what it wanted. `orthoptim.checkpoint` re-exports the public names."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from typing import IO, Any

import torch


class CheckpointLoadError(Exception):
    """A checkpoint could not be read (missing or damaged files), or was refused because
    loading it would run code it pickled (`load_file`). Raised in place of
    torch.distributed.checkpoint's `CheckpointException`, a BaseException that
    `except Exception` would not catch; the original is its `__cause__`."""


# An exception's message in `one_line` is cut to this many characters.
ONE_LINE_CHARS = 300


def one_line(exc: BaseException) -> str:
    """`exc` as "Type: message" on one line (whitespace runs joined, cut to ONE_LINE_CHARS);
    "Type" alone when it has no message (an `EOFError()` of a file cut short); a
    `CheckpointLoadError` (which says what it is and what to do) as its whole message."""
    message = " ".join(str(exc).split())
    if isinstance(exc, CheckpointLoadError) and message:
        return message
    if len(message) > ONE_LINE_CHARS:
        message = message[: ONE_LINE_CHARS - 1] + "…"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Turn a failed DCP read of checkpoint `path` into a one-line `CheckpointLoadError`
    that names every rank's failure (KeyboardInterrupt, SystemExit and the like pass
    unchanged). DCP keeps each failure as (exception, stack summary): only the exception is
    told."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = getattr(exc, "failures", {}) or {}
        why = "; ".join(
            f"rank {r}: {one_line(e[0] if isinstance(e, tuple) else e)}"
            for r, e in sorted(failures.items())
        ) or one_line(exc)
        raise CheckpointLoadError(f"could not read checkpoint {path}: {why}") from exc


def pack(obj: Any) -> bytes:
    """Serialise a nested value so that DCP stores it as one item (DCP flattens dicts)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes, source: str) -> Any:
    """What `pack` serialised, read as `safe_load` reads files (`source` names it in errors)."""
    return safe_load(io.BytesIO(data), source)


def safe_load(f: str | IO[bytes], source: str, map_location: Any = None) -> Any:
    """`torch.load(f, weights_only=True)`. Everything orthoptim saves (optimizer, full and
    sharded state dicts, their metadata) is made of what that allows by default: tensors,
    dicts, lists, tuples, str, int, float, bool, None, torch.dtype, torch.Size; so nothing
    is added to the allow-list. Anything else is refused with a `CheckpointLoadError` that
    names `source` and the globals it wanted."""
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError) as exc:  # torch's reader: a file cut short or not a zip
        raise CheckpointLoadError(f"could not load {source}: {one_line(exc)}") from exc
    except pickle.UnpicklingError as exc:
        if not isinstance(f, str):
            f.seek(0)
        try:
            wanted = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        except Exception:
            wanted = []
        if not wanted:  # torch's own reason, without its advice around it
            why = str(exc.__cause__ or exc.__context__ or exc)
            raise CheckpointLoadError(
                f"refused to load {source}: torch.load(weights_only=True) cannot read it "
                f"({why}): it is damaged, not a torch.save file, or holds objects that only "
                "an unrestricted load builds, which may execute code it pickled; if you trust "
                "its source, load it with torch.load(weights_only=False) yourself"
            ) from exc
        raise _refused(source, wanted) from exc


def _refused(source: str, wanted: list[str]) -> CheckpointLoadError:
    """The error for a file (`source`) refused because it needs the globals `wanted`."""
    return CheckpointLoadError(
        f"refused to load {source}: it needs the global(s) {', '.join(wanted)}, which "
        "torch.load(weights_only=True) does not allow: loading it would execute code it "
        "pickled. orthoptim's own checkpoints hold only tensors, numbers, strings and "
        "containers of them; if you trust its source, load it with "
        "torch.load(weights_only=False) yourself"
    )


# What the `.metadata` pickle of a DCP checkpoint may name: DCP's metadata records and what
# they hold. Checked before anything is imported; torch dtypes are allowed too.
_DCP_METADATA_GLOBALS = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
    ]
    # Python 3.13 pickles paths from pathlib._local
    + [(m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath")]
)


class MetadataUnpickler(pickle.Unpickler):
    """Reads a DCP `.metadata` pickle (`source`), refusing every global outside
    `_DCP_METADATA_GLOBALS` and torch dtypes."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise _refused(self.source, [f"{module}.{name}"])


def load_file(path: str | os.PathLike[str], map_location: Any = "cpu") -> Any:
    """Load a checkpoint file (an optimizer's state dict, `full_state_dict`, a model's state
    dict; tensors onto `map_location`) with `torch.load(weights_only=True)`: a file that
    would run code while loading is refused with a `CheckpointLoadError` naming what it
    wanted, instead of running it."""
    path = os.fspath(path)
    return safe_load(path, path, map_location)


def atomic_load(path: str | os.PathLike[str], map_location: Any = "cpu") -> Any:
    """Load what `atomic_save` wrote, as `load_file` does."""
    return load_file(path, map_location)
