"""inferprof's batch span processor: a bounded queue and one export thread.

The shape of the OpenTelemetry SDK's ``BatchSpanProcessor``: ``on_end`` appends to a
bounded deque and never blocks; a worker thread wakes every ``schedule_delay`` (or when a
batch is ready) and hands the exporter up to ``max_export_batch_size`` entries at a time;
a forked child starts with an empty queue and a thread of its own. Kept apart from the
SDK's because inferprof needs what it keeps private:

* an entry may be a whole kept trace (``accounting.DeferredTrace``/``EncodedTrace``)
  rather than one span, and a full queue drops its oldest entry *counted in spans*
  (``Stats.queue_full``), with one warning per ``_DROP_WARNING_INTERVAL_S`` instead of
  the SDK's log line per dropped span;
* ``shutdown(timeout_millis)`` keeps to its timeout (a service being stopped must not
  wait out the exporter's retries against a dead endpoint).

Every span the runtime hands in is counted exactly once: exported, dropped because the
queue was full, dropped because its export failed (the counting exporter), or still
queued when ``shutdown``'s timeout passed.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor

from inferprof import _settings
from inferprof import environment_variables as ev
from inferprof.instrumentation._otel_compat import suppressed_instrumentation
from inferprof.instrumentation.accounting import TRACE_ENTRIES, Stats

_logger = logging.getLogger("inferprof.instrumentation.accounting")

_DEFAULT_MAX_QUEUE_SIZE = 2048
#: Span export every second (the SDK's default is 5 s) unless OTEL_BSP_SCHEDULE_DELAY says
#: otherwise: the export thread shares the service's CPU, and five seconds of kept traces
#: built and sent in one go held requests up long enough to show in the p99
#: (docs/instrumenting.md, "Export cadence").
_DEFAULT_SCHEDULE_DELAY_MS = 1000
_DEFAULT_MAX_EXPORT_BATCH_SIZE = 512
_DEFAULT_EXPORT_TIMEOUT_MS = 30000
#: Seconds between two "export queue full" warnings.
_DROP_WARNING_INTERVAL_S = 10.0


def _env_int(name: str, default: int) -> int:
    """An ``OTEL_BSP_*`` value: a positive integer, else logged and ``default``."""
    raw = _settings.env(name)
    if raw is None:
        return default
    try:
        if int(raw) > 0:
            return int(raw)
    except ValueError:
        pass
    _logger.warning("ignoring %s=%r: not a positive integer (milliseconds or entries); "
                    "using %d", name, raw, default)
    return default


class BatchSpanProcessor(SpanProcessor):
    """Queue ended spans and kept traces; export them in batches from a thread of its own."""

    def __init__(
        self,
        exporter: Any,
        stats: Stats,
        *,
        max_queue_size: int | None = None,
        schedule_delay_millis: float | None = None,
        max_export_batch_size: int | None = None,
        export_timeout_millis: float | None = None,
    ) -> None:
        if max_queue_size is None:
            max_queue_size = _env_int(ev.OTEL_BSP_MAX_QUEUE_SIZE, _DEFAULT_MAX_QUEUE_SIZE)
        if schedule_delay_millis is None:
            schedule_delay_millis = _env_int(ev.OTEL_BSP_SCHEDULE_DELAY, _DEFAULT_SCHEDULE_DELAY_MS)
        if max_export_batch_size is None:
            max_export_batch_size = _env_int(
                ev.OTEL_BSP_MAX_EXPORT_BATCH_SIZE, _DEFAULT_MAX_EXPORT_BATCH_SIZE)
        if export_timeout_millis is None:
            export_timeout_millis = _env_int(ev.OTEL_BSP_EXPORT_TIMEOUT, _DEFAULT_EXPORT_TIMEOUT_MS)
        _validate(max_queue_size, schedule_delay_millis, max_export_batch_size)
        self._exporter = exporter
        self._stats = stats
        self.max_queue_size = max_queue_size
        self.max_export_batch_size = max_export_batch_size
        self.export_timeout_millis = export_timeout_millis
        self._delay_s = schedule_delay_millis / 1000
        if hasattr(exporter, "max_batch"):  # spans per export call (deferred traces built)
            exporter.max_batch = max_export_batch_size
        #: whether the exporter takes encoded bytes (then traces are encoded at request end)
        self.accepts_encoded = bool(getattr(exporter, "accepts_encoded", False))
        # Newest entries on the left: a full deque drops its oldest, on the right.
        self.queue: collections.deque[Any] = collections.deque(maxlen=max_queue_size)
        self._queue_lock = threading.Lock()
        self._shut_down = False
        self._give_up = False  # shutdown's timeout passed: export nothing more
        self._next_warning = 0.0
        self._start_worker()
        if hasattr(os, "register_at_fork"):
            weak = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := weak()) and m())

    def _start_worker(self) -> None:
        self._pid = os.getpid()
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self._worker = threading.Thread(
            target=self._work, name="inferprof-span-export", daemon=True)
        self._worker.start()

    def _after_fork(self) -> None:
        # The parent's queue is the parent's to send; the child's thread did not survive.
        self._queue_lock = threading.Lock()
        self.queue.clear()
        self._start_worker()

    # --- the request side -------------------------------------------------------------
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        """Queue ``span`` (or a kept trace); never blocks. A full queue drops its oldest
        entry, counted in spans."""
        if type(span) not in TRACE_ENTRIES and not (
            span.context and span.context.trace_flags.sampled
        ):
            return
        if self._shut_down:
            return
        if self._pid != os.getpid():
            self._after_fork()
        queue = self.queue
        # One step against the other producers and the export thread: the entry counted
        # as dropped is the one that falls off.
        with self._queue_lock:
            if len(queue) >= self.max_queue_size:
                self._count_drop()
            queue.appendleft(span)
        if len(queue) >= self.max_export_batch_size and not self._wake.is_set():
            self._wake.set()

    def _count_drop(self) -> None:
        oldest = self.queue[-1]
        self._stats.queue_full += oldest.n if type(oldest) in TRACE_ENTRIES else 1
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + _DROP_WARNING_INTERVAL_S
            _logger.warning(
                "inferprof's span export queue is full (the exporter is slow or down): "
                "%d spans dropped so far, counted in inferprof.spans.dropped",
                self._stats.queue_full,
            )

    # --- the export thread ------------------------------------------------------------
    def _work(self) -> None:
        while not self._shut_down:
            woken = self._wake.wait(self._delay_s)
            if self._shut_down:
                break
            # Woken: a batch is ready, export while full batches wait; else the delay
            # passed, export at least one batch.
            self._export(all_=False, at_least_one=not woken)
            self._wake.clear()
        self._export(all_=True)

    def _export(self, *, all_: bool, at_least_one: bool = False,
                deadline: float | None = None) -> None:
        with self._export_lock:
            first = True
            while self.queue and not self._give_up:
                if not (all_ or len(self.queue) >= self.max_export_batch_size
                        or (at_least_one and first)):
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
                first = False
                batch = self._take(self.max_export_batch_size)
                if not batch:
                    return
                try:
                    with suppressed_instrumentation():
                        self._exporter.export(batch)
                except Exception:  # telemetry never raises; counted by the exporter
                    _logger.exception("inferprof's span export failed")

    def _take(self, most: int) -> list[Any]:
        """Up to ``most`` entries, oldest first (``shutdown`` may be emptying the queue)."""
        queue = self.queue
        with self._queue_lock:
            return [queue.pop() for _ in range(min(most, len(queue)))]

    # --- lifecycle --------------------------------------------------------------------
    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what waits, within ``timeout_millis``; False when some is left."""
        if self._shut_down:
            return False
        self._export(all_=True, deadline=time.monotonic() + timeout_millis / 1000)
        return not self.queue

    def shutdown(self, timeout_millis: float | None = None) -> None:
        """Export what waits and stop, within ``timeout_millis`` (default
        ``OTEL_BSP_EXPORT_TIMEOUT``); what is not exported by then is dropped."""
        if self._shut_down:
            return
        if timeout_millis is None:
            timeout_millis = self.export_timeout_millis
        deadline = time.monotonic() + timeout_millis / 1000
        self._shut_down = True
        self._wake.set()
        self._worker.join(max(0.0, deadline - time.monotonic()))
        self._give_up = True  # the worker, if still in an export, sends nothing more
        self._drop_unsent()
        try:
            self._exporter.shutdown()
        except Exception:
            _logger.exception("inferprof's span exporter failed to shut down")


    def _drop_unsent(self) -> None:
        """Count what shutdown's timeout left unexported (``Stats.shutdown``). Each entry
        is popped, so it is counted once: here, or by the exporter if the thread took it."""
        left = self._take(len(self.queue) + 1)
        if left:
            n = sum(e.n if type(e) in TRACE_ENTRIES else 1 for e in left)
            with self._stats._lock:
                self._stats.shutdown += n
            _logger.warning("inferprof shut down with %d spans not exported in time", n)


def _validate(max_queue_size: int, schedule_delay_millis: float,
              max_export_batch_size: int) -> None:
    if max_queue_size <= 0:
        raise ValueError("max_queue_size must be a positive integer.")
    if schedule_delay_millis <= 0:
        raise ValueError("schedule_delay_millis must be positive.")
    if max_export_batch_size <= 0:
        raise ValueError("max_export_batch_size must be a positive integer.")
    if max_export_batch_size > max_queue_size:
        raise ValueError("max_export_batch_size must be less than or equal to max_queue_size.")


__all__ = ["BatchSpanProcessor"]
