"""The GPU sampler: polls a source, buffers its samples, ships them as OTLP metrics.

Two daemon threads. The *poller* reads the source every ``interval`` and appends the
readings to a bounded buffer; the *exporter* drains the buffer every ``export_interval`` in
exports of at most ``max_export_batch_size`` readings (``otlp.to_metrics_data``: one data
point per reading and metric, each with its own timestamp). Keeping them apart means an
export stuck against a dead endpoint (the OTLP exporter retries for up to
``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s by default) never delays a poll.

What it guarantees, so it can run inside a serving process:

* nothing it does raises into the application once started: failed polls and exports are
  logged (rate-limited) and counted (:class:`SamplerStats`);
* memory is bounded: at most ``max_queue_size`` readings wait for export; past that the
  oldest are dropped and counted (the newest are the ones the collector's windows want);
* ``stop(timeout)`` returns within ``timeout`` seconds (plus a fraction of one), whatever
  the endpoint does: an export still running then is abandoned (its daemon thread ends with
  the process) and its readings counted as dropped.

``start_sampler()`` is the forgiving entry point for serving processes: where the source
cannot run (no GPU, no driver, no nvidia-ml-py) it logs one warning and returns a
:class:`DisabledSampler`. ``GpuSampler(...).start()`` raises instead.

Settings flow keyword argument -> environment variable -> default, as in ``configure()``:
a bad argument raises ``ValueError``, a bad variable is logged and defaulted.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from inferprof import _config, _settings
from inferprof import environment_variables as ev
from inferprof import semconv as sc
from inferprof.gpu import otlp
from inferprof.gpu.records import GpuSample, RateLimitedLog, SamplerStats, Source, SourceUnavailable
from inferprof.instrumentation import active
from inferprof.instrumentation.config import DEFAULT_MODE, Config

_logger = logging.getLogger(__name__)

ENV_SOURCE = ev.INFERPROF_GPU_SOURCE
ENV_INTERVAL = ev.INFERPROF_GPU_INTERVAL
ENV_EXPORT_INTERVAL = ev.INFERPROF_GPU_EXPORT_INTERVAL
ENV_DCGM_URL = ev.INFERPROF_GPU_DCGM_URL
ENV_REPLAY = ev.INFERPROF_GPU_REPLAY
ENV_HOST_NAME = ev.INFERPROF_GPU_HOST_NAME
ENV_MAX_QUEUE_SIZE = ev.INFERPROF_GPU_MAX_QUEUE_SIZE

_DEFAULT_SOURCE = sc.GPU_SOURCE_NVML
#: Export once a second: the collector folds requests about two seconds after they end
#: (``settle_s``), so samples a second old are in time, and one export a second is cheap.
_DEFAULT_EXPORT_INTERVAL_S = 1.0
#: About 0.9 KB per reading (tracemalloc, the eight NVML metrics): 8192 readings cap the
#: buffer near 7 MB; one GPU polled at 10 Hz fills it in 13 minutes of exporter outage,
#: eight GPUs in 100 s.
_DEFAULT_MAX_QUEUE_SIZE = 8192
#: At most ~12 data points per reading: 1024 readings make an export of about 1 MB, under
#: gRPC's 4 MB message limit and the collector's 16 MiB body limit.
_DEFAULT_MAX_EXPORT_BATCH_SIZE = 1024
_DEFAULT_SERVICE_NAME = "inferprof-gpu-sampler"
_DEFAULT_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SamplerSettings:
    """What a sampler settled on (after arguments, environment and defaults)."""

    source: str
    interval: float
    export_interval: float
    max_queue_size: int
    max_export_batch_size: int
    #: ``host.name`` of readings whose source does not name a host (and of all readings
    #: when ``host_override``)
    host_name: str
    #: True when ``host_name`` was given (argument or INFERPROF_GPU_HOST_NAME): it then
    #: replaces the host a source reports (dcgm-exporter's label, a recording's host)
    host_override: bool
    service_name: str
    protocol: str
    #: the URL the OTLP exporter sends to (its default for ``protocol`` when none is
    #: configured); None with a custom ``exporter=``
    endpoint: str | None


def resolve_source(
    source: str | Source | None,
    *,
    dcgm_url: str | None = None,
    replay: str | os.PathLike[str] | None = None,
) -> Source:
    """A source object from a name (argument -> ``INFERPROF_GPU_SOURCE`` -> ``nvml``).
    ``dcgm_url`` (-> ``INFERPROF_GPU_DCGM_URL`` -> ``http://localhost:9400/metrics``) and
    ``replay`` (-> ``INFERPROF_GPU_REPLAY``, required) configure the named source."""
    if source is not None and not isinstance(source, str):
        if not isinstance(source, Source):
            raise TypeError(f"source must be one of {sc.GPU_SOURCES} or a Source, got {source!r}")
        name = None
    else:
        name = _settings.choice(source, ENV_SOURCE, sc.GPU_SOURCES, _DEFAULT_SOURCE, "source")
    # As the CLI: an option of another source is a mistake, not something to ignore.
    if dcgm_url is not None and name != sc.GPU_SOURCE_DCGM_EXPORTER:
        raise ValueError(f"dcgm_url applies to the {sc.GPU_SOURCE_DCGM_EXPORTER!r} source only, "
                         f"not {name or source!r}")
    if replay is not None and name != sc.GPU_SOURCE_REPLAY:
        raise ValueError(f"replay applies to the {sc.GPU_SOURCE_REPLAY!r} source only, "
                         f"not {name or source!r}")
    if name is None:
        assert isinstance(source, Source)
        return source
    if name == sc.GPU_SOURCE_NVML:
        from inferprof.gpu.nvml import NvmlSource

        return NvmlSource()
    if name == sc.GPU_SOURCE_DCGM_EXPORTER:
        from inferprof.gpu.dcgm_exporter import DEFAULT_URL, DcgmExporterSource

        return DcgmExporterSource(dcgm_url or _settings.env(ENV_DCGM_URL) or DEFAULT_URL)
    if name == sc.GPU_SOURCE_REPLAY:
        from inferprof.gpu.replay import ReplaySource

        path = replay if replay is not None else _settings.env(ENV_REPLAY)
        if path is None:
            raise ValueError(f"the replay source needs a recording: replay= or {ENV_REPLAY}")
        return ReplaySource(path)
    from inferprof.gpu.synthetic import SyntheticSource

    return SyntheticSource()


class GpuSampler:
    """Polls ``source`` and ships its samples as OTLP metrics (see the module docstring).

    ``exporter``: any OpenTelemetry ``MetricExporter`` (default: the OTLP one resolved like
    ``configure()``'s, see ``otlp.metric_exporter``). ``host_name``: the ``host.name`` of the
    samples, which must equal the one on the service's spans (default: this process's,
    as ``configure()`` sets it).
    """

    def __init__(
        self,
        source: Source,
        *,
        interval: float | None = None,
        export_interval: float | None = None,
        endpoint: str | None = None,
        protocol: str | None = None,
        host_name: str | None = None,
        service_name: str | None = None,
        max_queue_size: int | None = None,
        max_export_batch_size: int | None = None,
        exporter: Any = None,
    ) -> None:
        if not isinstance(source, Source):
            raise TypeError(f"source must be a Source (open/read/close), got {source!r}")
        if host_name is not None and (not isinstance(host_name, str) or not host_name):
            raise ValueError(f"host_name must be a non-empty string, got {host_name!r}")
        if service_name is not None and (not isinstance(service_name, str) or not service_name):
            raise ValueError(f"service_name must be a non-empty string, got {service_name!r}")
        if exporter is not None and not hasattr(exporter, "export"):
            raise TypeError(f"exporter must be a MetricExporter, got {exporter!r}")
        self.source = source
        host = host_name or _settings.env(ENV_HOST_NAME)
        configured = active.current_config()
        service = (service_name or (configured.service_name if configured else None)
                   or _settings.env(ev.OTEL_SERVICE_NAME) or _DEFAULT_SERVICE_NAME)
        if exporter is None:
            # The exporter itself is built in start(), once the source has opened: a
            # sampler that cannot run opens no connection.
            self._config: Config | None = otlp.metrics_config(endpoint, protocol)
            protocol_used, url = otlp.metrics_target(self._config)
        else:
            self._config = None
            protocol_used, url = "custom", None
        if max_export_batch_size is not None and (
                isinstance(max_export_batch_size, bool)
                or not isinstance(max_export_batch_size, int)
                or max_export_batch_size < 1):
            raise ValueError(
                f"max_export_batch_size must be a positive int, got {max_export_batch_size!r}")
        self.settings = SamplerSettings(
            source=source.name,
            interval=_settings.positive_seconds(interval, ENV_INTERVAL, source.default_interval,
                                                "interval"),
            export_interval=_settings.positive_seconds(export_interval, ENV_EXPORT_INTERVAL,
                                            _DEFAULT_EXPORT_INTERVAL_S, "export_interval"),
            max_queue_size=_settings.positive_int(max_queue_size, ENV_MAX_QUEUE_SIZE,
                                                 _DEFAULT_MAX_QUEUE_SIZE, "max_queue_size"),
            max_export_batch_size=max_export_batch_size or _DEFAULT_MAX_EXPORT_BATCH_SIZE,
            host_name=host or otlp.service_host_name(),
            host_override=host is not None,
            service_name=service,
            protocol=protocol_used,
            endpoint=url,
        )
        self._exporter: Any = exporter
        self._resource = otlp.sampler_resource(source.name, self.settings.host_name, service)
        self._buffer: deque[GpuSample] = deque()
        self._lock = threading.Lock()
        self._export_lock = threading.Lock()
        self._stats = SamplerStats()
        self._stopping = threading.Event()
        self._exhausted = threading.Event()
        self._poller: threading.Thread | None = None
        self._export_thread: threading.Thread | None = None
        self._poll_log = RateLimitedLog(_logger, f"GPU source {source.name}")
        self._export_log = RateLimitedLog(_logger, "GPU sample export")
        self._started = False
        self._stopped = False

    # --- lifecycle ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._started and not self._stopped

    @property
    def exhausted(self) -> bool:
        """True once the source said it has nothing more to give (a recording played
        without looping) and polling ended; what it gave is still exported by ``stop()``."""
        return self._exhausted.is_set()

    def start(self) -> GpuSampler:
        """Open the source (raising :class:`SourceUnavailable` / ``ImportError`` /
        ``ValueError`` if it cannot work) and start the threads. Returns ``self``."""
        if self._started:
            raise RuntimeError("this sampler was already started")
        self.source.open()
        if self._exporter is None:
            try:
                assert self._config is not None
                self._exporter = otlp.metric_exporter(self._config)
            except BaseException:
                self.source.close()
                raise
        self._started = True
        if self.source.name in (sc.GPU_SOURCE_REPLAY, sc.GPU_SOURCE_SYNTHETIC):
            _logger.warning("GPU sampler: %s samples, NOT live GPU data (resource attribute "
                            "%s=%s)", self.source.name, sc.RESOURCE_GPU_SOURCE, self.source.name)
        self._poller = threading.Thread(target=self._poll_loop, name="inferprof-gpu-poll",
                                        daemon=True)
        self._export_thread = threading.Thread(target=self._export_loop,
                                               name="inferprof-gpu-export", daemon=True)
        self._poller.start()
        self._export_thread.start()
        _register_atexit(self)
        return self

    def stop(self, timeout: float = _DEFAULT_STOP_TIMEOUT_S) -> None:
        """Stop polling, export what is buffered, shut the exporter down; never raises and
        returns within ``timeout`` seconds (plus up to half a second to abort an export)."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + max(0.0, timeout)
        self._stopping.set()
        try:
            for thread in (self._poller, self._export_thread):
                if thread is not None:
                    thread.join(max(0.0, deadline - time.monotonic()))
            stuck = self._export_thread is not None and self._export_thread.is_alive()
            try:
                # Aborts an export retrying against a dead endpoint (the SDK's exporters
                # interrupt their back-off and close the channel).
                self._exporter.shutdown(timeout_millis=500)
            except Exception:
                _logger.debug("exporter shutdown failed", exc_info=True)
            if stuck and self._export_thread is not None:
                self._export_thread.join(0.5)
            with self._lock:
                left = len(self._buffer)
                self._buffer.clear()
                if left:
                    self._stats = replace(self._stats, dropped_export_failed=(
                        self._stats.dropped_export_failed + left))
            if stuck or left:
                _logger.warning("GPU sampler stopped before its exports finished (%s); %d "
                                "buffered readings dropped", "one still running: its "
                                "readings count as dropped (export failed) when it fails"
                                if stuck else "timeout", left)
        except Exception:  # telemetry never raises into the application
            _logger.exception("stopping the GPU sampler failed")
        finally:
            # The poller closes the source when it ends (a poll stuck in the driver closes
            # it when it returns).
            _unregister_atexit(self)

    def read_once(self) -> list[GpuSample]:
        """Open the source, take one reading and close it, without starting or exporting
        anything (``inferprof gpu --once``). Each reading's ``host`` is the ``host.name`` it
        would be exported with. Raises what :meth:`start` raises where the source cannot
        open, and ``RuntimeError`` naming the source where the reading fails."""
        self.source.open()
        try:
            # NVML's GPM figures need a first interval (the source says how long)
            time.sleep(getattr(self.source, "first_read_delay_s", 0.0))
            samples = self.source.read()
        except Exception as exc:
            raise RuntimeError(f"reading the {self.source.name} source failed: {exc}") from exc
        finally:
            try:
                self.source.close()
            except Exception:
                _logger.debug("closing the GPU source failed", exc_info=True)
        host, override = self.settings.host_name, self.settings.host_override
        return [replace(s, host=host) if s.host is None or (override and s.host != host) else s
                for s in samples]

    def flush(self, timeout: float = 10.0) -> bool:
        """Export everything buffered now, from the calling thread; True when it all went
        out. Waits at most ``timeout`` for an export already running."""
        if not self._export_lock.acquire(timeout=max(0.0, timeout)):
            return False
        try:
            return self._export_buffered()
        finally:
            self._export_lock.release()

    def stats(self) -> SamplerStats:
        with self._lock:
            return replace(self._stats, buffered=len(self._buffer))

    # --- threads --------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        interval = self.settings.interval
        next_at = time.monotonic()
        while not self._stopping.is_set():
            self._poll_once()
            if getattr(self.source, "exhausted", False):
                _logger.info("GPU source %s has nothing more to give: polling ended",
                             self.source.name)
                self._exhausted.set()
                break
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:  # a slow poll: skip the ticks it overran instead of bursting
                next_at = time.monotonic()
                delay = 0.0
            if self._stopping.wait(delay):
                break
        try:
            self.source.close()
        except Exception:
            _logger.debug("closing the GPU source failed", exc_info=True)

    def _poll_once(self) -> None:
        try:
            samples = self.source.read()
        except Exception as exc:
            with self._lock:
                self._stats = replace(self._stats, polls=self._stats.polls + 1,
                                      poll_errors=self._stats.poll_errors + 1)
            self._poll_log.failure("GPU source %s: poll failed: %s", self.source.name, exc)
            return
        self._poll_log.success()
        if self.settings.host_override:
            host = self.settings.host_name
            samples = [s if s.host in (None, host) else replace(s, host=host) for s in samples]
        cap = self.settings.max_queue_size
        with self._lock:
            self._buffer.extend(samples)
            dropped = max(0, len(self._buffer) - cap)
            for _ in range(dropped):  # the oldest go: the newest are the ones still wanted
                self._buffer.popleft()
            self._stats = replace(self._stats, polls=self._stats.polls + 1,
                                  samples=self._stats.samples + len(samples),
                                  dropped_buffer_full=self._stats.dropped_buffer_full + dropped)
        if dropped:
            self._export_log.failure("GPU sample buffer full (%d readings): dropping the oldest; "
                                     "is the OTLP endpoint up?", cap)

    def _export_loop(self) -> None:
        while not self._stopping.wait(self.settings.export_interval):
            with self._export_lock:
                self._export_buffered()
        # The readings polled since the last export, including those of a poll still
        # running when stop() was called (waited for briefly: a poll stuck in the driver
        # must not hold back the final export).
        if self._poller is not None:
            self._poller.join(0.5)
        with self._export_lock:
            self._export_buffered()

    def _export_buffered(self) -> bool:
        """Drain the buffer in batches; False if an export failed. Call with the export
        lock held."""
        ok = True
        while True:
            with self._lock:
                n = min(len(self._buffer), self.settings.max_export_batch_size)
                batch = [self._buffer.popleft() for _ in range(n)]
            if not batch:
                return ok
            ok = self._export(batch) and ok

    def _export(self, batch: list[GpuSample]) -> bool:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        points = sum(len(s.values) for s in batch)
        try:
            result = self._exporter.export(otlp.to_metrics_data(batch, self._resource),
                                           timeout_millis=10_000)
            failed = result is not MetricExportResult.SUCCESS
            reason = "the exporter reported a failure"
        except Exception as exc:
            failed, reason = True, f"{type(exc).__name__}: {exc}"
        with self._lock:
            s = self._stats
            if failed:
                self._stats = replace(s, export_failures=s.export_failures + 1,
                                      dropped_export_failed=s.dropped_export_failed + len(batch))
            else:
                self._stats = replace(s, exported_samples=s.exported_samples + len(batch),
                                      exported_points=s.exported_points + points)
        if failed:
            self._export_log.failure("GPU samples: export of %d readings to %s failed (%s); "
                                     "dropped", len(batch), self.settings.endpoint or "the "
                                     "exporter", reason)
        else:
            self._export_log.success()
        return not failed


class DisabledSampler:
    """What ``start_sampler()`` returns where GPU sampling cannot run: does nothing.

    ``reason`` says why, in the words of the line that was logged (``"GPU sampling
    disabled: ..."`` or ``"GPU sampling is off: ..."``). ``stop()`` does nothing,
    ``flush()`` returns True (nothing is left unexported), ``stats()`` is all zeros and
    ``running`` / ``exhausted`` are False, so code written for a :class:`GpuSampler` runs
    unchanged.
    """

    running = False
    exhausted = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"DisabledSampler(reason={self.reason!r})"

    def stop(self, timeout: float = _DEFAULT_STOP_TIMEOUT_S) -> None:
        pass

    def flush(self, timeout: float = 10.0) -> bool:
        """Nothing to export: True."""
        return True

    def stats(self) -> SamplerStats:
        return SamplerStats()


def start_sampler(
    source: str | Source | None = None,
    *,
    interval: float | None = None,
    export_interval: float | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    dcgm_url: str | None = None,
    replay: str | os.PathLike[str] | None = None,
    host_name: str | None = None,
    service_name: str | None = None,
    max_queue_size: int | None = None,
    exporter: Any = None,
) -> GpuSampler | DisabledSampler:
    """Start sampling GPUs in this process, next to ``inferprof.configure()``.

    ``source``: ``"nvml"`` (default), ``"dcgm-exporter"``, ``"replay"``, ``"synthetic"`` or
    a :class:`Source`. Samples go where ``configure()`` sends metrics (or to ``endpoint`` /
    ``protocol``, or the ``OTEL_EXPORTER_OTLP_*`` variables), with this process's
    ``host.name``. Bad arguments (a malformed recording, a GPU that is not there) raise
    ``ValueError``; a source that cannot run here (no GPU, no driver, nvidia-ml-py missing)
    logs one warning and returns a :class:`DisabledSampler`: the service keeps running. So
    does ``INFERPROF_MODE=off`` / ``OTEL_SDK_DISABLED=true`` (logged at INFO). Stop the
    sampler with ``.stop()``; it is stopped at interpreter exit otherwise.
    """
    mode = _settings.choice(None, ev.INFERPROF_MODE, sc.MODES, DEFAULT_MODE, "mode")
    configured = active.current_config()
    if (configured is not None and not configured.enabled) or (configured is None and (
            mode == sc.MODE_OFF or _settings.flag(None, ev.OTEL_SDK_DISABLED, False))):
        reason = "GPU sampling is off: inferprof is disabled in this process"
        _logger.info("%s", reason)
        return DisabledSampler(reason)
    src = resolve_source(source, dcgm_url=dcgm_url, replay=replay)
    sampler = GpuSampler(src, interval=interval, export_interval=export_interval,
                         endpoint=endpoint, protocol=protocol, host_name=host_name,
                         service_name=service_name, max_queue_size=max_queue_size,
                         exporter=exporter)
    try:
        return sampler.start()
    except (SourceUnavailable, ImportError) as exc:
        reason = f"GPU sampling disabled: {exc}"
    except (ValueError, TypeError):
        raise
    except Exception as exc:
        reason = f"GPU sampling disabled: the {src.name} source failed to start: {exc!r}"
    _logger.warning("%s", reason)
    return DisabledSampler(reason)


# --- interpreter exit -----------------------------------------------------------------------
# A weak registry, not one atexit handler per sampler: stopped samplers must not be kept alive.
_live: weakref.WeakSet[GpuSampler] = weakref.WeakSet()
_atexit_lock = threading.Lock()
_atexit_registered = False


def _register_atexit(sampler: GpuSampler) -> None:
    global _atexit_registered
    with _atexit_lock:
        _live.add(sampler)
        if not _atexit_registered:
            atexit.register(_stop_all)
            _config.add_shutdown_hook(_stop_all)  # inferprof.shutdown() stops them first
            _atexit_registered = True


def _unregister_atexit(sampler: GpuSampler) -> None:
    with _atexit_lock:
        _live.discard(sampler)


def _stop_all(timeout: float = 2.0) -> None:
    """Stop every running sampler, all within ``timeout`` seconds (plus up to half a second
    to abort an export each): at exit, and from ``inferprof.shutdown()``."""
    deadline = time.monotonic() + timeout
    for sampler in list(_live):
        sampler.stop(timeout=max(0.0, deadline - time.monotonic()))


__all__ = [
    "DisabledSampler",
    "GpuSampler",
    "SamplerSettings",
    "resolve_source",
    "start_sampler",
]
