"""Real servers for the Triton tests, all on 127.0.0.1 with ephemeral ports.

* :class:`PyTritonServer` — a real Triton Inference Server (pytriton's bundled tritonserver,
  CPU only) in a process group of its own, started by ``tests/triton/pytriton_server.py``.
* :class:`OtlpHttpReceiver` — an OTLP/HTTP traces receiver: Triton's OpenTelemetry exporter
  sends OTLP/JSON, pytriton's own proxy OTLP/protobuf; both are kept.
* :class:`HeaderRecorder` — a minimal KServe-v2 ``infer`` endpoint over HTTP and gRPC that
  records the headers / metadata every request arrived with (Triton does not expose them)
  and answers with a fixed one-output result.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from inferprof.collector.otlp_json import parse_trace_request_json

ROOT = Path(__file__).resolve().parents[2]


class _Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the Triton clients reuse connections

    def log_message(self, *args):
        pass

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(handler: type) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- OTLP/HTTP receiver -----------------------------------------------------------------------


class OtlpHttpReceiver:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        receiver = self

        class Handler(_Quiet):
            def do_POST(self):
                body = self._body()
                if "json" in (self.headers.get("Content-Type") or ""):
                    request = parse_trace_request_json(body)
                else:
                    request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with receiver._lock:
                    receiver.requests.append(request)
                    receiver._lock.notify_all()
                self._reply(
                    200,
                    trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                    "application/x-protobuf",
                )

        self._server = _serve(Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def spans(self, service: str | None = None) -> list:
        """Every span received (``service``: only those whose resource has that
        ``service.name``)."""
        out = []
        with self._lock:
            requests = list(self.requests)
        for request in requests:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                if service is not None and attrs.get("service.name") != service:
                    continue
                for ss in rs.scope_spans:
                    out.extend(ss.spans)
        return out

    def wait_for(self, predicate, timeout: float = 10.0, service: str | None = None) -> list:
        """The spans once ``predicate(spans)`` holds; AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(service)
            if predicate(spans):
                return spans
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"spans never matched; got {[s.name for s in spans]}")
            with self._lock:
                self._lock.wait(min(remaining, 0.1))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- header recorder ------------------------------------------------------------------------

_RESULT = {"name": "y", "datatype": "FP32", "shape": [1, 1]}
_VALUE = b"\x00\x00\x80\x3f"  # 1.0f


class HeaderRecorder:
    """``http`` and ``grpc`` endpoints; ``seen``: (protocol, {header: value}) per request."""

    def __init__(self) -> None:
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.seen: list[tuple[str, dict]] = []
        recorder = self

        class Handler(_Quiet):
            def do_POST(self):
                self._body()
                recorder.seen.append(("http", {k.lower(): v for k, v in self.headers.items()}))
                model = self.path.split("/")[3]
                out = {"model_name": model, "outputs": [dict(_RESULT, data=[1.0])]}
                self._reply(200, json.dumps(out).encode(), "application/json")

        class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ModelInfer(self, request, context):
                recorder.seen.append(("grpc", dict(context.invocation_metadata())))
                response = service_pb2.ModelInferResponse(model_name=request.model_name)
                output = response.outputs.add()
                output.name, output.datatype = _RESULT["name"], _RESULT["datatype"]
                output.shape.extend(_RESULT["shape"])
                response.raw_output_contents.append(_VALUE)
                return response

        self._http = _serve(Handler)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), self._grpc)
        grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self.urls = {
            "http": f"127.0.0.1:{self._http.server_address[1]}",
            "grpc": f"127.0.0.1:{grpc_port}",
        }

    def last(self, protocol: str) -> dict:
        return next(h for p, h in reversed(self.seen) if p == protocol)

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._grpc.stop(grace=None).wait()


# --- Triton ---------------------------------------------------------------------------------


_LIBPYTHON_PROBE = (
    "import sysconfig as s; print(s.get_config_var('Py_ENABLE_SHARED'));"
    " print(s.get_config_var('LIBDIR'))"
)


