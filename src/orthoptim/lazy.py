"""A package's public names imported on first use (PEP 562), so that importing the package
(and the `orthoptim` command's parser) imports no torch until a name that needs it is read."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of package `package`: each name of `exports` (name →
    the module defining it) imported from its module when first read, then kept."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
