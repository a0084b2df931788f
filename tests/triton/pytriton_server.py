"""A Triton Inference Server for the tests, run in a process of its own.

``python -m tests.triton.pytriton_server READY_FILE [--trace-url URL]`` starts tritonserver
through pytriton on 127.0.0.1 (free ports), serving small numpy models on the CPU, writes
its ports as JSON to ``READY_FILE`` once the models are ready, and stops when its standard
input closes (or on SIGTERM). Its output is Triton's log. A process of its own because pytriton installs a global OpenTelemetry
tracer provider when tracing is on, changes signal handling and starts helper processes:
none of that belongs in the test process.

Models:

* ``double`` — ``y = 2 * x``, FP32, batched (max batch 8).
* ``count`` — decoupled: for input ``x`` (INT32, one element), ``n = x`` responses
  ``y = 0, 1, ..., n-1``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@batch
def _double(x):
    return {"y": x * 2}


def _count(requests):
    n = max(int(r["x"].reshape(-1)[0]) for r in requests)
    for k in range(n):
        yield [{"y": np.array([k], dtype=np.int32)} for _ in requests]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ready_file", help="where to write the ports once serving")
    parser.add_argument("--trace-url", default=None, help="OTLP/HTTP traces URL for Triton")
    parser.add_argument("--trace-rate", type=int, default=1, help="trace every Nth request")
    args = parser.parse_args()
    http_port, grpc_port = _free_port(), _free_port()
    trace_config = None
    if args.trace_url:
        trace_config = [
            "mode=opentelemetry",
            f"rate={args.trace_rate}",
            "level=TIMESTAMPS",
            f"opentelemetry,url={args.trace_url}",
            "opentelemetry,resource=service.name=triton",
            "opentelemetry,bsp_schedule_delay=50",
        ]
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=http_port,
        grpc_address="127.0.0.1",
        grpc_port=grpc_port,
        allow_metrics=False,
        exit_timeout_secs=1,
        trace_config=trace_config,
    )
    triton = Triton(config=config)
    triton.bind(
        model_name="double",
        infer_func=_double,
        inputs=[Tensor(name="x", dtype=np.float32, shape=(-1,))],
        outputs=[Tensor(name="y", dtype=np.float32, shape=(-1,))],
        config=ModelConfig(max_batch_size=8),
    )
    triton.bind(
        model_name="count",
        infer_func=_count,
        inputs=[Tensor(name="x", dtype=np.int32, shape=(1,))],
        outputs=[Tensor(name="y", dtype=np.int32, shape=(1,))],
        config=ModelConfig(batching=False, decoupled=True),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    triton.run()
    try:
        with open(args.ready_file + ".tmp", "w") as fh:
            json.dump({"http": http_port, "grpc": grpc_port}, fh)
        os.replace(args.ready_file + ".tmp", args.ready_file)
        # Standard input closing (the test process is done, or gone) means stop.
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        stop.wait()
    finally:
        triton.stop()


if __name__ == "__main__":
    main()
