import http.server
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import inferprof
from inferprof import _config, semconv
from tests.otlp_sink import attributes


def test_keyword_beats_env_beats_default(monkeypatch, cap):
    monkeypatch.setenv("INFERPROF_MODE", "production")
    monkeypatch.setenv("INFERPROF_SAMPLE_RATE", "0.2")
    monkeypatch.setenv("INFERPROF_BATCH_ENCODING", "links")
    config = inferprof.configure(tracer_provider=cap.provider, sample_rate=0.5)
    assert config.mode == "production"  # env
    assert config.sample_rate == 0.5  # keyword
    assert config.batch_encoding == "links"  # env
    assert config.tail_quantile == _config.DEFAULT_TAIL_QUANTILE  # default
    assert config.owns_providers is False
    with pytest.raises(AttributeError):
        config.mode = "off"  # frozen


@pytest.mark.parametrize(
    "env, value, field, default",
    [
        ("INFERPROF_MODE", "fast", "mode", _config.DEFAULT_MODE),
        ("INFERPROF_SAMPLE_RATE", "2", "sample_rate", _config.DEFAULT_SAMPLE_RATE),
        ("INFERPROF_SAMPLE_RATE", "abc", "sample_rate", _config.DEFAULT_SAMPLE_RATE),
        ("INFERPROF_BATCH_ENCODING", "both", "batch_encoding", _config.DEFAULT_BATCH_ENCODING),
        ("INFERPROF_RECORD_CONTENT", "maybe", "record_content", False),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon", "protocol", "grpc"),
    ],
)
def test_bad_env_values_are_logged_and_defaulted(
    monkeypatch, caplog, cap, env, value, field, default
):
    monkeypatch.setenv(env, value)
    with caplog.at_level(logging.WARNING, logger="inferprof._config"):
        config = inferprof.configure(tracer_provider=cap.provider)
    assert getattr(config, field) == default
    assert env in caplog.text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "fast"},
        {"sample_rate": 0},
        {"sample_rate": 1.5},
        {"tail_quantile": -1},
        {"batch_encoding": "both"},
        {"protocol": "udp"},
        {"endpoint": "localhost"},
        {"service_name": ""},
        {"record_content": "yes"},
        {"resource_attributes": ["a"]},
    ],
)
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        inferprof.configure(**kwargs)
    assert _config.current_config() is None


def test_otel_sdk_disabled_means_off(monkeypatch, cap):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    config = inferprof.configure(tracer_provider=cap.provider)
    assert config.mode == "off" and not config.enabled
    with inferprof.request() as req:
        with inferprof.stage("compute"):
            pass
    assert req is None
    assert cap.spans() == []


def test_mode_off_records_nothing(cap):
    inferprof.configure(tracer_provider=cap.provider, mode="off")
    with inferprof.request():
        with inferprof.stage("compute"):
            pass
    assert cap.spans() == []


def test_configure_exports_otlp_grpc_with_resource(otlp_sink, monkeypatch):
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,service.name=from-env"
    )
    reader = InMemoryMetricReader()
    config = inferprof.configure(
        service_name="svc",
        endpoint=otlp_sink.endpoint,
        set_global=False,
        metric_readers=[reader],
        resource_attributes={"team": "ml"},
    )
    assert config.owns_providers and config.protocol == "grpc"
    with inferprof.request(model="m"):
        with inferprof.stage("compute"):
            pass
    inferprof.shutdown()
    assert otlp_sink.wait_for(lambda s: len(s.spans()) >= 2)
    resource, _ = otlp_sink.spans()[0]
    assert (
        resource[semconv.RESOURCE_SERVICE_NAME] == "svc"
    )  # keyword beats OTEL_RESOURCE_ATTRIBUTES
    assert resource["deployment.environment"] == "test"
    assert resource["team"] == "ml"
    assert resource[semconv.RESOURCE_HOST_NAME]
    assert resource[semconv.RESOURCE_SERVICE_INSTANCE_ID]
    stage = [s for _, s in otlp_sink.spans() if attributes(s).get(semconv.ATTR_STAGE) == "compute"]
    assert len(stage) == 1


