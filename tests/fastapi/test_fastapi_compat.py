"""The shape of FastAPI's private telemetry settings ``_fastapi_compat`` relies on."""

from __future__ import annotations

import importlib.metadata

import pytest
from fastapi import FastAPI

from inferprof.fastapi._fastapi_compat import native_tracing


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in importlib.metadata.version("fastapi").split(".")[:2])


@pytest.mark.skipif(_version() < (0, 120), reason="FastAPI without native telemetry")
def test_fastapi_keeps_its_tracing_switch_where_inferprof_turns_it_off():
    app = FastAPI()
    config = native_tracing(app)
    assert config is not None, "FastAPI moved its telemetry settings: see _fastapi_compat"
    assert "tracing" in config


def test_an_app_without_telemetry_settings_has_none():
    assert native_tracing(object()) is None
