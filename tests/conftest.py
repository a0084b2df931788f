import pytest

from tests.otlp_sink import OtlpSink


@pytest.fixture
def otlp_sink():
    """A real OTLP/gRPC receiver on 127.0.0.1 (ephemeral port), stopped after the test."""
    sink = OtlpSink().start()
    try:
        yield sink
    finally:
        sink.stop()
