"""Lazy imports of optional stacks, with errors that name the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` naming ``inferprof[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module!r} is needed for this feature and is not installed; "
            f"install it with: pip install 'inferprof[{extra}]'"
        ) from exc
