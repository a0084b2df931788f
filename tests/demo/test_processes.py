import sys

import pytest

from inferprof.demo.processes import ServiceProcess, _announced_port
from inferprof.demo.settings import DemoSettings


def test_serve_announcement_parsing_ignores_other_output():
    assert _announced_port(b'{"port": 4242, "pid": 1}\n') == 4242
    assert _announced_port(b"some library printed this\n") is None
    assert _announced_port(b'{"other": 1}\n') is None
    assert _announced_port(b"") is None


def test_a_service_that_dies_at_start_is_a_clear_error(monkeypatch):
    # /bin/sh rejects "-m inferprof.demo.serve" and exits: a stand-in for a broken install.
    monkeypatch.setattr(sys, "executable", "/bin/sh")
    service = ServiceProcess(DemoSettings(), startup_timeout_s=10)
    with pytest.raises(RuntimeError, match="did not start"):
        service.start()
    assert service._proc is None  # nothing left running
    service.close()