class _OtlpHttpHandler(http.server.BaseHTTPRequestHandler):
    received: list = []
    paths: list = []
    status = 200

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.paths.append(self.path)
        if self.status != 200:
            self.send_response(self.status)
            self.end_headers()
            return
        if self.path == "/v1/traces":
            req = trace_service_pb2.ExportTraceServiceRequest()
            req.ParseFromString(body)
            self.received.append(req)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_configure_exports_otlp_http_protobuf(monkeypatch):
    _OtlpHttpHandler.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttpHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        config = inferprof.configure(
            service_name="svc",
            endpoint=f"http://127.0.0.1:{server.server_port}",
            set_global=False,
            metric_readers=[InMemoryMetricReader()],
        )
        assert config.protocol == "http/protobuf"
        # inferprof's encoder feeds the SDK's HTTP client: kept traces become bytes when
        # the request ends, as on gRPC.
        assert _config.configured_runtime()._encode
        with inferprof.request():
            with inferprof.stage("tokenize"):
                pass
        with pytest.raises(KeyError):
            with inferprof.request():
                with inferprof.stage("compute"):
                    raise KeyError("lost")
        inferprof.shutdown()
        spans = [
            span
            for req in _OtlpHttpHandler.received
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]
        names = {span.name for span in spans}
        assert names == {semconv.REQUEST_SPAN_NAME, "inferprof.tokenize", "inferprof.compute"}
        (failed,) = [s for s in spans if s.name == "inferprof.compute"]
        assert failed.status.code == failed.status.STATUS_CODE_ERROR
        assert failed.events[0].name == "exception"
        assert len({s.trace_id for s in spans}) == 2
    finally:
        server.shutdown()
        server.server_close()


