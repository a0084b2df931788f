"""A source checkout named ``inferprof`` in the working directory shadows the package.

A clone of this repository is a folder named ``inferprof`` with no ``__init__.py``. A
Python program started next to it (``python app.py``, ``python -m ...``) finds that folder
first on ``sys.path`` and imports it as an empty namespace package, before the installed
inferprof (an editable install's import hook comes after the path scan). The result is
``cannot import name '__version__' from 'inferprof' (unknown location)`` or ``module
'inferprof' has no attribute 'configure'``. The console command itself is not affected
(its ``sys.path`` starts at its own ``bin/``), so it can see the folder and say so, and
it starts its own Python children without the working directory on their path.
"""

from __future__ import annotations

import sys
from pathlib import Path

# ``-c`` puts the working directory ('') first on ``sys.path``; drop it, then run the
# module as ``-m`` would. (``-P`` does the same from Python 3.11 only.) Under
# PYTHONSAFEPATH it is not there, and the first entry is the user's PYTHONPATH: kept.
_RUN_MODULE = ("import runpy, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
               "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def shadowing_folder(cwd: Path | None = None) -> Path | None:
    """The folder in ``cwd`` that ``import inferprof`` would take instead of the package
    (a directory named ``inferprof`` without ``__init__.py``), or None."""
    candidate = (cwd or Path.cwd()) / "inferprof"
    try:
        if candidate.is_dir() and not (candidate / "__init__.py").exists():
            return candidate
    except OSError:
        return None
    return None


def shadowing_message(folder: Path) -> str:
    return (f"note: {folder} is a folder named 'inferprof' without __init__.py (a source "
            "checkout?). Python programs started in this directory ('python app.py', "
            "'python -m ...') import that folder instead of the installed inferprof and fail "
            "with \"cannot import name '__version__' from 'inferprof' (unknown location)\". "
            "Start them from inside the checkout or from another directory, or rename the "
            "folder.")


def python_module_command(module: str, *args: str) -> list[str]:
    """``python -m module args...`` for a child process, without the working directory
    on its ``sys.path``, so a shadowing folder there cannot break it."""
    return [sys.executable, "-c", _RUN_MODULE, module, *args]


__all__ = ["python_module_command", "shadowing_folder", "shadowing_message"]
