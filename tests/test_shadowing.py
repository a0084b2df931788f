"""A folder named ``inferprof`` in the working directory (a clone of this repository)
must not break the console command's children, and the command says what it is."""

import os
import subprocess

from click.testing import CliRunner

from inferprof._shadowing import python_module_command, shadowing_folder
from inferprof.cli import main


def _shadow(tmp_path):
    folder = tmp_path / "inferprof"
    (folder / "demo").mkdir(parents=True)
    # If this folder were imported as the package, this module would run instead.
    (folder / "demo" / "loadgen.py").write_text("print('SHADOWED')\n")
    return folder


def test_a_folder_without_init_is_found_and_a_package_or_nothing_is_not(tmp_path):
    assert shadowing_folder(tmp_path) is None
    folder = _shadow(tmp_path)
    assert shadowing_folder(tmp_path) == folder
    (folder / "__init__.py").write_text("")
    assert shadowing_folder(tmp_path) is None


def test_the_command_explains_a_shadowing_folder(tmp_path, monkeypatch):
    _shadow(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["report", "--help"])
    assert result.exit_code == 0
    assert "folder named 'inferprof' without __init__.py" in result.output
    assert "unknown location" in result.output


def test_no_note_without_a_shadowing_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["report", "--help"])
    assert result.exit_code == 0
    assert "without __init__.py" not in result.output


def test_children_do_not_import_the_working_directorys_folder(tmp_path):
    _shadow(tmp_path)
    done = subprocess.run(python_module_command("inferprof.demo.loadgen", "--help"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "SHADOWED" not in done.stdout
    assert "usage" in done.stdout.lower()


def test_children_keep_the_users_pythonpath_under_pythonsafepath(tmp_path):
    # PYTHONSAFEPATH=1 (Python 3.11+) starts `-c` without the working directory on
    # sys.path: its first entry is then PYTHONPATH's, which the child must keep.
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "users_module.py").write_text("print('FOUND')\n")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(lib)}
    done = subprocess.run(python_module_command("users_module"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "FOUND" in done.stdout
