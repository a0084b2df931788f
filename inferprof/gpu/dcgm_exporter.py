"""GPU samples scraped from a dcgm-exporter ``/metrics`` endpoint.

dcgm-exporter (NVIDIA's Prometheus exporter for DCGM, usually a Kubernetes DaemonSet on
port 9400) serves one series per DCGM field and GPU, e.g.::

    DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-604ac76c-...",pci_bus_id="00000000:53:00.0",
        device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",
        DCGM_FI_DRIVER_VERSION="580.105.08"} 87

Each scrape becomes one :class:`GpuSample` per GPU (``UUID`` label -> ``hw.id``, host label
-> ``host.name``), with the fields of ``DCGM_FIELDS`` converted to the contract's units:

=================================  ==================================  ============
dcgm-exporter series               contract metric                     conversion
=================================  ==================================  ============
DCGM_FI_DEV_GPU_UTIL               hw.gpu.utilization                  % -> ratio
DCGM_FI_DEV_MEM_COPY_UTIL          inferprof.gpu.dcgm.mem_copy_util    % -> ratio
DCGM_FI_DEV_FB_USED                hw.gpu.memory.usage                 MiB -> By
FB_USED + FB_FREE (+ FB_RESERVED)  hw.gpu.memory.limit                 MiB -> By
usage / limit                      hw.gpu.memory.utilization           ratio
DCGM_FI_DEV_POWER_USAGE            hw.gpu.power.draw                   W
DCGM_FI_DEV_SM_CLOCK               hw.gpu.clock.graphics               MHz
DCGM_FI_DEV_GPU_TEMP               hw.gpu.temperature                  Cel
DCGM_FI_PROF_SM_ACTIVE             inferprof.gpu.dcgm.sm_active        ratio
DCGM_FI_PROF_SM_OCCUPANCY          inferprof.gpu.dcgm.sm_occupancy     ratio
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE    inferprof.gpu.dcgm.tensor_active    ratio
DCGM_FI_PROF_DRAM_ACTIVE           inferprof.gpu.dcgm.dram_active      ratio
=================================  ==================================  ============

Names, units and labels are those of dcgm-exporter up to 4.8 (``etc/default-counters.csv``
and ``etc/dcp-metrics-included.csv`` of NVIDIA/dcgm-exporter); 4.6.0-4.8.3 renamed the
``Hostname`` label to ``hostname`` (both are read). dcgm-exporter 4.9.0 renames 23 default
fields and changes units; ``fields=`` maps other series names. Blank values (DCGM's
sentinels for "no data", e.g. 9223372036854775794) and series of MIG instances (a
``GPU_I_ID`` label: their ``UUID`` is the parent GPU's, so they cannot be told apart by
``hw.id``) are skipped.

A scrape's samples are stamped with the time the response arrived (or the exposition's own
timestamps, when it has them). dcgm-exporter refreshes its values every
``--collect-interval`` (30 s by default): run it with ``-c 1000`` or less, or the samples
repeat one value for 30 s (docs/gpu.md).
"""

from __future__ import annotations

import logging
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from urllib.parse import urlsplit

from inferprof import semconv as sc
from inferprof._optional import require
from inferprof.gpu.records import METRICS, GpuSample

_logger = logging.getLogger(__name__)

DEFAULT_URL = "http://localhost:9400/metrics"
#: dcgm-exporter's values change at most once per its collect interval (1 s at the
#: shortest setting we recommend): scraping faster only repeats them.
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 5.0
#: Largest exposition read; a node with 8 GPUs and pod labels serves a few hundred KB.
MAX_BODY_BYTES = 32 * 1024 * 1024
_MIB = 1024.0 * 1024.0

