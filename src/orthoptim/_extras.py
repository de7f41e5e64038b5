"""The packages of the `[cli]` extra (tqdm, matplotlib), imported where a command needs them.

The library (optimizers, parallel, checkpoint, kernels, Newton-Schulz) never imports them; the
commands import them through here, so that a missing one costs one line saying what to install,
not a traceback (and, for a plot, not after a training run: commands check before they start).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Literal

CliExtra = Literal["tqdm", "matplotlib"]

INSTALL = "pip install 'orthoptim[cli]'"


def require_extra(module: CliExtra, command: str) -> ModuleType:
    """`module` imported, or SystemExit with one line naming `command` (e.g. "orthoptim
    compare") and the install that brings the module."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"{command} needs {module}: {INSTALL}") from None


def optional_extra(module: CliExtra, without: str) -> ModuleType | None:
    """`module` imported, or None after a one-line notice on stderr of what runs `without` it
    (e.g. "orthoptim train: no progress bar") and the install that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"{without} ({module} is not installed: {INSTALL})", file=sys.stderr)
        return None
