"""Stage I -> Stage II hand-off: the junior release (see :mod:`privcode.release.junior`).

Attributes load lazily (like :mod:`privcode.models`): importing this package
does not import torch, so the CLI stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CONDITIONINGS",
    "FORMAT",
    "JuniorRelease",
    "ReleaseError",
    "load_release",
    "scan_release",
    "verify_release",
    "write_release",
]

if TYPE_CHECKING:
    from privcode.release.junior import (
        CONDITIONINGS,
        FORMAT,
        JuniorRelease,
        ReleaseError,
        load_release,
        scan_release,
        verify_release,
        write_release,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("privcode.release.junior"), name)
    raise AttributeError(f"module 'privcode.release' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