def _triton_env(python: str) -> dict:
    env = dict(os.environ)
    # Triton's Python backend stub links libpython3.X.so.1.0 and runs the standard library
    # of the interpreter that runs Triton (``python``, maybe not this one) on it. Where
    # another build of the same version is first on the loader's path (a distribution's
    # libpython next to a pyenv Python), the stub loads that one and the newer standard
    # library fails on it: point the loader at ``python``'s own.
    if python == sys.executable:
        shared, libdir = (
            sysconfig.get_config_var("Py_ENABLE_SHARED"),
            sysconfig.get_config_var("LIBDIR"),
        )
    else:
        probe = subprocess.run(
            [
                python,
                "-c",
                _LIBPYTHON_PROBE,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        shared, libdir = probe[0].strip() not in ("0", "None", ""), probe[1].strip()
    if shared and libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, env.get("LD_LIBRARY_PATH")) if p
        )
    return env


#: Where ``bash .ci/run`` installs nvidia-pytriton: a virtual environment of its own, because
#: pytriton pins numpy below 2 and the package is tested with what users install (numpy 2).
PYTRITON_VENV = ROOT / ".venv-pytriton"
ENV_PYTRITON_PYTHON = "INFERPROF_TEST_PYTRITON_PYTHON"


def pytriton_python() -> str | None:
    """The interpreter that runs Triton: ``$INFERPROF_TEST_PYTRITON_PYTHON``, else
    ``.venv-pytriton/bin/python`` (made by ``bash .ci/run``), else this interpreter when it
    has pytriton; None when none has."""
    explicit = os.environ.get(ENV_PYTRITON_PYTHON)
    if explicit:
        return explicit
    venv_python = PYTRITON_VENV / "bin" / "python"
    if venv_python.exists():
        return str(venv_python)
    try:
        import pytriton  # noqa: F401
    except ImportError:
        return None
    return sys.executable


class PyTritonServer:
    """``tests/triton/pytriton_server.py`` in a process group of its own; ``stop()`` ends it
    and, should it not exit, everything it started."""

    def __init__(
        self,
        python: str,
        trace_url: str | None = None,
        trace_rate: int = 1,
        timeout: float = 120.0,
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="inferprof-triton-")
        ready = Path(self._dir.name) / "ready.json"
        self.log_path = Path(self._dir.name) / "triton.log"
        cmd = [python, "-m", "tests.triton.pytriton_server", str(ready)]
        if trace_url:
            cmd += ["--trace-url", trace_url, "--trace-rate", str(trace_rate)]
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=_triton_env(python),
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            while not ready.exists():
                if self._proc.poll() is not None:
                    raise RuntimeError(f"Triton exited ({self._proc.returncode}):\n{self.log()}")
                if time.monotonic() - started > timeout:
                    raise RuntimeError(f"Triton not ready after {timeout} s:\n{self.log()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        ports = json.loads(ready.read_text())
        self.http_url = f"127.0.0.1:{ports['http']}"
        self.grpc_url = f"127.0.0.1:{ports['grpc']}"

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def stop(self, timeout: float = 20.0) -> None:
        proc = self._proc
        try:
            if proc.poll() is None:
                proc.stdin.close()  # the server's signal to stop
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            # Its group: tritonserver, the Python backend stubs and pytriton's helpers. They
            # get a few seconds to finish on their own (a stub killed early leaves its
            # shared memory behind), then SIGTERM, then SIGKILL (the stubs ignore SIGTERM).
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
                if _wait_group(proc.pid, 5.0 if sig is None else 2.0):
                    break
            if proc.poll() is None:
                proc.wait(5)
        finally:
            self._dir.cleanup()
            # pytriton names its shared-memory blocks after the server process's pid; one
            # whose owner died before freeing it would outlive the tests.
            for leftover in Path("/dev/shm").glob(f"pytrtion{proc.pid}-*"):
                with contextlib.suppress(OSError):
                    leftover.unlink()


def _wait_group(pgid: int, timeout: float) -> bool:
    """True once process group ``pgid`` has no member left (within ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
