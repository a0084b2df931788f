"""Device-stage timing (``h2d``, ``compute``, ``d2h``) for asynchronous accelerators.

On CUDA, ``model(x)`` returns as soon as the kernels are *queued*: a host timer around it
measures launch overhead, not compute, and the time shows up wherever the next
synchronisation happens (usually the ``d2h`` copy). So a stage opened with a CUDA
``device=`` records a pair of ``torch.cuda.Event(enable_timing=True)`` on the current
stream and keeps host timestamps; the events are resolved when the batch (or request)
ends, and only then are the stage's start/end rewritten from GPU time:

* durations and gaps between device stages come from ``event.elapsed_time`` (GPU clock);
* one event is anchored to wall-clock time: the latest stage end. If that event had already
  completed when the stage ended (the stage synchronised, e.g. ``.cpu()`` inside ``d2h``),
  its host timestamp is exact; if it is still pending at resolution, inferprof synchronises
  on it and takes the time it completes; otherwise the resolution time is used (an upper
  bound, off by at most the gap between the stage's end and the batch's end).

Without torch, without CUDA, or for ``device=None``/``"cpu"``, stages use host timers and
nothing here runs. torch is imported lazily, only when a CUDA device is named.

The event objects only need ``record()``, ``query()``, ``synchronize()`` and
``elapsed_time(other) -> ms``; ``event_factory`` lets tests (and other accelerators with a
CUDA-like event API) supply their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from inferprof import semconv

_logger = logging.getLogger(__name__)
_NS_PER_MS = 1_000_000
_gpu_uuids: dict[int, str | None] = {}
_warned_no_cuda = False


def parse_cuda_device(device: Any) -> int | None:
    """CUDA device index named by ``device``, or None for the host.

    Accepts None, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int N, or a ``torch.device``.
    ``"cuda"`` means the current device (index -1 until torch resolves it).
    """
    if device is None or isinstance(device, EventDevice):
        return None
    if isinstance(device, bool):
        raise ValueError(f"device must be a device name, index or torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"CUDA device index must be >= 0, got {device}")
        return device
    dtype = getattr(device, "type", None)
    if dtype is not None and not isinstance(device, str):
        if dtype != "cuda":
            return None
        index = getattr(device, "index", None)
        return -1 if index is None else int(index)
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind == "cuda":
            if not idx:
                return -1
            if idx.isdigit():
                return int(idx)
        elif not idx:
            return None  # cpu, mps without events, ...: host timers
    raise ValueError(
        f"unrecognised device {device!r}; use 'cpu', 'cuda', 'cuda:N', an int or a torch.device"
    )


class _TorchDevice:
    """What a CUDA device stage needs from torch, looked up once per device index.

    ``torch.cuda.Event.record()`` with no stream looks the current stream up through
    ``torch.cuda.current_stream()``, whose device-index resolution alone checks
    ``torch.cuda.is_available()``; that cost about half of a device stage's CPU
    (benchmarks/device_stage_cost.py). Asking for the current stream of a known index
    skips it, and still follows ``with torch.cuda.stream(s):``.
    """

    __slots__ = ("current_stream", "event_cls", "gpu_id", "index")

    def __init__(self, torch: Any, index: int) -> None:
        self.index = index
        self.event_cls = torch.cuda.Event
        self.current_stream = torch.cuda.current_stream
        self.gpu_id = gpu_uuid(index)

    def event(self) -> Any:
        return self.event_cls(enable_timing=True)

    def stream(self) -> Any:
        return self.current_stream(self.index)


_torch_devices: dict[int, _TorchDevice | None] = {}


def _torch_device(index: int) -> _TorchDevice | None:
    """The cached torch handles of CUDA device ``index`` (-1: the current device), or None
    when torch or CUDA is unavailable (warned once; host timers are used)."""
    global _warned_no_cuda
    if index in _torch_devices:  # -1 is only ever cached as None
        return _torch_devices[index]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        if not _warned_no_cuda:
            _warned_no_cuda = True
            _logger.warning(
                "a CUDA device stage was requested but torch/CUDA is unavailable; using host timers"
            )
        _torch_devices[index] = None
        return None
    if index < 0:
        index = torch.cuda.current_device()
        found = _torch_devices.get(index)
        if found is not None:
            return found
    dev = _torch_devices[index] = _TorchDevice(torch, index)
    return dev


def gpu_uuid(index: int) -> str | None:
    """``hw.id`` of CUDA device ``index`` (``GPU-<uuid>``, as NVML reports it), cached."""
    if index in _gpu_uuids:
        return _gpu_uuids[index]
    value = None
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            value = text if text.startswith("GPU-") else f"GPU-{text}"
    except Exception:
        value = None
    _gpu_uuids[index] = value
    return value


class DeviceTiming:
    """The two events of one device stage, plus the host times they were recorded at.

    ``stream``: the stream both events are recorded on (torch: the device's current stream
    when the stage began; a ``with torch.cuda.stream(s):`` inside the stage has ended by
    the time the stage does, so the current stream then is the same one); None records on
    the event's own default.
    """

    __slots__ = (
        "done_at_end",
        "end_event",
        "end_host",
        "rec",
        "start_event",
        "start_host",
        "stream"
    )

    def __init__(self, rec: Any, start_event: Any, end_event: Any, stream: Any = None) -> None:
        self.rec = rec
        self.start_event = start_event
        self.end_event = end_event
        self.stream = stream
        if stream is None:
            start_event.record()
        else:
            start_event.record(stream)
        self.start_host = time.time_ns()
        self.end_host = 0
        self.done_at_end = False

    def end(self) -> None:
        if self.stream is None:
            self.end_event.record()
        else:
            self.end_event.record(self.stream)
        self.end_host = time.time_ns()
        self.done_at_end = bool(self.end_event.query())


def begin_device_stage(
    rec: Any,
    device: Any,
    *,
    event_factory: Callable[[], Any] | None = None,
    gpu_id: str | None = None,
) -> DeviceTiming | None:
    """Start event timing for ``rec`` on ``device``; None means host timers suffice."""
    global _used
    if isinstance(device, EventDevice):
        event_factory, gpu_id = device.event_factory, device.gpu_id
    stream = None
    if event_factory is None:
        index = parse_cuda_device(device)
        if index is None:
            return None
        dev = _torch_device(index)
        if dev is None:
            return None
        event_factory, gpu_id, stream = dev.event, dev.gpu_id, dev.stream()
    if gpu_id is not None:
        rec.attrs.setdefault(semconv.ATTR_GPU_ID, gpu_id)
    _used = True
    timing = DeviceTiming(rec, event_factory(), event_factory(), stream)
    rec.device = timing
    return timing


def host_timed(device: Any) -> bool:
    """Whether a stage on ``device`` is timed by host timers, as :func:`begin_device_stage`
    leaves it: the host (None, ``"cpu"``), or a CUDA device where torch or CUDA is
    unavailable (or its lookup fails)."""
    if device is None:
        return True
    if isinstance(device, EventDevice):
        return False
    try:
        index = parse_cuda_device(device)
        return index is None or _torch_device(index) is None
    except Exception:
        return True


class EventDevice:
    """A ``device=`` value carrying its own event factory (other accelerators, tests)."""

    def __init__(self, event_factory: Callable[[], Any], gpu_id: str | None = None) -> None:
        self.event_factory = event_factory
        self.gpu_id = gpu_id


#: Whether any device stage was ever begun in this process: until one is, no record can
#: hold a pending timing and resolve_stages() need not look (it runs for every request).
_used = False


def resolve_stages(stages: Iterable[Any]) -> None:
    """Rewrite the start/end of every pending device stage from its events. Never raises."""
    if not _used:
        return
    pending = [s.device for s in stages if s.device is not None]
    if not pending:
        return
    try:
        _resolve(pending)
    except Exception:
        _logger.exception("inferprof could not resolve device timings; keeping host times")
    for t in pending:
        t.rec.device = None


def _resolve(timings: list[DeviceTiming]) -> None:
    finished = [t for t in timings if t.end_host]
    if not finished:
        return
    base = min(finished, key=lambda t: t.start_host).start_event
    last = max(finished, key=lambda t: t.end_host)
    if last.done_at_end:
        anchor_wall = last.end_host
    elif not last.end_event.query():
        last.end_event.synchronize()
        anchor_wall = time.time_ns()
    else:
        anchor_wall = time.time_ns()
    anchor_offset = base.elapsed_time(last.end_event) * _NS_PER_MS
    origin = anchor_wall - anchor_offset  # wall-clock time of ``base``
    for t in finished:
        t.rec.start = int(origin + base.elapsed_time(t.start_event) * _NS_PER_MS)
        t.rec.end = int(origin + base.elapsed_time(t.end_event) * _NS_PER_MS)


__all__ = [
    "DeviceTiming",
    "EventDevice",
    "begin_device_stage",
    "gpu_uuid",
    "host_timed",
    "parse_cuda_device",
    "resolve_stages",
]
