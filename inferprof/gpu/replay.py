"""Recorded GPU samples, played back: for machines without a GPU, for tests, and for trying
the pipeline. NOT live GPU data: replayed samples carry the resource attribute
``inferprof.gpu.source = "replay"`` and the sampler says so when it starts.

The file is JSON lines, one GPU reading per line; lines starting with ``#`` are comments
(use one to say where the recording comes from)::

    # recorded on an H100 with `inferprof gpu --source nvml --record h100.jsonl`
    {"t": 1714000000.10, "hw.id": "GPU-5f1c...", "host.name": "gpu-node-1",
     "values": {"hw.gpu.utilization": 0.42, "hw.gpu.power.draw": 311.5}}

``t`` is in seconds (unix time or any other origin; a float, so microseconds are the
finest step that survives); ``host.name`` is optional; ``values``
holds contract metrics in the contract's units. Playback keeps the recording's spacing:
the first reading is stamped with the time playback started, the others at their offset
from it, each emitted once the clock reaches it; with ``loop`` the recording starts over
after its last reading (one median gap later); without it, :attr:`ReplaySource.exhausted`
turns True once the last reading was read, and the sampler stops polling it
(``GpuSampler.exhausted``; the ``inferprof gpu`` sidecar then exports what it holds and exits).

:func:`write_samples` writes the same format (``inferprof gpu --record FILE``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Iterable
from typing import IO

from inferprof import semconv as sc
from inferprof.gpu.records import METRICS, GpuSample

#: Playback is driven by the recording's timestamps; polling every 0.1 s emits each reading
#: within 0.1 s of its time.
DEFAULT_INTERVAL_S = 0.1

KEY_T = "t"
KEY_HW_ID = "hw.id"
KEY_HOST = "host.name"
KEY_VALUES = "values"


def _record(line: str, where: str) -> tuple[float, str, str | None, tuple[tuple[str, float], ...]]:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object")
    t, hw_id, host, values = (doc.get(k) for k in (KEY_T, KEY_HW_ID, KEY_HOST, KEY_VALUES))
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"{where}: {KEY_T!r} must be a number of seconds, got {t!r}")
    if not isinstance(hw_id, str) or not hw_id:
        raise ValueError(f"{where}: {KEY_HW_ID!r} must be a non-empty string, got {hw_id!r}")
    if host is not None and not isinstance(host, str):
        raise ValueError(f"{where}: {KEY_HOST!r} must be a string, got {host!r}")
    if not isinstance(values, dict) or not values:
        raise ValueError(f"{where}: {KEY_VALUES!r} must be an object of metric: number")
    pairs = []
    for name, value in values.items():
        if name not in METRICS:
            raise ValueError(f"{where}: {name!r} is not a GPU metric of the contract "
                             f"({', '.join(sorted(METRICS))})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"{where}: {name} must be a number, got {value!r}")
        pairs.append((name, float(value)))
    return float(t), hw_id, host or None, tuple(pairs)


def read_samples(path: str | os.PathLike[str]
                 ) -> list[tuple[float, str, str | None, tuple[tuple[str, float], ...]]]:
    """The readings of a recording, ordered by time: (t, hw.id, host or None, values).
    Raises ``ValueError`` naming the line of the first malformed one."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            out.append(_record(line, f"{os.fspath(path)}:{number}"))
    if not out:
        raise ValueError(f"{os.fspath(path)}: no GPU readings in it")
    out.sort(key=lambda r: r[0])
    return out


def write_samples(samples: Iterable[GpuSample], fh: IO[str]) -> None:
    """Append ``samples`` to ``fh`` in the recording format."""
    for s in samples:
        doc: dict = {KEY_T: round(s.time_unix_nano / 1e9, 6), KEY_HW_ID: s.hw_id}
        if s.host:
            doc[KEY_HOST] = s.host
        doc[KEY_VALUES] = dict(s.values)
        fh.write(json.dumps(doc, separators=(",", ":")) + "\n")


class ReplaySource:
    """Plays a recording back in real time (see the module docstring)."""

    name = sc.GPU_SOURCE_REPLAY
    default_interval = DEFAULT_INTERVAL_S

    def __init__(self, path: str | os.PathLike[str], *, loop: bool = True) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file path, got {path!r}")
        self.path = path
        self.loop = bool(loop)
        self._records: list[tuple[int, str, str | None, tuple[tuple[str, float], ...]]] = []
        self._period_ns = 0
        self._base_ns = 0
        self._next = 0

    def open(self) -> None:
        records = read_samples(self.path)  # ValueError: a bad file is a bad argument
        t0 = records[0][0]
        offsets = [round((t - t0) * 1e9) for t, *_ in records]
        self._records = [(off, r[1], r[2], r[3]) for off, r in zip(offsets, records, strict=False)]
        distinct = sorted(set(offsets))
        gaps = [b - a for a, b in itertools.pairwise(distinct)]
        gap = statistics.median(gaps) if gaps else 100_000_000
        self._period_ns = int(offsets[-1] + gap)
        self._base_ns = time.time_ns()
        self._next = 0

    @property
    def exhausted(self) -> bool:
        """True once a recording played without ``loop`` has given its last reading."""
        return not self.loop and bool(self._records) and self._next == len(self._records)

    @property
    def hosts(self) -> list[str]:
        """The ``host.name`` values the recording names (after :meth:`open`)."""
        return sorted({host for _, _, host, _ in self._records if host})

    def read(self) -> list[GpuSample]:
        now = time.time_ns()
        out = []
        while True:
            if self._next == len(self._records):
                if not self.loop:
                    break
                self._next = 0
                self._base_ns += self._period_ns
            offset, hw_id, host, values = self._records[self._next]
            t = self._base_ns + offset
            if t > now:
                break
            out.append(GpuSample(t, hw_id, values, host))
            self._next += 1
        return out

    def close(self) -> None:
        pass


__all__ = ["ReplaySource", "read_samples", "write_samples"]
