import logging

import pytest

from inferprof.demo import settings as s
from inferprof.demo.settings import DemoSettings


def test_env_values_are_read_and_arguments_win():
    env = {s.ENV_INSTRUMENTATION: "production", s.ENV_MAX_BATCH_SIZE: "8",
           s.ENV_MAX_DELAY_MS: "2.5", s.ENV_MODEL_SIZE: "tiny", s.ENV_ENDPOINT: "http://x:4317"}
    got = DemoSettings.from_env(env, max_batch_size=4)
    assert got.instrumentation == "production"
    assert got.max_batch_size == 4
    assert got.max_delay_ms == 2.5
    assert got.model_size == "tiny"
    assert got.endpoint == "http://x:4317"


def test_bad_env_values_are_logged_and_defaulted(caplog):
    env = {s.ENV_INSTRUMENTATION: "everything", s.ENV_MAX_BATCH_SIZE: "lots",
           s.ENV_MAX_DELAY_MS: "-1"}
    with caplog.at_level(logging.WARNING):
        got = DemoSettings.from_env(env)
    assert got == DemoSettings()
    for var in (s.ENV_INSTRUMENTATION, s.ENV_MAX_BATCH_SIZE, s.ENV_MAX_DELAY_MS):
        assert var in caplog.text


@pytest.mark.parametrize("kwargs", [
    {"instrumentation": "everything"}, {"max_batch_size": 0}, {"max_delay_ms": -1},
    {"model_size": "huge"}, {"service_name": ""},
])
def test_bad_arguments_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        DemoSettings(**kwargs)



def test_gc_freeze_is_on_by_default_and_env_turns_it_off(caplog):
    assert DemoSettings().gc_freeze is True
    assert DemoSettings.from_env({s.ENV_GC_FREEZE: "0"}).gc_freeze is False
    assert DemoSettings.from_env({s.ENV_GC_FREEZE: "true"}).gc_freeze is True
    with caplog.at_level(logging.WARNING):
        assert DemoSettings.from_env({s.ENV_GC_FREEZE: "maybe"}).gc_freeze is True
    assert s.ENV_GC_FREEZE in caplog.text


def test_gc_threshold_defaults_to_7000_env_sets_it_and_bad_values_are_refused(caplog):
    assert DemoSettings().gc_threshold == 7000
    assert DemoSettings.from_env({s.ENV_GC_THRESHOLD: "0"}).gc_threshold == 0
    assert DemoSettings.from_env({s.ENV_GC_THRESHOLD: "20000"}).gc_threshold == 20_000
    with caplog.at_level(logging.WARNING):
        assert DemoSettings.from_env({s.ENV_GC_THRESHOLD: "-5"}).gc_threshold == 7000
        assert DemoSettings.from_env({s.ENV_GC_THRESHOLD: "lots"}).gc_threshold == 7000
    assert caplog.text.count(s.ENV_GC_THRESHOLD) == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="gc_threshold"):
            DemoSettings(gc_threshold=bad)


def test_child_process_env_reproduces_the_settings():
    from inferprof.demo.processes import settings_env

    settings = DemoSettings(instrumentation="production", max_tokens=64, gc_freeze=False,
                            gc_threshold=1234,
                            endpoint="http://127.0.0.1:4317", max_delay_ms=2.0)
    assert DemoSettings.from_env(settings_env(settings)) == settings
