"""The README's first command starts with ``bash scripts/venv``: it must give a virtual
environment with pip from the system Python, which (on Debian/Ubuntu, PEP 668) refuses to
install packages outside one."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(not pathlib.Path(SYSTEM_PYTHON).exists(), reason="no system python3")
def test_a_venv_with_pip_from_the_system_python(tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "venv")], cwd=ROOT, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "VENV": str(venv),
                               "PYTHON": SYSTEM_PYTHON, "HOME": str(tmp_path)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert pip.returncode == 0 and str(venv) in pip.stdout
    # Run again: the environment is reused, not rebuilt.
    marker = venv / "marker"
    marker.write_text("")
    again = subprocess.run(["bash", str(ROOT / "scripts" / "venv")], cwd=ROOT, timeout=300,
                           env={"PATH": "/usr/bin:/bin", "VENV": str(venv),
                                "PYTHON": SYSTEM_PYTHON, "HOME": str(tmp_path)},
                           capture_output=True, text=True)
    assert again.returncode == 0 and marker.exists()
    shutil.rmtree(venv)
