"""Device-stage timing. torch is not installed here: the CUDA event path is exercised with a
SYNTHETIC event class that mimics ``torch.cuda.Event`` on a simulated asynchronous stream,
and a SYNTHETIC ``torch`` module for the calls into ``torch.cuda``. The same path on a real
GPU is ``test_device_cuda.py`` (skipped where torch has no CUDA device)."""

import logging
import sys
import time
import types

import pytest

import inferprof
from inferprof import semconv
from inferprof.instrumentation.device import EventDevice, parse_cuda_device

MS = 1_000_000


class SyntheticStream:
    """SYNTHETIC stand-in for a CUDA stream: launches return at once, work runs in order."""

    def __init__(self):
        self.busy_until = time.time_ns()

    def launch(self, duration_ms):
        self.busy_until = max(time.time_ns(), self.busy_until) + int(duration_ms * MS)

    def synchronize(self):
        while time.time_ns() < self.busy_until:
            time.sleep(0.0005)


class SyntheticEvent:
    """SYNTHETIC stand-in for ``torch.cuda.Event(enable_timing=True)``."""

    def __init__(self, stream):
        self.stream = stream
        self.t = None

    def record(self):
        self.t = max(time.time_ns(), self.stream.busy_until)  # completes when the stream gets here

    def query(self):
        return time.time_ns() >= self.t

    def synchronize(self):
        while not self.query():
            time.sleep(0.0005)

    def elapsed_time(self, end):
        return (end.t - self.t) / MS


def _batch_of_one():
    return inferprof.batch([inferprof.enqueue()], max_size=1)


def test_async_launches_are_timed_by_gpu_events_not_host_timers(cap):
    stream = SyntheticStream()
    dev = EventDevice(lambda: SyntheticEvent(stream), gpu_id="GPU-synthetic-0")
    with inferprof.request():
        with _batch_of_one():
            with inferprof.stage("h2d", device=dev):
                stream.launch(5)
            with inferprof.stage("compute", device=dev):
                stream.launch(30)  # returns immediately, like a CUDA kernel launch
            with inferprof.stage("d2h", device=dev):
                stream.launch(5)
            truth_end = stream.busy_until
    h2d, compute, d2h = (cap.stages(n)[0] for n in ("h2d", "compute", "d2h"))
    assert abs((compute.end_time - compute.start_time) - 30 * MS) < 2 * MS
    assert abs((h2d.end_time - h2d.start_time) - 5 * MS) < 2 * MS
    assert abs(compute.start_time - h2d.end_time) < 1 * MS
    assert abs(d2h.end_time - truth_end) < 15 * MS  # wall anchoring: scheduler noise
    assert compute.attributes[semconv.ATTR_GPU_ID] == "GPU-synthetic-0"
    (request,) = cap.requests()
    assert request.end_time >= d2h.end_time - 1 * MS  # the batch waited for the device


def test_stage_that_synchronises_anchors_on_its_host_end(cap):
    stream = SyntheticStream()
    dev = EventDevice(lambda: SyntheticEvent(stream))
    with inferprof.request():
        with _batch_of_one():
            with inferprof.stage("compute", device=dev):
                stream.launch(20)
            with inferprof.stage("d2h", device=dev):
                stream.launch(2)
                stream.synchronize()  # like tensor.cpu()
            host_end = time.time_ns()
            time.sleep(0.02)  # the batch lingers; the anchor must not drift with it
    compute, d2h = cap.stages("compute")[0], cap.stages("d2h")[0]
    assert abs((compute.end_time - compute.start_time) - 20 * MS) < 2 * MS
    assert abs(d2h.end_time - host_end) < 10 * MS  # far from the 20 ms the batch lingered
    assert semconv.ATTR_GPU_ID not in compute.attributes


def test_cpu_device_uses_host_timers(cap):
    with inferprof.request():
        with inferprof.stage("compute", device="cpu"):
            time.sleep(0.01)
    (compute,) = cap.stages("compute")
    assert compute.end_time - compute.start_time >= 9 * MS


