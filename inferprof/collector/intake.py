"""The path every received export request takes: the engine, forwarding, self-metrics.

Both receivers (``grpc_server``, ``http_server``) hand what they decode to an
:class:`Intake`; ``app`` builds one and the receivers around it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from inferprof import semconv
from inferprof._optional import require

_log = logging.getLogger("inferprof.collector.app")

_BODY_SIZE_BUCKETS = (1e3, 1e4, 1e5, 1e6, 4e6, 16e6, 64e6)


class TransportMetrics:
    """The transport's self-metrics, registered in the app's registry."""

    def __init__(self, registry: Any) -> None:
        prom = require("prometheus_client", "collector")
        self.requests = prom.Counter(
            semconv.PROM_OTLP_REQUESTS,
            "OTLP export requests received, by transport, signal and outcome.",
            [semconv.PROM_LABEL_TRANSPORT, semconv.PROM_LABEL_SIGNAL, semconv.PROM_LABEL_OUTCOME],
            registry=registry,
        )
        self.body_bytes = prom.Histogram(
            semconv.PROM_OTLP_REQUEST_BYTES,
            "Size of OTLP export request bodies as received (compressed), in bytes.",
            [semconv.PROM_LABEL_TRANSPORT, semconv.PROM_LABEL_SIGNAL],
            buckets=_BODY_SIZE_BUCKETS,
            registry=registry,
        )
        self.decode_errors = prom.Counter(
            semconv.PROM_OTLP_DECODE_ERRORS,
            "OTLP export requests whose body could not be decoded.",
            [semconv.PROM_LABEL_TRANSPORT, semconv.PROM_LABEL_REASON],
            registry=registry,
        )
        self.in_flight = prom.Gauge(
            semconv.PROM_OTLP_IN_FLIGHT,
            "OTLP export requests being read, decoded or ingested now.",
            [semconv.PROM_LABEL_TRANSPORT],
            registry=registry,
        )
        self.forward_sent = prom.Counter(
            semconv.PROM_FORWARD_SENT,
            "Export requests forwarded downstream.",
            [semconv.PROM_LABEL_DESTINATION, semconv.PROM_LABEL_SIGNAL],
            registry=registry,
        )
        self.forward_dropped = prom.Counter(
            semconv.PROM_FORWARD_DROPPED,
            "Export requests not forwarded (queue full, send failed, shutdown).",
            [semconv.PROM_LABEL_DESTINATION, semconv.PROM_LABEL_REASON],
            registry=registry,
        )
        self.forward_queue = prom.Gauge(
            semconv.PROM_FORWARD_QUEUE_LENGTH,
            "Export requests waiting to be forwarded.",
            [semconv.PROM_LABEL_DESTINATION],
            registry=registry,
        )
        self.forward_queue_bytes = prom.Gauge(
            semconv.PROM_FORWARD_QUEUE_BYTES,
            "Bytes of the export requests waiting to be forwarded.",
            [semconv.PROM_LABEL_DESTINATION],
            registry=registry,
        )
        # The series the alert rules watch exist from the start, at 0: the first overload
        # is then an increase that rate() sees (a series born at 1 shows none).
        for transport in (semconv.TRANSPORT_GRPC, semconv.TRANSPORT_HTTP):
            for signal in (semconv.SIGNAL_TRACES, semconv.SIGNAL_METRICS, semconv.SIGNAL_LOGS):
                self.requests.labels(transport, signal, semconv.OUTCOME_OVERLOADED)

    # Metrics must never fail a request: every update is guarded.
    def request(self, transport: str, signal: str, outcome: str) -> None:
        _guard(lambda: self.requests.labels(transport, signal, outcome).inc())

    def observe_body(self, transport: str, signal: str, size: int) -> None:
        _guard(lambda: self.body_bytes.labels(transport, signal).observe(size))

    def decode_error(self, transport: str, reason: str) -> None:
        _guard(lambda: self.decode_errors.labels(transport, reason).inc())

    def enter(self, transport: str) -> None:
        _guard(lambda: self.in_flight.labels(transport).inc())

    def leave(self, transport: str) -> None:
        _guard(lambda: self.in_flight.labels(transport).dec())

    def sent(self, destination: str, signal: str) -> None:
        _guard(lambda: self.forward_sent.labels(destination, signal).inc())

    def dropped(self, destination: str, reason: str, n: int) -> None:
        _guard(lambda: self.forward_dropped.labels(destination, reason).inc(n))


def _guard(fn: Any) -> None:
    try:
        fn()
    except Exception:  # pragma: no cover - prometheus_client does not fail in practice
        _log.debug("self-metric update failed", exc_info=True)


@dataclass(frozen=True)
class IngestOutcome:
    """What happened to one export request, for the receiver to answer with."""

    accepted: int = 0
    rejected: int = 0
    error_message: str = ""
    overloaded: bool = False
    failed: bool = False


class Intake:
    """The path every received request takes: engine, forwarding, self-metrics."""

    def __init__(
        self, engine: Any, metrics: TransportMetrics, forwarders: Any, retry_after_s: float
    ) -> None:
        from inferprof.collector.engine import Overloaded

        self._engine = engine
        self._overloaded = Overloaded
        self.metrics = metrics
        self._forwarders = forwarders
        self.retry_after_s = retry_after_s

    def ingest(
        self, transport: str, signal: str, message: Message, payload: bytes | None,
        peer: str | None = None,
    ) -> IngestOutcome:
        """``peer``: the client's address (no port), naming the sender of an export that
        holds several resources when the cap is shared out (admission.py)."""
        try:
            if signal == semconv.SIGNAL_TRACES:
                result = self._engine.ingest_traces(message, peer, payload)
            elif signal == semconv.SIGNAL_METRICS:
                result = self._engine.ingest_metrics(message)
            else:  # logs carry nothing inferprof folds: received only to be forwarded
                result = None
        except self._overloaded as exc:
            self.metrics.request(transport, signal, semconv.OUTCOME_OVERLOADED)
            return IngestOutcome(
                overloaded=True, error_message=str(exc) or "collector overloaded; retry later"
            )
        except Exception:  # an engine bug must not take the receiver down
            _log.exception("engine failed to ingest an OTLP %s request", signal)
            self.metrics.request(transport, signal, semconv.OUTCOME_ERROR)
            return IngestOutcome(failed=True, error_message="internal error while ingesting")
        if self._forwarders:
            try:
                data = payload if payload is not None else message.SerializeToString()
                self._forwarders.submit(signal, data)
            except Exception:  # forwarding is best effort by design
                _log.debug("forwarding submit failed", exc_info=True)
        rejected = int(getattr(result, "rejected_spans", 0) or 0)
        errors = tuple(getattr(result, "errors", ()) or ())
        message_text = "; ".join(errors)[:1000] if (rejected or errors) else ""
        outcome = semconv.OUTCOME_PARTIAL if rejected else semconv.OUTCOME_OK
        self.metrics.request(transport, signal, outcome)
        return IngestOutcome(
            accepted=int(getattr(result, "accepted_spans", 0) or 0),
            rejected=rejected,
            error_message=message_text,
        )


__all__ = ["IngestOutcome", "Intake", "TransportMetrics"]
