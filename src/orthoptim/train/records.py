"""A checkpoint's sealed records: each step folder's `checkpoint.json` (and latest.json, which
names the committed one) holds the checkpoint's metadata, every file's size and SHA-256, and
its own SHA-256 (`sealed`), so a record that changed after it was written, or a file that does
not match it, is found before anything is loaded (`read_record`, `damage`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from orthoptim.fileio import atomic_write_text

# In each step folder: the checkpoint's metadata and every file's size and SHA-256.
STEP_RECORD = "checkpoint.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def record_files(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under `folder` (but the record itself): its size and SHA-256."""
    return {
        str(p.relative_to(folder)): dict(bytes=p.stat().st_size, sha256=_sha256(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != STEP_RECORD
    }


def damage(folder: Path, record: dict[str, Any]) -> str | None:
    """Why step folder `folder` does not hold what its record says was written (a file
    missing, resized or changed), or None when it does. A record without checksums (written
    before they existed) is taken as it is."""
    for name, want in record.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes where {want['bytes']} were written"
        if _sha256(path) != want["sha256"]:
            return f"{name} fails its SHA-256 check (its bytes changed after it was written)"
    return None


# A record's own checksum: the SHA-256 of its canonical JSON without this key. Records of
# runs older than it have none and are taken as they are (as `damage` takes those without
# file checksums); the step-folder name check below still applies to them.
RECORD_SHA256 = "record_sha256"
# The only folders a record may name: step folders directly under checkpoints/.
STEP_FOLDER = re.compile(r"step_\d{6,}")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _body(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != RECORD_SHA256}


def sealed(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with its own checksum (`RECORD_SHA256`), which `record_problem` checks."""
    digest = hashlib.sha256(_canonical(_body(record)).encode()).hexdigest()
    return dict(_body(record), **{RECORD_SHA256: digest})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _confined(name: Any) -> bool:
    """Whether `name` (a file name from a record) stays inside its step folder."""
    parts = Path(name).parts if isinstance(name, str) and name else ("..",)
    return not Path(name).is_absolute() and ".." not in parts


def record_problem(record: Any) -> str | None:
    """What is wrong with a checkpoint record read from JSON (its checksum fails, a field
    is missing or of the wrong type, it names a folder other than its step's), in words
    that follow "which" ("fails its own SHA-256 check ..."), or None when nothing is."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    if RECORD_SHA256 in record and sealed(record)[RECORD_SHA256] != record[RECORD_SHA256]:
        return "fails its own SHA-256 check (its bytes changed after it was written)"
    step, folder = record.get("step"), record.get("folder")
    if not _is_int(step) or step < 0:
        return f"holds no valid step ({step!r})"
    if folder != f"step_{step:06d}":
        return (
            f"names folder {folder!r} for step {step}, not step_{step:06d} (a record may "
            "only name its step's folder under checkpoints/)"
        )
    if not isinstance(record.get("args"), dict):
        return "holds no valid args"
    if not _is_int(record.get("world_size")) or record["world_size"] < 1:
        return f"holds no valid world_size ({record.get('world_size')!r})"
    files = record.get("files", {})
    if not isinstance(files, dict) or not all(
        _confined(name)
        and isinstance(want, dict)
        and _is_int(want.get("bytes"))
        and isinstance(want.get("sha256"), str)
        for name, want in files.items()
    ):
        return "holds a malformed file list"
    return None


def read_record(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The checkpoint record at `path` and None, or None and what is wrong with it (in
    words that follow "which": "is missing", "is not valid JSON (...)", `record_problem`)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, "is missing"
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    except UnicodeDecodeError:
        return None, "is not valid JSON (it holds bytes that are not UTF-8)"
    try:
        record = json.loads(text)
    except ValueError as exc:
        return None, f"is not valid JSON ({exc})"
    why = record_problem(record)
    return (None, why) if why else (record, None)


def disagreement(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys on which records `a` and `b` differ (their own checksums left out), sorted."""
    a, b = _body(a), _body(b)
    return [k for k in sorted(a.keys() | b.keys()) if _canonical(a.get(k)) != _canonical(b.get(k))]


def write_record(record: dict[str, Any], path: Path) -> None:
    """Write `record`, sealed (`sealed`), at `path`, durably: written aside to `path.tmp`,
    flushed to disk, renamed, and its folder flushed (`fileio.atomic_write`)."""
    text = json.dumps(sealed(record), indent=1)
    atomic_write_text(text, path, tmp=path.with_name(path.name + ".tmp"))
