"""Lazy imports of optional stacks, with errors that name the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

#: Import names whose PyPI package is called otherwise (and where the import name is
#: itself another, wrong package on PyPI: ``pip install pynvml`` is not NVIDIA's).
_PACKAGES = {"pynvml": "nvidia-ml-py"}


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` naming ``inferprof[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = _PACKAGES.get(module.partition(".")[0])
        what = f"{module!r} (package {package})" if package else repr(module)
        raise ImportError(
            f"{what} is needed for this feature and is not installed; "
            f"install it with: pip install 'inferprof[{extra}]'"
        ) from exc
