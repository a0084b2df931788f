from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.otlp_sink import attributes


def test_sink_receives_spans_from_the_real_sdk_exporter(otlp_sink):
    provider = TracerProvider(resource=Resource.create({"service.name": "sink-test"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=otlp_sink.endpoint, insecure=True))
    )
    with provider.get_tracer("t").start_as_current_span("x", attributes={"inferprof.stage": "queue"}):
        pass
    provider.shutdown()
    assert otlp_sink.wait_for(lambda s: len(s.spans()) == 1)
    resource, span = otlp_sink.spans()[0]
    assert resource["service.name"] == "sink-test"
    assert attributes(span) == {"inferprof.stage": "queue"}
