"""``inferprof.triton`` without tritonclient: importable, and ``instrument()`` says which
extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

import inferprof.triton


def test_instrument_without_tritonclient_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "tritonclient" or m.startswith("tritonclient.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tritonclient", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'inferprof\[triton\]'"):
        inferprof.triton.instrument(object())


def test_importing_inferprof_triton_imports_no_tritonclient():
    code = "import sys, inferprof.triton; print(sorted(m for m in sys.modules if 'triton' in m))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "['inferprof.triton']"
