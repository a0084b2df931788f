import platform

import pytest

from tests.triton.servers import (
    ENV_PYTRITON_PYTHON,
    HeaderRecorder,
    OtlpHttpReceiver,
    PyTritonServer,
    pytriton_python,
)

# Every module here talks to tritonclient; without it (no inferprof[triton]) they skip.
# test_import.py, which checks the error naming the extra, needs nothing.
collect_ignore = []
try:
    import tritonclient.grpc
    import tritonclient.http  # noqa: F401
except ImportError:
    collect_ignore = [
        "test_front_end.py",
        "test_instrument.py",
        "test_propagation.py",
        "test_triton_server.py",
    ]


@pytest.fixture(scope="package")
def triton_traces():
    """The OTLP/HTTP receiver Triton exports its own spans to."""
    receiver = OtlpHttpReceiver()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="package")
def triton(triton_traces):
    """A real Triton Inference Server (pytriton, CPU), started once for the package, its
    OpenTelemetry tracing on (every request) and exporting to ``triton_traces``."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("nvidia-pytriton (tritonserver) is built for Linux x86-64 only")
    python = pytriton_python()
    if python is None:
        pytest.fail(
            "no Triton server for the tests: `bash .ci/run` installs one; or run "
            "`python3 -m venv .venv-pytriton && .venv-pytriton/bin/pip install nvidia-pytriton`"
            f" (or point {ENV_PYTRITON_PYTHON} at a Python that has nvidia-pytriton)"
        )
    server = PyTritonServer(python, trace_url=triton_traces.url)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def recorder():
    """HTTP and gRPC infer endpoints recording the headers each request arrived with."""
    server = HeaderRecorder()
    try:
        yield server
    finally:
        server.stop()
