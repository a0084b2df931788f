"""CollectorSettings: keyword -> environment -> config file -> default; bad values handled."""

from __future__ import annotations

import logging

import pytest

from inferprof.collector import settings as st
from inferprof.collector.settings import CollectorSettings
from tests.collector.test_server_fixtures import running_app


def test_defaults_bind_loopback_on_the_otlp_ports():
    s = CollectorSettings.from_env(environ={})
    assert (s.grpc_bind_host, s.http_bind_host, s.api_bind_host) == ("127.0.0.1",) * 3
    assert (s.grpc_port, s.http_port, s.api_port) == (4317, 4318, 9464)
    assert s.auth_token is None and not s.tls_enabled and s.forward == ()


def test_keyword_beats_environment_beats_file_beats_default(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        "grpc-port = 1111\nhttp_port = 2222\napi-port = 3333\nmax_series = 7\nmax_stages = 20\n"
    )
    env = {st.ENV_HTTP_PORT: "5555", st.ENV_API_PORT: "6666"}
    s = CollectorSettings.from_env(config=config, environ=env, api_port=7777)
    assert s.grpc_port == 1111  # file
    assert s.http_port == 5555  # env over file
    assert s.api_port == 7777  # keyword over env
    assert s.max_series == 7
    assert s.max_stages == 20 and s.engine_kwargs()["max_stages"] == 20
    assert s.max_body_bytes == st._DEFAULT_MAX_BODY_BYTES


def test_config_file_from_env_and_yaml_with_collector_section(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "collector:\n  host: 0.0.0.0\n  forward: [otlp-grpc://jaeger:4317]\n"
        "  forward_headers: {x-tenant: a}\n  windows_s: [30, 60]\n"
    )
    s = CollectorSettings.from_env(environ={st.ENV_CONFIG: str(config)})
    assert s.host == "0.0.0.0"
    assert s.forward == ("otlp-grpc://jaeger:4317",)
    assert s.forward_headers == (("x-tenant", "a"),)
    assert s.windows_s == (30.0, 60.0)


def test_list_valued_environment_variables():
    env = {
        st.ENV_FORWARD: "otlp-grpc://a:4317, http://b:4318",
        st.ENV_WINDOWS_S: "60,120",
        st.ENV_FORWARD_HEADERS: "Authorization=Bearer x,x-scope=1",
    }
    s = CollectorSettings.from_env(environ=env)
    assert s.forward == ("otlp-grpc://a:4317", "http://b:4318")
    assert s.windows_s == (60.0, 120.0)
    assert s.forward_headers == (("authorization", "Bearer x"), ("x-scope", "1"))


@pytest.mark.parametrize(
    "var, raw, field",
    [
        (st.ENV_GRPC_PORT, "abc", "grpc_port"),
        (st.ENV_HTTP_PORT, "70000", "http_port"),
        (st.ENV_MAX_BODY_BYTES, "-1", "max_body_bytes"),
        (st.ENV_SETTLE_S, "nan", "settle_s"),
        (st.ENV_FORWARD, "ftp://x", "forward"),
        (st.ENV_WINDOWS_S, "60,-1", "windows_s"),
        (st.ENV_RELATIVE_ACCURACY, "0.2", "relative_accuracy"),
    ],
)
def test_bad_environment_values_are_logged_and_defaulted(caplog, var, raw, field):
    with caplog.at_level(logging.WARNING, logger="inferprof.collector.settings"):
        s = CollectorSettings.from_env(environ={var: raw})
    assert getattr(s, field) == getattr(CollectorSettings(), field)
    assert var in caplog.text


def test_a_bad_environment_value_falls_back_to_the_config_files_and_says_so(tmp_path, caplog):
    config = tmp_path / "c.yaml"
    config.write_text("grpc-port: 26317\n")
    with caplog.at_level(logging.WARNING, logger="inferprof.collector.settings"):
        s = CollectorSettings.from_env(config=config, environ={st.ENV_GRPC_PORT: "notanint"})
    assert s.grpc_port == 26317
    assert st.ENV_GRPC_PORT in caplog.text and "config file's value" in caplog.text