#: dcgm-exporter series name -> (contract metric, factor to the contract's unit).
DCGM_FIELDS: Mapping[str, tuple[str, float]] = {
    "DCGM_FI_DEV_GPU_UTIL": (sc.METRIC_GPU_UTILIZATION, 0.01),
    "DCGM_FI_DEV_MEM_COPY_UTIL": (sc.METRIC_DCGM_MEM_COPY_UTIL, 0.01),
    "DCGM_FI_DEV_FB_USED": (sc.METRIC_GPU_MEMORY_USAGE, _MIB),
    "DCGM_FI_DEV_POWER_USAGE": (sc.METRIC_GPU_POWER_DRAW, 1.0),
    "DCGM_FI_DEV_SM_CLOCK": (sc.METRIC_GPU_CLOCK_GRAPHICS, 1.0),
    "DCGM_FI_DEV_GPU_TEMP": (sc.METRIC_GPU_TEMPERATURE, 1.0),
    "DCGM_FI_PROF_SM_ACTIVE": (sc.METRIC_DCGM_SM_ACTIVE, 1.0),
    "DCGM_FI_PROF_SM_OCCUPANCY": (sc.METRIC_DCGM_SM_OCCUPANCY, 1.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (sc.METRIC_DCGM_TENSOR_ACTIVE, 1.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": (sc.METRIC_DCGM_DRAM_ACTIVE, 1.0),
}
#: Framebuffer series the memory size is derived from (MiB).
_FB_FREE = "DCGM_FI_DEV_FB_FREE"
_FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
_FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
_FB_FIELDS = (_FB_FREE, _FB_RESERVED, _FB_TOTAL)

LABEL_UUID = "UUID"
LABEL_MODEL_NAME = "modelName"  # the GPU's model: the samples' hw.model
#: Host labels tried in order when no ``host_label`` is given (4.6.0-4.8.3 renamed it).
HOST_LABELS = ("Hostname", "hostname")
LABEL_MIG_INSTANCE = "GPU_I_ID"


def _blank(value: float) -> bool:
    """DCGM's "no value" sentinels: int64 and fp64 blanks are >= 2**47, int32 blanks are
    0x7ffffff0..0x7fffffff. No GPU figure of the contract comes near either."""
    return not math.isfinite(value) or value >= 2.0**47 or 0x7FFFFFF0 <= value <= 0x7FFFFFFF


def parse_exposition(
    text: str,
    *,
    now_ns: int,
    fields: Mapping[str, tuple[str, float]] = DCGM_FIELDS,
    host_label: str | None = None,
) -> list[GpuSample]:
    """GPU samples of one dcgm-exporter exposition (Prometheus text format).

    ``now_ns``: the time of the scrape, for series without their own timestamp.
    ``host_label``: the label that holds ``host.name`` (default: ``Hostname``, else
    ``hostname``); ``pod`` gives the name of the pod a GPU is assigned to when
    dcgm-exporter runs with Kubernetes pod mapping — the ``host.name`` of that pod's spans.
    A series without that label (a GPU no pod holds) falls back to ``Hostname``/``hostname``.
    """
    parser = require("prometheus_client.parser", "gpu")
    # (host, uuid) -> {series name: (value, timestamp ns)}; the first series of a GPU wins
    # (a GPU time-shared by several pods appears once per pod with the same value).
    gpus: dict[tuple[str | None, str], dict[str, tuple[float, int]]] = {}
    models: dict[str, str] = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if name not in fields and name not in _FB_FIELDS:
                continue
            labels = s.labels
            uuid = labels.get(LABEL_UUID)
            if not uuid or labels.get(LABEL_MIG_INSTANCE):
                continue
            value = float(s.value)
            if _blank(value):
                continue
            # The label asked for (``pod``: a GPU no pod holds has none), else the node's.
            host = (labels.get(host_label) if host_label is not None else None) or next(
                (labels[k] for k in HOST_LABELS if labels.get(k)), None)
            # exposition timestamps are whole milliseconds; the parser gives float seconds
            t = now_ns if s.timestamp is None else round(float(s.timestamp) * 1e3) * 1_000_000
            gpus.setdefault((host, uuid), {}).setdefault(name, (value, t))
            if labels.get(LABEL_MODEL_NAME):
                models[uuid] = labels[LABEL_MODEL_NAME]
    samples = []
    for (host, uuid), series in gpus.items():
        values: dict[str, float] = {}
        for name, (value, _) in series.items():
            mapped = fields.get(name)
            if mapped is not None:
                values[mapped[0]] = value * mapped[1]
        used = series.get("DCGM_FI_DEV_FB_USED")
        limit_mib = _limit_mib(series, used)
        if limit_mib is not None and sc.METRIC_GPU_MEMORY_LIMIT not in values:
            values[sc.METRIC_GPU_MEMORY_LIMIT] = limit_mib * _MIB
            if used is not None and limit_mib > 0:
                values[sc.METRIC_GPU_MEMORY_UTILIZATION] = used[0] / limit_mib
        if not values:
            continue
        t = max(ts for _, ts in series.values())
        samples.append(GpuSample(t, uuid, tuple(values.items()), host, models.get(uuid)))
    return samples


def _limit_mib(series: Mapping[str, tuple[float, int]], used: tuple[float, int] | None
               ) -> float | None:
    total = series.get(_FB_TOTAL)
    if total is not None:
        return total[0]
    free = series.get(_FB_FREE)
    if used is None or free is None:
        return None
    reserved = series.get(_FB_RESERVED)
    # With FB_RESERVED exported, FB_USED excludes the driver's reservation (DCGM >= 3).
    return used[0] + free[0] + (reserved[0] if reserved is not None else 0.0)


class DcgmExporterSource:
    """Scrapes ``url`` (a dcgm-exporter ``/metrics``) once per poll.

    ``fields`` extends or overrides ``DCGM_FIELDS`` (series name -> (contract metric,
    factor)); ``host_label`` names the label holding ``host.name`` (see
    :func:`parse_exposition`). An unreachable exporter fails the poll; the sampler logs,
    counts and retries it.
    """

    name = sc.GPU_SOURCE_DCGM_EXPORTER
    default_interval = DEFAULT_INTERVAL_S

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        fields: Mapping[str, tuple[str, float]] | None = None,
        host_label: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"dcgm-exporter URL must be http(s)://host:port/metrics, got {url!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        merged = dict(DCGM_FIELDS)
        for series, target in (fields or {}).items():
            metric, factor = target if isinstance(target, tuple) and len(target) == 2 else ("", "")
            if metric not in METRICS or not isinstance(factor, (int, float)):
                raise ValueError(
                    f"fields[{series!r}] must be (a contract GPU metric, a number), "
                    f"got {target!r}; metrics: {sorted(METRICS)}")
            merged[series] = (metric, float(factor))
        self.url = url
        self.fields: Mapping[str, tuple[str, float]] = merged
        self.host_label = host_label
        self.timeout_s = float(timeout_s)
        self._checked = False
        self._warned_empty = False

    def open(self) -> None:
        # Fail now, not on the first poll, when the parser is missing. The exporter itself
        # may not be up yet (a sidecar starting before the DaemonSet pod): not checked here.
        require("prometheus_client.parser", "gpu")

    def read(self) -> list[GpuSample]:
        """One scrape. A failure raises ``OSError`` (unreachable, HTTP error) or
        ``ValueError`` (not an exposition), its message naming the URL."""
        request = urllib.request.Request(
            self.url, headers={"Accept": "text/plain;version=0.0.4"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:  # before URLError, its base class
            raise OSError(f"scraping {self.url} failed: HTTP {exc.code} {exc.reason}") from None
        except urllib.error.URLError as exc:
            raise OSError(f"scraping {self.url} failed: {exc.reason}") from None
        except OSError as exc:  # a timeout or reset while reading the body
            raise OSError(f"scraping {self.url} failed: {exc}") from None
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"{self.url} served more than {MAX_BODY_BYTES} bytes")
        now = time.time_ns()
        text = body.decode("utf-8", errors="replace")
        try:
            samples = parse_exposition(text, now_ns=now, fields=self.fields,
                                       host_label=self.host_label)
        except ValueError as exc:
            raise ValueError(f"{self.url} served no Prometheus text exposition: {exc}") from None
        if not self._checked:
            self._check_once(text, samples)
        return samples

    def _check_once(self, text: str, samples: list[GpuSample]) -> None:
        """Say once what the exporter's configuration costs the verdict."""
        if not samples:
            if "DCGM_FI_" in text:
                self._checked = True
                _logger.warning(
                    "%s serves DCGM series but none inferprof maps (%s...): a dcgm-exporter "
                    ">= 4.9 renamed its fields; map them with fields= / --dcgm-field",
                    self.url, ", ".join(sorted(self.fields)[:3]))
            elif not self._warned_empty:
                # An empty page or another exporter's metrics (a wrong port, node-exporter):
                # said once; the checks above still run once GPU series appear.
                self._warned_empty = True
                _logger.warning(
                    "%s serves no DCGM series (%s): no GPU samples. Is it dcgm-exporter "
                    "(port 9400 by default), and does it see the GPUs?", self.url,
                    "an empty page" if not text.strip() else "other metrics only")
            return
        self._checked = True
        label = self.host_label
        if label is not None and not re.search(r'[{,]\s*' + re.escape(label) + r'="', text):
            _logger.warning(
                "%s: no series carries the host label %r (labels are case sensitive; with "
                "Kubernetes pod mapping only GPUs a pod holds have pod): GPUs without it "
                "keep the exporter's Hostname label, else this machine's name", self.url,
                label)
        seen = {name for s in samples for name, _ in s.values}
        missing = [m for m in (sc.METRIC_DCGM_SM_ACTIVE, sc.METRIC_DCGM_SM_OCCUPANCY)
                   if m not in seen]
        if missing:
            _logger.warning(
                "%s exports no DCGM_FI_PROF_SM_ACTIVE / DCGM_FI_PROF_SM_OCCUPANCY (they are "
                "not in dcgm-exporter's default counters): the verdict cannot say "
                "'hardware' without them; enable them in its collectors CSV (docs/gpu.md)",
                self.url)

    def close(self) -> None:
        pass


__all__ = ["DCGM_FIELDS", "DEFAULT_URL", "HOST_LABELS", "DcgmExporterSource", "parse_exposition"]
