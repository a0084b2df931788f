"""The shapes of tritonclient's private names ``_triton_compat`` relies on."""

from __future__ import annotations

import numpy as np
import pytest

from inferprof.triton import _triton_compat as compat

http = pytest.importorskip("tritonclient.http")
grpc = pytest.importorskip("tritonclient.grpc")


def test_an_http_input_exposes_the_bytes_it_will_send():
    tensor = http.InferInput("x", [4], "FP32")
    tensor.set_data_from_numpy(np.zeros(4, dtype=np.float32), binary_data=True)
    data = compat.http_input_bytes(tensor)
    assert data is not None and len(data) == 16


def test_a_grpc_input_exposes_its_raw_contents():
    tensor = grpc.InferInput("x", [4], "FP32")
    tensor.set_data_from_numpy(np.zeros(4, dtype=np.float32))
    data = compat.grpc_input_bytes(tensor)
    assert data is not None and len(data) == 16


def test_an_http_async_request_keeps_its_greenlet():
    import gevent

    pending = http.InferAsyncRequest(gevent.spawn(lambda: None), verbose=False)
    assert compat.async_request_greenlet(pending) is not None
