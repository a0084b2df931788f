"""``inferprof report --prometheus``: its usage errors and an unreachable Prometheus,
each a clear message and a non-zero exit (the fleet figures themselves:
tests/integration/test_fleet_prometheus.py)."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from inferprof.cli import main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prometheus", "http://127.0.0.1:1"], "--prometheus needs --service"),
        (["--prometheus", "http://127.0.0.1:1", "--service", "s", "--window", "0"],
         "positive number of seconds"),
        (["--window", "60"], "give FILES to read, or --prometheus URL"),
        ([], "give FILES to read, or --prometheus URL"),
    ],
)
def test_usage_errors_say_what_is_wrong(args, message):
    result = CliRunner().invoke(main, ["report", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_files_and_prometheus_together_are_refused(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text("")
    result = CliRunner().invoke(
        main, ["report", str(f), "--prometheus", "http://127.0.0.1:1", "--service", "s"]
    )
    assert result.exit_code == 2
    assert "not both" in result.output


def test_an_unreachable_prometheus_is_a_clear_error():
    url = f"http://127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(main, ["report", "--prometheus", url, "--service", "s"])
    assert result.exit_code == 1
    assert f"cannot query {url}" in result.output
