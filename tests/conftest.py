import pytest

import inferprof
from tests.instrumentation.helpers import captured
from tests.otlp_sink import OtlpSink


@pytest.fixture
def otlp_sink():
    """A real OTLP/gRPC receiver on 127.0.0.1 (ephemeral port), stopped after the test."""
    sink = OtlpSink().start()
    try:
        yield sink
    finally:
        sink.stop()


@pytest.fixture
def cap():
    """inferprof configured against an in-memory span exporter (see helpers.captured)."""
    with captured() as c:
        yield c


@pytest.fixture(autouse=True)
def _unconfigured_after():
    # Whatever a test configured, the next one starts unconfigured (a no-op otherwise).
    yield
    inferprof.shutdown()
