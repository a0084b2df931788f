"""Device stages on a REAL CUDA GPU through torch (no synthetic events).

These tests need torch with a CUDA device, which CI machines do not have: there the module
is skipped, and the same code path (``inferprof.instrumentation.device``) is covered by the
synthetic-event tests in ``test_device.py``. They are run on a GPU machine when one is lent
(see the note on issue 2 for what they measured there):

    python3 -m pytest -q tests/instrumentation/test_device_cuda.py

What they check is the point of device stages: a host timer around an asynchronous kernel
launch measures the launch, not the work; a device stage's span must cover the GPU's time.
"""

import asyncio
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (covered by the synthetic tests in test_device.py)",
                allow_module_level=True)

import inferprof  # noqa: E402
from inferprof import semconv  # noqa: E402
from inferprof.instrumentation.device import gpu_uuid  # noqa: E402

MS = 1_000_000
N = 4096


def _operands():
    a = torch.randn(N, N, device="cuda")
    b = torch.randn(N, N, device="cuda")
    for _ in range(3):  # warm up cuBLAS and the clocks
        a @ b
    torch.cuda.synchronize()
    return a, b


def _kernel_time_ms(a, b, reps):
    """GPU time of ``reps`` matmuls, measured independently with a pair of events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        c = a @ b
    end.record()
    end.synchronize()
    del c
    return start.elapsed_time(end)


def _reps_for(a, b, target_ms=40.0):
    one = _kernel_time_ms(a, b, 1)
    return max(1, round(target_ms / one))


def _duration_ms(span):
    return (span.end_time - span.start_time) / MS


def test_compute_stage_spans_gpu_time_not_launch_time(cap):
    a, b = _operands()
    reps = _reps_for(a, b)
    host_in = torch.randn(N, N).pin_memory()

    def trial():
        with inferprof.request():
            with inferprof.batch([inferprof.enqueue()], max_size=1):
                with inferprof.stage("h2d", device="cuda:0"):
                    x = host_in.to("cuda:0", non_blocking=True)
                with inferprof.stage("compute", device="cuda:0"):
                    launch_start = time.perf_counter()
                    for _ in range(reps):
                        y = a @ b
                    launch_ms = (time.perf_counter() - launch_start) * 1e3
                    y = y + x
                with inferprof.stage("d2h", device="cuda:0"):
                    out = y[:64].cpu()  # 1 MiB; synchronises
                d2h_returned = time.time_ns()
        assert out.shape == (64, N)
        return launch_ms, d2h_returned

    # The first trial pays one-off host stalls (the caching allocator's cudaMalloc, lazy
    # kernel loading) that the stream's timeline rightly counts: measure the second.
    trial()
    truth_ms = _kernel_time_ms(a, b, reps)
    launch_ms, d2h_returned = trial()
    h2d, compute, d2h = (cap.stages(n)[-1] for n in ("h2d", "compute", "d2h"))
    # The launches returned long before the GPU finished: a host timer would be wrong...
    assert launch_ms < 0.2 * truth_ms, (launch_ms, truth_ms)
    # ...and the span covers the GPU's time instead (the extra add is a few % of it).
    assert truth_ms * 0.95 < _duration_ms(compute) < truth_ms * 1.15, (
        _duration_ms(compute), truth_ms)
    # Stages follow each other on the GPU's clock, anchored to wall time at the d2h end.
    assert h2d.end_time <= compute.start_time + MS // 10
    assert compute.end_time <= d2h.start_time + MS // 10
    assert abs(d2h.end_time - d2h_returned) < 5 * MS
    # The compute time does not land in d2h, where the host waited for it.
    assert _duration_ms(d2h) < truth_ms / 10
    request = cap.requests()[-1]
    assert request.start_time <= h2d.start_time and d2h.end_time <= request.end_time
    assert compute.attributes[semconv.ATTR_GPU_ID] == gpu_uuid(torch.cuda.current_device())


def test_gpu_id_is_the_nvml_uuid(cap):
    """``inferprof.gpu.id`` must equal NVML's UUID: GPU samples are joined on it (§4)."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        index = torch.cuda.current_device()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
    finally:
        pynvml.nvmlShutdown()
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    assert gpu_uuid(index) == uuid
    assert uuid.startswith("GPU-")


def test_stage_on_a_side_stream_is_timed_on_that_stream(cap):
    a, b = _operands()
    reps = _reps_for(a, b, 30.0)
    truth_ms = _kernel_time_ms(a, b, reps)
    side = torch.cuda.Stream()
    for _ in range(2):  # the first pays one-off stalls; the second is measured
        with inferprof.request():
            with inferprof.batch([inferprof.enqueue()], max_size=1):
                with torch.cuda.stream(side):
                    with inferprof.stage("compute", device="cuda"):
                        for _ in range(reps):
                            y = a @ b
                with inferprof.stage("d2h", device="cuda"):
                    torch.cuda.current_stream().wait_stream(side)
                    y.cpu()
    compute = cap.stages("compute")[-1]
    assert truth_ms * 0.95 < _duration_ms(compute) < truth_ms * 1.15


async def test_dynamic_batcher_device_stages_on_gpu(cap):
    a, b = _operands()
    reps = _reps_for(a, b, 20.0)

    def run_batch(items):
        with inferprof.stage("h2d", device="cuda:0"):
            x = torch.tensor(items, dtype=torch.float32).to("cuda:0", non_blocking=True)
        with inferprof.stage("compute", device="cuda:0"):
            for _ in range(reps):
                y = a @ b
            z = x * 2 + y[0, 0] * 0
        with inferprof.stage("d2h", device="cuda:0"):
            return z.cpu().tolist()

    async with inferprof.DynamicBatcher(run_batch, max_batch_size=8, max_delay_ms=20) as batcher:

        async def one(i):
            async with inferprof.request():
                return await batcher.submit(float(i))

        await asyncio.gather(*(one(i) for i in range(8)))  # warm-up: one-off stalls
        warm = len(cap.stages("compute"))
        truth_ms = _kernel_time_ms(a, b, reps)
        results = await asyncio.gather(*(one(i) for i in range(8)))
    assert results == [2.0 * i for i in range(8)]
    computes = cap.stages("compute")[warm:]
    assert len(computes) == 8  # one per member request (children encoding, the default)
    for span in computes:
        assert truth_ms * 0.95 < _duration_ms(span) < truth_ms * 1.15, (
            _duration_ms(span), truth_ms)
    requests = {r.context.trace_id: r for r in cap.requests()}
    assert len(requests) == 16
    for span in cap.stages():
        req = requests[span.context.trace_id]
        assert req.start_time <= span.start_time and span.end_time <= req.end_time + MS // 10