def test_bad_file_values_are_logged_and_skipped_but_an_unreadable_file_is_an_error(
    tmp_path, caplog
):
    config = tmp_path / "c.toml"
    config.write_text('grpc_port = "x"\nnot_a_setting = 1\nhttp_port = 1234\n')
    with caplog.at_level(logging.WARNING, logger="inferprof.collector.settings"):
        s = CollectorSettings.from_env(config=config, environ={})
    assert s.grpc_port == 4317 and s.http_port == 1234
    assert "not_a_setting" in caplog.text and "grpc_port" in caplog.text
    with pytest.raises(ValueError, match="cannot read"):
        CollectorSettings.from_env(config=tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("= = =")
    with pytest.raises(ValueError, match="cannot parse"):
        CollectorSettings.from_env(config=bad, environ={})
    ini = tmp_path / "c.ini"
    ini.write_text("[collector]\n")
    with pytest.raises(ValueError, match="must end in"):
        CollectorSettings.from_env(config=ini, environ={})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grpc_port": -1},
        {"api_port": 65536},
        {"http_port": True},
        {"host": ""},
        {"max_body_bytes": 0},
        {"retry_after_s": 0},
        {"windows_s": ()},
        {"relative_accuracy": 1.5},
        # outside the sketch's range: the engine would refuse it at start-up
        {"relative_accuracy": 0.1},
        {"relative_accuracy": 0.001},
        {"auth_token": " padded "},
        {"tls_cert": "/c.pem"},
        {"forward": ("tempo:4317",)},
        {"forward_compression": "br"},
        {"auth_token": "a", "auth_token_file": "/f"},
    ],
)
def test_bad_keyword_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        CollectorSettings(**kwargs)
    with pytest.raises(ValueError):
        CollectorSettings.from_env(environ={}, **kwargs)


def test_unknown_keyword_is_a_value_error():
    with pytest.raises(ValueError, match="unknown"):
        CollectorSettings.from_env(environ={}, grpc_prot=1)


def test_token_keyword_beats_a_token_file_from_the_environment(tmp_path):
    s = CollectorSettings.from_env(environ={st.ENV_AUTH_TOKEN_FILE: "/nope"}, auth_token="t")
    assert s.resolved_auth_token() == "t" and s.auth_token_file is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        CollectorSettings(auth_token_file=str(empty)).resolved_auth_token()
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=r"auth token file .*INFERPROF_AUTH_TOKEN_FILE.*No such"):
        CollectorSettings(auth_token_file=str(missing)).resolved_auth_token()


def test_token_is_not_in_the_repr():
    assert "hunter2" not in repr(CollectorSettings(auth_token="hunter2"))


def test_per_listener_hosts_override_host():
    s = CollectorSettings(host="0.0.0.0", api_host="127.0.0.1")
    assert (s.grpc_bind_host, s.api_bind_host) == ("0.0.0.0", "127.0.0.1")


def test_collect_help_gives_every_settings_default():
    from click.testing import CliRunner

    from inferprof.collector.command import collect

    out = CliRunner().invoke(collect, ["--help"], terminal_width=200).output
    defaults = CollectorSettings()
    assert f"(default {defaults.settle_s:g})" in out
    assert f"(default {defaults.max_pending_spans})" in out
    assert "(default 60,300,900)" in out
    assert "--log-level [debug|info|warning|error|critical]" in out


def test_start_up_line_says_a_wildcard_bind_listens_on_every_interface(caplog):
    # In a pod (--host 0.0.0.0) the line named only http://127.0.0.1:..., which reads like
    # a loopback-only bind. (Started on loopback; the wildcard case is formatted as the
    # app would print it, without binding every interface in a test.)
    from inferprof.collector.app import CollectorApp

    with caplog.at_level("INFO", logger="inferprof.collector.app"), running_app() as app:
        pass
    (line,) = [r.getMessage() for r in caplog.records if "listening" in r.getMessage()]
    assert f"API {app.api_url}" in line and "all interfaces" not in line
    wild = CollectorApp(CollectorSettings(host="0.0.0.0"))
    wild._ports = {"grpc": 4317}
    assert wild._bound("0.0.0.0", "grpc", "http://127.0.0.1:4317") == (
        "0.0.0.0:4317 (all interfaces; locally http://127.0.0.1:4317)")
    assert wild._bound("::", "grpc", "http://[::1]:4317").startswith("[::]:4317 (all interfaces")
