"""Usage errors name the flag and the value as typed, not Python names or tuples."""

import pytest
from click.testing import CliRunner

from inferprof.cli import as_flags, main


@pytest.mark.parametrize(("args", "expected"), [
    (["collect", "--windows-s", "0"], "--windows-s must be one or more positive numbers, got 0"),
    (["collect", "--windows-s", "0,60"], "got 0,60"),
    (["collect", "--grpc-port", "99999"], "--grpc-port must be an integer in 0..65535"),
    # a large integer stays as typed, not 1.23457e+08
    (["collect", "--grpc-port", "123456789"], "(0: ephemeral), got 123456789"),
    (["collect", "--max-series", "0"], "--max-series must be a positive integer, got 0"),
    (["gpu", "--source", "synthetic", "--once", "--interval", "-1"],
     "--interval must be a positive number of seconds, got -1"),
])
def test_settings_errors_name_the_flag(args, expected):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert "(0.0," not in result.output and "_port" not in result.output


def test_as_flags_leaves_other_messages_alone():
    assert as_flags("cannot parse collector config 'x'", {"config": 1}) == \
        "cannot parse collector config 'x'"
    assert as_flags("windows_s must be positive, got ('a', 2.50)", {"windows_s": 1}) == \
        "--windows-s must be positive, got a,2.5"
    assert as_flags("grpc_port must be an integer, got 123456789", {"grpc_port": 1}) == \
        "--grpc-port must be an integer, got 123456789"
    assert as_flags("windows_s must be positive, got (-0.25, inf)", {"windows_s": 1}) == \
        "--windows-s must be positive, got -0.25,inf"