def test_signal_specific_otlp_variables_beat_the_generic_ones(monkeypatch):
    # OpenTelemetry's rule: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / ..._METRICS_ENDPOINT (full
    # URLs, used as given) and ..._METRICS_PROTOCOL win over OTEL_EXPORTER_OTLP_ENDPOINT and
    # OTEL_EXPORTER_OTLP_PROTOCOL. The generic endpoint here is a closed port: whatever
    # reached the live receiver came through the per-signal variables.
    _OtlpHttpHandler.received, _OtlpHttpHandler.paths = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttpHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    live = f"http://127.0.0.1:{server.server_port}"
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{live}/v1/traces")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"{live}/custom/metrics")
        config = inferprof.configure(service_name="svc", set_global=False)
        assert config.endpoint == "http://127.0.0.1:9"
        assert _config.traces_endpoint(config) == f"{live}/v1/traces"
        assert _config.metrics_endpoint(config) == ("http/protobuf", f"{live}/custom/metrics")
        with inferprof.request():
            with inferprof.stage("tokenize"):
                pass
        inferprof.shutdown()  # flushes spans and the final metrics collection
    finally:
        server.shutdown()
        server.server_close()
    spans = [span for req in _OtlpHttpHandler.received for rs in req.resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    assert {span.name for span in spans} == {semconv.REQUEST_SPAN_NAME, "inferprof.tokenize"}
    assert "/custom/metrics" in _OtlpHttpHandler.paths


@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_ENDPOINT",
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
def test_an_endpoint_variable_that_is_not_a_url_is_named_in_a_warning(monkeypatch, caplog, var):
    monkeypatch.setenv(var, "garbage")
    with caplog.at_level(logging.WARNING, logger="inferprof"):
        inferprof.configure(set_global=False, metric_readers=[InMemoryMetricReader()])
    inferprof.shutdown(timeout_millis=100)
    assert any(var in r.getMessage() and "not a URL" in r.getMessage() for r in caplog.records)


def test_configure_endpoint_argument_beats_the_per_signal_variables(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://elsewhere:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://elsewhere:4318/v1/metrics")
    config = inferprof.configure(endpoint="http://collector:4318", protocol="http/protobuf",
                                 set_global=False, metric_readers=[InMemoryMetricReader()])
    inferprof.shutdown()
    assert _config.traces_endpoint(config) == "http://collector:4318/v1/traces"
    assert _config.metrics_endpoint(config) == ("http/protobuf", "http://collector:4318/v1/metrics")


def test_otlp_http_rejections_are_counted_as_failed_exports(monkeypatch):
    _OtlpHttpHandler.received = []
    monkeypatch.setattr(_OtlpHttpHandler, "status", 400)  # a receiver refusing the payload
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttpHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        inferprof.configure(
            endpoint=f"http://127.0.0.1:{server.server_port}",
            protocol="http/protobuf",
            set_global=False,
            metric_readers=[InMemoryMetricReader()],
        )
        for _ in range(5):
            with inferprof.request():
                with inferprof.stage("tokenize"):
                    pass
        _config.configured_runtime().tracer_provider.force_flush()
        snap = inferprof.instrumentation.stats()
        inferprof.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    assert snap.spans_emitted == 10
    assert snap.spans_dropped_export_failed == 10 and snap.spans_exported == 0


def test_existing_global_sdk_provider_is_used_and_nothing_installed():
    # Global providers can be set once per process: check in a fresh interpreter.
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        import inferprof

        exp = InMemorySpanExporter()
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(exp))
        trace.set_tracer_provider(tp)
        # unconfigured: the application's SDK provider is picked up
        with inferprof.request():
            with inferprof.stage("tokenize"):
                pass
        names = sorted(s.name for s in exp.get_finished_spans())
        assert names == ["inferprof.request", "inferprof.tokenize"]
        config = inferprof.configure(service_name="x")
        assert not config.owns_providers
        assert trace.get_tracer_provider() is tp
        with inferprof.request():
            pass
        inferprof.shutdown()
        assert len(exp.get_finished_spans()) == 3
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout
    # service_name="x" went nowhere (the application's provider keeps its resource): said
    assert "service_name given to configure() is not applied" in out.stderr


def test_no_provider_is_set_at_import_time():
    script = (
        "import inferprof, inferprof.fastapi, inferprof.batching.dynamic\n"
        "import inferprof.instrumentation.stage\n"
        "from opentelemetry import trace\n"
        "assert type(trace.get_tracer_provider()).__name__ == 'ProxyTracerProvider'\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_subpackages_are_reachable_after_import_inferprof_alone_and_loaded_on_first_use():
    # docs: `inferprof.instrumentation.stats()`, `inferprof.batching.current_batch()` after
    # nothing but `import inferprof`; and import inferprof itself stays cheap.
    script = (
        "import sys, inferprof\n"
        "assert 'inferprof.collector' not in sys.modules\n"
        "assert 'inferprof.batching' not in sys.modules\n"
        "assert inferprof.instrumentation.stats() is None  # unconfigured\n"
        "assert not inferprof.batching.current_batch()\n"
        "assert inferprof.collector.__name__ == 'inferprof.collector'\n"
        "assert {'fastapi', 'gpu', 'triton', 'configure'} <= set(dir(inferprof))\n"
        "assert inferprof.gpu.__name__ == 'inferprof.gpu'\n"
        "assert inferprof.triton.__name__ == 'inferprof.triton'\n"
        "assert 'tritonclient' not in sys.modules and 'pynvml' not in sys.modules\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


def test_configure_installs_global_providers_once_and_reconfigures_cleanly():
    script = textwrap.dedent(
        """
        import inferprof
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        c1 = inferprof.configure(service_name="a", endpoint="http://127.0.0.1:9",
                                 metric_readers=[InMemoryMetricReader()])
        tp = trace.get_tracer_provider()
        assert type(tp).__name__ == "TracerProvider" and c1.owns_providers
        assert type(metrics.get_meter_provider()).__name__ == "MeterProvider"
        assert tp.resource.attributes["service.name"] == "a"
        # a second configure() does not mistake inferprof's own global for the app's
        c2 = inferprof.configure(service_name="b", endpoint="http://127.0.0.1:9",
                                 metric_readers=[InMemoryMetricReader()])
        assert c2.owns_providers
        inferprof.shutdown(timeout_millis=500)
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


@pytest.mark.parametrize(("endpoint", "protocol", "expected"), [
    ("http://collector:4317", "http/protobuf", "grpc"),
    ("http://collector:4318", "grpc", "http/protobuf"),
])
def test_an_endpoint_on_the_other_protocols_port_is_warned_about(endpoint, protocol, expected,
                                                                 caplog):
    with caplog.at_level(logging.WARNING, logger="inferprof"):
        inferprof.configure(service_name="svc", endpoint=endpoint, protocol=protocol,
                            set_global=False, metric_readers=[InMemoryMetricReader()])
    inferprof.shutdown()
    warned = [r.getMessage() for r in caplog.records if "port" in r.getMessage()]
    assert len(warned) == 1 and endpoint in warned[0] and f"to {expected}" in warned[0]


@pytest.mark.parametrize(("endpoint", "protocol"), [
    ("http://collector:4317", "grpc"), ("http://collector:4318/v1/traces", "http/protobuf"),
    ("http://collector:9000", "http/protobuf"), (None, "grpc"),
])
def test_matching_or_unknown_ports_are_not_warned_about(endpoint, protocol):
    assert _config.protocol_port_mismatch(endpoint, protocol) is None


def test_stats_with_mode_off_is_an_all_zero_snapshot():
    # docs/instrumenting.md: all 0 with mode="off" (None only when not configured).
    inferprof.configure(mode="off")
    with inferprof.request(), inferprof.stage("tokenize"):
        pass
    snap = inferprof.instrumentation.stats()
    assert snap is not None
    assert (snap.spans_emitted, snap.traces_kept, snap.traces_discarded, snap.spans_dropped) == (
        0, 0, 0, 0)


def _instance_ids_after_fork(**options) -> tuple[str, str]:
    """(the parent's, a forked child's) service.instance.id on the request spans each sent,
    inferprof configured (``options``) before the fork, as a pre-forking server does."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    inferprof.configure(mode="full", span_exporter=exporter, set_global=False,
                        metric_readers=[], **options)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its request span's instance id, down the pipe
            code = 1
            try:
                os.close(read)
                with inferprof.request():
                    pass
                inferprof.shutdown()
                (span,) = exporter.get_finished_spans()
                os.write(write, span.resource.attributes[RESOURCE_ID].encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            child = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with inferprof.request():
            pass
        inferprof.shutdown()
        (span,) = exporter.get_finished_spans()
        return span.resource.attributes[RESOURCE_ID], child
    finally:
        inferprof.shutdown()


RESOURCE_ID = semconv.RESOURCE_SERVICE_INSTANCE_ID


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_worker_forked_after_configure_is_an_instance_of_its_own():
    # Two workers of one pre-forking server sharing an id would be one instance to the
    # collector: one timeline for all their engines' steps, one fleet series.
    parent, child = _instance_ids_after_fork()
    assert parent and child and parent != child


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_an_instance_id_the_user_set_is_kept_in_a_forked_worker(monkeypatch):
    parent, child = _instance_ids_after_fork(resource_attributes={RESOURCE_ID: "worker-a"})
    assert parent == child == "worker-a"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"deployment.environment=x, {RESOURCE_ID}=w-b")
    parent, child = _instance_ids_after_fork()
    assert parent == child == "w-b"