def test_cuda_without_torch_degrades_to_host_timers(cap, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    monkeypatch.setattr("inferprof.instrumentation.device._warned_no_cuda", False)
    monkeypatch.setattr("inferprof.instrumentation.device._torch_devices", {})
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with inferprof.request():
                with inferprof.stage("compute", device="cuda:0"):
                    time.sleep(0.005)
    computes = cap.stages("compute")
    assert len(computes) == 3
    for compute in computes:
        assert compute.end_time - compute.start_time >= 4 * MS
        assert semconv.ATTR_GPU_ID not in compute.attributes
    assert caplog.text.count("torch/CUDA is unavailable") == 1  # warned once, not per stage


class FakeTorch(types.ModuleType):
    """SYNTHETIC ``torch`` module: the few ``torch.cuda`` calls the device path makes, over
    synthetic events and streams. Counts ``is_available()`` calls and records which stream
    each event was recorded on."""

    def __init__(self):
        super().__init__("torch")
        self.available_calls = 0
        self.current = {0: "stream-0-default", 1: "stream-1-default"}
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.stream = None
                self.t = None

            def record(self, stream=None):
                self.stream = stream if stream is not None else outer.current[0]
                self.t = time.time_ns()

            def query(self):
                return True

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.t - self.t) / MS

        def is_available():
            outer.available_calls += 1
            return True

        self.cuda = types.SimpleNamespace(
            Event=Event,
            is_available=is_available,
            current_device=lambda: 1,
            current_stream=lambda index: outer.current[index],
            get_device_properties=lambda index: types.SimpleNamespace(uuid=f"fake-uuid-{index}"),
        )


@pytest.fixture
def fake_torch(monkeypatch):
    torch = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr("inferprof.instrumentation.device._torch_devices", {})
    monkeypatch.setattr("inferprof.instrumentation.device._gpu_uuids", {})
    return torch


def test_torch_events_record_on_the_current_stream_of_the_stage_device(cap, fake_torch):
    """Each stage records both its events on its device's stream current when it began."""
    recorded = []
    orig = fake_torch.cuda.Event

    class Spy(orig):
        def record(self, stream=None):
            super().record(stream)
            recorded.append(self.stream)

    fake_torch.cuda.Event = Spy
    with inferprof.request():
        with _batch_of_one():
            with inferprof.stage("h2d", device="cuda:0"):
                pass
            fake_torch.current[0] = "stream-0-side"  # ``with torch.cuda.stream(side):``
            with inferprof.stage("compute", device="cuda:0"):
                pass
            with inferprof.stage("d2h", device="cuda"):  # the current device: 1
                pass
    assert recorded == ["stream-0-default"] * 2 + ["stream-0-side"] * 2 + ["stream-1-default"] * 2
    h2d, compute, d2h = (cap.stages(n)[0] for n in ("h2d", "compute", "d2h"))
    assert h2d.attributes[semconv.ATTR_GPU_ID] == "GPU-fake-uuid-0"
    assert d2h.attributes[semconv.ATTR_GPU_ID] == "GPU-fake-uuid-1"


def test_torch_availability_is_checked_once_per_device(cap, fake_torch):
    for _ in range(20):
        with inferprof.request():
            with _batch_of_one():
                with inferprof.stage("compute", device="cuda:0"):
                    pass
    assert len(cap.stages("compute")) == 20
    assert fake_torch.available_calls == 1


@pytest.mark.parametrize(
    "device, index", [(None, None), ("cpu", None), ("cuda", -1), ("cuda:2", 2), (1, 1)]
)
def test_parse_device(device, index):
    assert parse_cuda_device(device) == index


@pytest.mark.parametrize("bad", ["gpu:x", "cuda:abc", -1, True])
def test_bad_device_raises_value_error(bad):
    with pytest.raises(ValueError):
        inferprof.stage("compute", device=bad)


def test_torch_device_like_objects():
    class FakeTorchDevice:  # SYNTHETIC: the attributes torch.device has
        def __init__(self, type, index):
            self.type, self.index = type, index

    assert parse_cuda_device(FakeTorchDevice("cuda", 3)) == 3
    assert parse_cuda_device(FakeTorchDevice("cpu", None)) is None


def test_device_stages_of_an_engine_step_are_timed_by_their_events(cap):
    """A step of the step API (``inferprof.Engine``) resolves its device stages' events
    when it ends, as a batch does."""
    stream = SyntheticStream()
    dev = EventDevice(lambda: SyntheticEvent(stream), gpu_id="GPU-synthetic-0")
    engine = inferprof.Engine("e")
    gen = engine.request(prompt_tokens=4)
    with engine.step() as step:
        step.prefill(gen, 4)
        with inferprof.stage("compute", device=dev):
            stream.launch(20)  # returns at once, like a CUDA kernel launch
        with inferprof.stage("d2h", device=dev):
            stream.launch(2)
            stream.synchronize()
    gen.finish()
    (compute,) = cap.stages("compute")
    (d2h,) = cap.stages("d2h")
    (step_span,) = cap.by_name(semconv.ENGINE_STEP_SPAN_NAME)
    assert abs((compute.end_time - compute.start_time) - 20 * MS) < 2 * MS
    assert compute.attributes[semconv.ATTR_GPU_ID] == "GPU-synthetic-0"
    assert compute.attributes[semconv.ATTR_ENGINE_ID] == "e"
    assert compute.parent.span_id == d2h.parent.span_id == step_span.context.span_id
