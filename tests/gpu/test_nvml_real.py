"""``NvmlSource`` on a REAL NVIDIA GPU, through the real nvidia-ml-py (no fake_pynvml).

CI machines have no NVIDIA driver: there this module is skipped, and the same code is
covered through ``tests/gpu/fake_pynvml.py`` in ``test_nvml.py``. It is run on a GPU machine
when one is lent (the note on issue 2 says what it saw there):

    python3 -m pytest -q tests/gpu/test_nvml_real.py

The load tests need torch with CUDA, to put real work on the GPU.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from inferprof import semconv as sc
from tests.gpu.fake_pynvml import real_nvml_works

if not real_nvml_works():
    pytest.skip("no NVIDIA driver/GPU here (covered by test_nvml.py through fake_pynvml)",
                allow_module_level=True)

import pynvml

from inferprof.gpu.nvml import NvmlSource

GiB = 1 << 30


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _values(sample) -> dict[str, float]:
    return dict(sample.values)


def test_every_gpu_is_read_with_the_contract_names_and_units():
    src = NvmlSource()
    src.open()
    try:
        samples = src.read()
    finally:
        src.close()
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    assert len(samples) == count >= 1
    assert len({s.hw_id for s in samples}) == count
    for s in samples:
        assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", s.hw_id), s.hw_id
        assert abs(s.time_unix_nano - time.time_ns()) < 5 * 10**9
        v = _values(s)
        assert 0.0 <= v[sc.METRIC_GPU_UTILIZATION] <= 1.0
        assert v[sc.METRIC_GPU_MEMORY_LIMIT] > 1 * GiB  # bytes, not MiB
        assert 0 < v[sc.METRIC_GPU_MEMORY_USAGE] <= v[sc.METRIC_GPU_MEMORY_LIMIT]
        assert v[sc.METRIC_GPU_MEMORY_UTILIZATION] == pytest.approx(
            v[sc.METRIC_GPU_MEMORY_USAGE] / v[sc.METRIC_GPU_MEMORY_LIMIT])
        if sc.METRIC_GPU_POWER_DRAW in v:  # watts, not milliwatts
            assert 5.0 < v[sc.METRIC_GPU_POWER_DRAW] < 2000.0
        assert 100.0 < v[sc.METRIC_GPU_CLOCK_GRAPHICS] < 5000.0  # MHz
        assert 0.0 < v[sc.METRIC_GPU_TEMPERATURE] < 120.0  # Cel


def test_the_uuid_is_what_the_cuda_stages_carry():
    torch = _cuda()
    from inferprof.instrumentation.device import gpu_uuid

    src = NvmlSource()
    src.open()
    try:
        assert gpu_uuid(torch.cuda.current_device()) in src.gpu_ids
    finally:
        src.close()


def test_utilisation_and_memory_follow_real_work_on_the_gpu():
    torch = _cuda()
    from inferprof.instrumentation.device import gpu_uuid

    uuid = gpu_uuid(torch.cuda.current_device())
    src = NvmlSource(devices=[uuid])
    src.open()
    gpm = src.gpm_gpu_ids
    try:
        time.sleep(0.2)  # GPM figures cover the time since the last read
        before = _values(src.read()[0])
        block = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        stop = threading.Event()

        def load():
            while not stop.is_set():
                for _ in range(10):
                    a @ a
                torch.cuda.synchronize()

        worker = threading.Thread(target=load)
        worker.start()
        try:
            busy = []
            end = time.monotonic() + 2.0  # NVML refreshes utilisation every 1/6 s to 1 s
            while time.monotonic() < end:
                busy.append(_values(src.read()[0]))
                time.sleep(0.1)
        finally:
            stop.set()
            worker.join()
        del block
        torch.cuda.empty_cache()
    finally:
        src.close()
    # the GPU was kept busy without a gap: the driver's last period saw a kernel all along
    assert max(v[sc.METRIC_GPU_UTILIZATION] for v in busy[-5:]) >= 0.9, busy
    if uuid in gpm:  # Hopper and later: bf16 matrix products keep the SMs and tensor pipes busy
        assert before[sc.METRIC_DCGM_SM_ACTIVE] < 0.2, before
        assert max(v[sc.METRIC_DCGM_SM_ACTIVE] for v in busy[-5:]) >= 0.8, busy
        assert max(v[sc.METRIC_DCGM_TENSOR_ACTIVE] for v in busy[-5:]) >= 0.5, busy
        assert all(0 < v[sc.METRIC_DCGM_SM_OCCUPANCY] <= 1 for v in busy[-5:]), busy
    grown = busy[-1][sc.METRIC_GPU_MEMORY_USAGE] - before[sc.METRIC_GPU_MEMORY_USAGE]
    assert grown >= 2 * GiB * 0.99, (grown, before, busy[-1])
    assert busy[-1][sc.METRIC_GPU_MEMORY_LIMIT] == before[sc.METRIC_GPU_MEMORY_LIMIT]
