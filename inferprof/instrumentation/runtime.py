"""The runtime behind ``configure()``: turns finished request records into spans.

Why not one OpenTelemetry span per stage as it happens: on the SDK a span costs about 15 µs
of CPU to create and end (sampler, bounded attribute dicts, locks, context attach/detach),
and a request has ~9 stages. Here a stage is recorded as two timestamps in a per-request
record, and the spans are built once, at request end, as ``ReadableSpan`` objects handed
straight to the provider's span processor (the same objects the SDK hands its processors),
with ids inferprof generated when the request started. For a provider that is not the SDK's
the public tracer API is used instead (slower, and its ids are its own).

Telemetry never breaks serving: every entry point used from request code catches and logs
its own failures.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import time
import weakref
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status

from inferprof import semconv
from inferprof._version import __version__
from inferprof.instrumentation import _otel_compat
from inferprof.instrumentation import device as _device
from inferprof.instrumentation.accounting import (
    DeferredTrace,
    EncodedTrace,
    Stats,
    StatsSnapshot,
)
from inferprof.instrumentation.config import fresh_instance
from inferprof.instrumentation.device import resolve_stages
from inferprof.instrumentation.otlp_encode import (
    batch_stage_body,
    encode_request_trace,
    encode_trace_spans,
)
from inferprof.instrumentation.records import (
    MEMBERSHIP_LOCK,
    NO_BATCHES,
    SUMMARISED_UNTIMED,
    BatchRecord,
    RequestRecord,
    StageRecord,
    SummaryRecord,
    span_id_of,
)
from inferprof.instrumentation.sampling import TailSampler, TimingBudget
from inferprof.instrumentation.spans import (
    UNSET,
    SpanSpec,
    batch_stage_attrs,
    error_parts,
    new_span_id,
    new_spec,
    new_trace_id,
    stage_spec,
)
from inferprof.instrumentation.summaries import OPEN_END, Summaries

_logger = logging.getLogger(__name__)

_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)
_NOT_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.DEFAULT)
_getrandbits = random.getrandbits
_random = random.random
_MODEL_NAME = semconv.ATTR_MODEL_NAME
_SUMMARY_COUNTED = semconv.ATTR_SUMMARY_COUNTED
_GEN_AI_RESPONSE_MODEL = semconv.ATTR_GEN_AI_RESPONSE_MODEL
_GEN_AI_REQUEST_MODEL = semconv.ATTR_GEN_AI_REQUEST_MODEL
_CHILDREN = semconv.BATCH_ENCODING_CHILDREN
_LINKS = semconv.BATCH_ENCODING_LINKS
_INTERNAL = SpanKind.INTERNAL
_span_name = semconv.span_name
_new_record = object.__new__
_init_record = RequestRecord.__init__
#: Share of shutdown's time the summaries' last export may take (spans get the rest).
_SUMMARY_CLOSE_SHARE = 0.3


def _sampler_ratio(sampler: Any, parent: trace_api.SpanContext | None) -> float:
    """Probability the OTel sampler keeps a trace, when it says (ratio samplers); else 1."""
    from opentelemetry.sdk.trace import sampling

    if isinstance(sampler, sampling.ParentBased):
        if parent is not None and parent.is_valid:
            return 1.0
        sampler = _otel_compat.root_sampler(sampler)
    if isinstance(sampler, sampling.TraceIdRatioBased):
        return sampler.rate if sampler.rate > 0 else 1.0
    return 1.0


def _roots_always_on(sampler: Any) -> bool:
    from opentelemetry.sdk.trace import sampling

    sampler = _otel_compat.root_sampler(sampler)
    return (
        sampler is sampling.ALWAYS_ON
        or _otel_compat.static_decision(sampler) is Decision.RECORD_AND_SAMPLE
    )


def _freeze_stage_errors(stages: Iterable[StageRecord], default_end: int) -> None:
    for st in stages:
        if st.error is not None and not isinstance(st.error, tuple):
            st.error = error_parts(st.error, st.end or default_end)


def _freeze_errors(rec: RequestRecord, batches: list) -> None:
    """Turn exceptions into their span parts now, on the request's thread: a trace
    waiting in the export queue must not keep a traceback (and every frame's locals,
    model inputs included) alive, and the message must be the one of the moment."""
    if rec.error is not None and not isinstance(rec.error, tuple):
        rec.error = error_parts(rec.error, rec.end)
    _freeze_stage_errors(rec.stages, rec.end)
    for _, stages in batches:
        _freeze_stage_errors(stages, rec.end)


def _batch_summary_spans(b: BatchRecord) -> tuple:
    """The stage spans of batch ``b`` a member's summary holds, flat (``stage, start_ns,
    end_ns`` each): ``children``: those ended (as the member's trace copies them);
    ``links``: all, one still open ending at :data:`OPEN_END`. Kept on the batch once it
    has closed with every stage ended (its stages are final then, device times resolved),
    so that each member adds them in one step."""
    closed = b.closed  # read first: a batch closes after resolving its stages' times
    children = b.encoding == _CHILDREN
    flat: list[Any] = []
    ended = True
    for st in b.stages:
        e = st.end
        if e is None:
            ended = False
            if children:
                continue
            e = OPEN_END
        flat += (st.name, st.start, e)
    spans = tuple(flat)
    if closed and ended:
        b.summary_spans = spans
    return spans


def _as_trace(trace_id: int, specs: list[SpanSpec], trace_state: Any) -> tuple:
    return trace_id, specs, trace_state


class Runtime:
    """Configured state: providers, the span sink, the sampler and the counters."""

    def __init__(
        self,
        config: Any,
        tracer_provider: Any,
        meter_provider: Any,
        stats: Stats | None = None,
        deferred: Any = None,
        owned_processor: Any = None,
        summary_exporter: Any = None,
    ) -> None:
        self.config = config
        self.enabled = config.enabled and tracer_provider is not None
        self.mode = config.mode
        self.production = config.mode == semconv.MODE_PRODUCTION
        self.batch_encoding = config.batch_encoding
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.stats = stats if stats is not None else Stats()
        self.tail_sampler = (
            TailSampler(config.sample_rate, config.tail_quantile) if self.production else None
        )
        self._sample_rate = config.sample_rate
        #: production mode's cap on the requests timed (None: every request is timed)
        rate, cpu = config.max_timed_rate, config.max_timing_cpu
        self.timing_budget = (
            TimingBudget(rate or None, max_cpu=cpu or None)
            if self.production and (rate > 0 or cpu > 0) else None
        )
        self._scope = InstrumentationScope(semconv.INSTRUMENTATION_SCOPE, __version__)
        paths = tuple(config.excluded_paths)
        #: (exact, prefixes) for the HTTP middleware; a trailing ``*`` marks a prefix.
        self.excluded_paths = (
            frozenset(p for p in paths if not p.endswith("*")),
            tuple(p[:-1] for p in paths if p.endswith("*")),
        )
        self._batch_ids = itertools.count(1)
        self._batch_prefix = f"{_getrandbits(32):08x}"
        self._processor = None
        #: inferprof's own batch processor (configure() built the provider): kept traces go
        #: to it as one queue entry each (accounting module docstring): encoded to OTLP
        #: bytes here when its exporter takes them, else a DeferredTrace built into spans
        #: on its export thread.
        self._deferred = deferred
        #: the span processor configure() built (shut down within close()'s timeout)
        self.owned_processor = owned_processor
        self._encode = deferred is not None and getattr(deferred, "accepts_encoded", False)
        self._resource = None
        self._sampler: Any = None
        self.tracer: Any = None
        #: production mode's summaries of every timed request (contract §15), or None
        self.summaries: Summaries | None = None
        #: summaries on, and requests left untimed summarised with their stage times
        #: (records.SummaryRecord), not only counted
        self.untimed_stages = False
        #: production mode's engines (``Engine``) that recorded steps under this runtime:
        #: the steps they hold go out on close (weak: an engine's life is the application's)
        self.step_buffers: weakref.WeakSet[Any] = weakref.WeakSet()
        if not self.enabled:
            return
        self.tracer = tracer_provider.get_tracer(semconv.INSTRUMENTATION_SCOPE, __version__)
        if isinstance(tracer_provider, SdkTracerProvider):
            self._processor = _otel_compat.span_processor(tracer_provider)  # module docstring
            self._resource = tracer_provider.resource
            self._sampler = tracer_provider.sampler
            self._root_weight = 1.0 / _sampler_ratio(self._sampler, None)
            # The SDK's default sampler keeps every root span: skip the call for those.
            self._roots_always_on = _roots_always_on(self._sampler)
        if (summary_exporter is not None and self.production and config.summaries
                and self._resource is not None):
            self._start_summaries(config, summary_exporter)
        if self._resource is not None and hasattr(os, "register_at_fork"):
            weak = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := weak()) and m())
        self._register_metrics()

    def _start_summaries(self, config: Any, summary_exporter: Any) -> None:
        """Production mode's summaries (contract §15), and what they change: untimed
        requests summarised with their stages (``untimed_stages``), whose routes the timing
        budget then caps at ``max_timed_rate_summarised`` (their timed requests only feed
        traces: docs/overhead.md)."""
        self.summaries = Summaries(
            summary_exporter, self._resource, self._scope, self.stats,
            interval_s=config.summary_interval_s,
        )
        self.untimed_stages = config.untimed_stages
        budget = self.timing_budget
        if self.untimed_stages and budget is not None and config.max_timed_rate_summarised:
            budget.summarised_rate = config.max_timed_rate_summarised

    def _after_fork(self) -> None:
        # A worker forked after configure() (gunicorn --preload, multiprocessing): its
        # spans and summaries carry an instance id of its own, or the collector reads
        # every worker as one instance (one timeline for all their engines' steps).
        fresh = fresh_instance(self._resource)
        if fresh is None:
            return
        self._resource = fresh
        if self.summaries is not None:
            self.summaries.resource = fresh

    # --- self metrics ----------------------------------------------------------------
    def _register_metrics(self) -> None:
        if self.meter_provider is None:
            return
        from opentelemetry.metrics import Observation

        stats = self.stats
        try:
            meter = self.meter_provider.get_meter(semconv.INSTRUMENTATION_SCOPE, __version__)

            def dropped(_options):
                yield Observation(
                    stats.queue_full, {semconv.ATTR_DROP_REASON: semconv.DROP_REASON_QUEUE_FULL}
                )
                yield Observation(
                    stats.export_failed,
                    {semconv.ATTR_DROP_REASON: semconv.DROP_REASON_EXPORT_FAILED},
                )
                yield Observation(
                    stats.shutdown, {semconv.ATTR_DROP_REASON: semconv.DROP_REASON_SHUTDOWN}
                )

            def emitted(_options):
                yield Observation(stats.emitted)

            meter.create_observable_counter(
                semconv.METRIC_SPANS_DROPPED,
                callbacks=[dropped],
                unit="{span}",
                description="Spans inferprof produced that never reached the exporter's backend",
            )
            meter.create_observable_counter(
                semconv.METRIC_SPANS_EMITTED,
                callbacks=[emitted],
                unit="{span}",
                description="Spans inferprof handed to the span processor",
            )
        except Exception:
            _logger.exception("inferprof could not register its self-metrics")

    def snapshot(self) -> StatsSnapshot:
        return self.stats.snapshot()

    # --- requests ----------------------------------------------------------------------
    def start_request(
        self,
        name: str,
        kind: SpanKind,
        attrs: dict,
        parent: trace_api.SpanContext | None,
        start: int,
        cls: type[RequestRecord] = RequestRecord,
    ) -> RequestRecord:
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
        else:
            parent = None
            trace_id = _getrandbits(128) or 1  # new_trace_id(), without the call
        span_id = _getrandbits(64) or 1
        weight_hint = 1.0
        if self.production:
            head = _random() < self._sample_rate
        elif self._sampler is not None:
            head, weight_hint = self._consult_sampler(trace_id, name, kind, attrs, parent)
        else:
            head = True
        # cls(...), without the class call (once a request): RequestRecord subclasses
        # add slots, not an __init__ of their own
        rec = _new_record(cls)
        _init_record(rec, self, name, kind, trace_id, span_id, parent, start, attrs, head,
                     weight_hint)
        if parent is not None and parent.trace_state:
            rec.trace_state = self._inherit_trace_state(parent.trace_state)
        return rec

    def _inherit_trace_state(self, state: trace_api.TraceState) -> trace_api.TraceState | None:
        """W3C tracestate passes through; in production mode minus the upstream ``ot=th``
        probability, which inferprof's own tail sampling (and its weight attribute)
        replaces for the spans of this service."""
        if self.production and semconv.TRACESTATE_OT_KEY in state:
            state = state.delete(semconv.TRACESTATE_OT_KEY)
        return state or None

    def _consult_sampler(self, trace_id, name, kind, attrs, parent) -> tuple[bool, float]:
        if parent is None and self._roots_always_on:
            return True, 1.0
        ctx = trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent)) if parent else None
        try:
            result = self._sampler.should_sample(ctx, trace_id, name, kind, attrs)
        except Exception:
            _logger.exception("the OpenTelemetry sampler failed; keeping the trace")
            return True, 1.0
        if result.decision is not Decision.RECORD_AND_SAMPLE:
            return False, 1.0
        if parent is None:
            return True, self._root_weight
        return True, 1.0 / _sampler_ratio(self._sampler, parent)

    def live_weight(self, live: Any) -> float:
        """Weight of a request span another instrumentation created, per the SDK sampler."""
        return self.sampled_weight(getattr(live, "parent", None))

    def sampled_weight(self, parent: trace_api.SpanContext | None) -> float:
        """Weight of a span the SDK sampler keeps in a trace continuing ``parent`` (None:
        a root): 1 / the probability it keeps one, when it says (ratio samplers); else 1."""
        if self._sampler is None:
            return 1.0
        return 1.0 / _sampler_ratio(self._sampler, parent)

    def finish_request(self, rec: RequestRecord) -> None:
        """Decide, build and emit the request's spans. Never raises."""
        if rec.finished:
            return
        rec.finished = True
        try:
            if _device._used:  # (read here: saves a call per request until a device stage exists)
                resolve_stages(rec.stages)
            if rec.live_span is None and self.tail_sampler is not None:
                # Before the tail decision: a discarded request leaves its batches.
                counted = (
                    self.summaries is not None and rec.generation is None
                    and self._summarise(rec)
                )
                model = rec.attrs.get(_MODEL_NAME)
                weight = self.tail_sampler.decide(
                    rec.end - rec.start, rec.head, rec.name if model is None else (rec.name, model)
                )
                if weight is None:  # production mode's usual case: a fast request, not kept
                    self.stats.discarded += 1
                    rec.generation = None  # (record <-> engine handle: no cycle for the GC)
                    if rec.batches is not NO_BATCHES:  # it was enqueued for a batch
                        self._leave_batches(rec)
                    return
                kept = True
                # 1 / the probability it was timed at all (TimingBudget): part of its weight
                weight *= rec.weight_hint
                if counted:  # the collector counts it from the summaries, not the trace
                    rec.attrs[_SUMMARY_COUNTED] = True
            else:
                kept, weight = rec.head, rec.weight_hint
            self._finish(rec, kept, weight)
        except Exception:
            _logger.exception("inferprof failed to emit the spans of a request")

    def _summarise(self, rec: RequestRecord) -> bool:
        """Hand the request to the summaries, as the stage spans its trace would hold:
        its own stages (one still open ends with the request, as its span does), each
        batch's (``children``: those ended by now, as the kept trace copies them;
        ``links``: all, one still open ending after the request, clipped by the
        collector), and those the record makes at the end. A request with none is left
        to its trace: the collector counts a request with no stage span by its
        attributes alone."""
        end = rec.end
        flat: list[Any] = []
        # The model as the collector reads it off the trace: the request span's
        # inferprof.model.name, else its GenAI names, else a stage span's; not a string:
        # none.
        attrs = rec.attrs
        model = attrs.get(_MODEL_NAME)
        if model is None:
            model = attrs.get(_GEN_AI_RESPONSE_MODEL)
            if model is None:
                model = attrs.get(_GEN_AI_REQUEST_MODEL)
        if model is None:
            model = self._summary_stages_and_model(rec, flat)
        else:  # the usual case: the loops without the model's lookups
            for st in rec.stages:
                e = st.end
                flat += (st.name, st.start, end if e is None else e)
            batches = rec.batches
            if batches:
                for b in batches:
                    spans = b.summary_spans
                    # (a stage entered after the batch closed, by a task that inherited
                    # its scope, makes it stale)
                    if spans is None or len(spans) != 3 * len(b.stages):
                        spans = _batch_summary_spans(b)
                    flat += spans
        error = rec._summary_parts(flat)
        if not flat:
            return False
        if model is not None and not isinstance(model, str):
            model = None  # the collector's series for a model that is not a string
        mark = rec._summarised(model)
        weight = rec.weight_hint
        if mark == SUMMARISED_UNTIMED:
            # Its untimed siblings are summarised with their stages: every request of its
            # route is, so each counts once, everywhere (no mark needed)
            weight, mark = 1.0, False
        return self.summaries.add(  # type: ignore[union-attr]  # (finish_request checked)
            (rec.start, end, error, model, weight, tuple(flat), mark)
        )

    def summarise_untimed(self, rec: SummaryRecord, start: int, end: int, error: bool,
                          model: str | None, parts: list) -> bool:
        """Hand a request left untimed and summarised (``rec``) to the summaries, as a
        timed request of its route at weight 1 (its stages, its batches' as a member's,
        and ``parts``: the middleware's ``receive``/``serialize``, ``stage, start_ns,
        end_ns`` each, in the order a timed request's spans come in); False when it has no
        stage (then only counted). Summaries that are full or closed drop it (counted as
        dropped, once: it is not counted instead)."""
        flat: list[Any] = []
        for st in rec.stages:
            s = st.start
            if s:  # (0: a stage() never entered)
                e = st.end
                flat += (st.name, s, end if e is None else e)
        batches = rec.batches
        if batches:
            for b in batches:
                spans = b.summary_spans
                if spans is None or len(spans) != 3 * len(b.stages):  # (as _summarise)
                    spans = _batch_summary_spans(b)
                flat += spans
        flat += parts
        if not flat:
            return False
        if self.summaries.add(  # type: ignore[union-attr]  # (untimed_stages)
                (start, end, error, model, 1.0, tuple(flat), False)):
            self.stats.untimed_summarised += 1
        return True

    @staticmethod
    def _summary_stages_and_model(rec: RequestRecord, flat: list) -> Any:
        """:meth:`_summarise`'s stages for a request whose own attributes name no model:
        added to ``flat`` as there, looking for the model on the stage spans (a batch
        stage span's: its own attributes, else the batch's); the model, or None."""
        end = rec.end
        model = None
        for st in rec.stages:
            e = st.end
            flat += (st.name, st.start, end if e is None else e)
            if model is None:
                model = st.attrs.get(_MODEL_NAME)
        for b in rec.batches:
            flat += _batch_summary_spans(b)
            if model is None:  # a batch stage span's (the first it holds)
                children = b.encoding == _CHILDREN
                for st in b.stages:
                    if st.end is None and children:
                        continue
                    model = st.attrs.get(_MODEL_NAME, b.attrs.get(_MODEL_NAME))
                    if model is not None:
                        break
        return model

    def _leave_batches(self, rec: RequestRecord) -> None:
        """The request has ended: report it to its ``links`` batches. Atomic against a
        batch forming with it (records.MEMBERSHIP_LOCK): it is a member and reports here,
        or it had ended and is not one. Taken once per request that was enqueued."""
        with MEMBERSHIP_LOCK:
            batches = rec.batches
            for batch in batches:
                if batch.encoding == _LINKS:
                    self.member_done(batch, rec)
            batches.clear()

    def _finish(self, rec: RequestRecord, kept: bool, weight: float | None) -> None:
        rec.kept = kept
        if kept:
            self.stats.kept += 1
            rec._complete()
            # What the trace will hold, fixed now: a batch that outlives the request adds
            # no stage that ended after it. (Not clipped copies of the stages still running:
            # the collector takes a batch's first copy of a stage as its work window, and a
            # member that left early would make that the clipped one.)
            batches = [
                (b, tuple(b.stages))
                if b.encoding != semconv.BATCH_ENCODING_CHILDREN
                else (b, tuple(st for st in b.stages if st.end is not None))
                for b in rec.batches
            ]
            if self._encode:
                self._defer_encoded_request(rec, weight, batches)
            elif self._deferred is not None:
                _freeze_errors(rec, batches)
                n = (1 if rec.emit_request_span and rec.live_span is None else 0) + len(rec.stages)
                for b, stages in batches:
                    if b.encoding == semconv.BATCH_ENCODING_CHILDREN:
                        n += len(stages)
                # The record's stage list and attributes as of now: the application may
                # still hold the handle while the export thread builds the spans.
                args = (rec, weight, batches, tuple(rec.stages), dict(rec.attrs))
                self._defer(DeferredTrace(self, self._request_trace, args, n))
            else:
                self._emit_spans(self._spans(*self._request_trace(rec, weight, batches)))
        else:
            self.stats.discarded += 1
            rec.generation = None
        if rec.batches is not NO_BATCHES:  # it was enqueued for a batch
            self._leave_batches(rec)

    def _request_trace(
        self,
        rec: RequestRecord,
        weight: float | None,
        batches: list,
        own_stages: tuple | None = None,
        request_attrs: dict | None = None,
        copy_batches: bool = True,
    ) -> tuple:
        """(trace id, span specs, trace state) of a kept request; ``batches``: (batch, its
        stages to include) pairs; ``own_stages``/``request_attrs``: the record's,
        snapshotted when it ended (default: read now); ``copy_batches``: include the
        ``children``-encoded batch stages' copies. Specs are what :meth:`_spans` takes."""
        trace_id = rec.trace_id
        end = rec.end
        specs: list[tuple] = []
        if rec.emit_request_span and rec.live_span is None:
            # links encoding: the request span links to its batches' spans, so a trace view
            # of the request leads to them (the collector attributes through the batch
            # spans' own links; links on a request span carry no attribution).
            back_links = tuple(
                Link(trace_api.SpanContext(b.trace_id, span_id_of(st), False, _SAMPLED))
                for b, stages in batches
                if b.encoding == semconv.BATCH_ENCODING_LINKS and b.trace_id
                for st in stages
                if st.parent is None
            )
            attrs = dict(rec.attrs) if request_attrs is None else request_attrs
            if rec.kind is not SpanKind.SERVER and rec.kind is not SpanKind.CONSUMER:
                attrs[semconv.ATTR_REQUEST] = True
            if weight is not None and weight != 1.0:
                attrs[semconv.ATTR_SAMPLE_WEIGHT] = float(weight)
            if rec.stages_dropped:
                attrs[semconv.ATTR_STAGES_DROPPED] = rec.stages_dropped
            specs.append(new_spec(SpanSpec, (
                rec.name, rec.span_id, rec.parent, rec.kind, rec.start, end, attrs, rec.error,
                back_links,
            )))
        root = rec.span_id
        specs.extend([
            stage_spec(st, root, end) for st in (rec.stages if own_stages is None else own_stages)
        ])
        for batch, batch_stages in batches if copy_batches else ():
            if batch.encoding != semconv.BATCH_ENCODING_CHILDREN:
                continue
            # Each member gets copies with ids of its own; a copy's parent is the copy of
            # the batch stage's parent.
            mapping: dict[StageRecord, int] = {}
            for st in batch_stages:
                copy_id = new_span_id()
                mapping[st] = copy_id
                specs.append(new_spec(SpanSpec, (
                    _span_name(st.name), copy_id,
                    mapping.get(st.parent, root) if st.parent is not None else root,
                    _INTERNAL, st.start, st.end, batch_stage_attrs(batch, st), st.error, (),
                )))
        return trace_id, specs, rec.trace_state

    # --- batches -----------------------------------------------------------------------
    def new_batch_id(self) -> str:
        return f"{self._batch_prefix}-{next(self._batch_ids)}"

    def close_batch(self, batch: BatchRecord) -> None:
        """The batch's last stage ended. Never raises."""
        try:
            resolve_stages(batch.stages)
            with batch.lock:
                batch.closed = True
                ready = batch.pending == 0
                # members -> batch -> members is a cycle; once closed the batch needs only
                # the pending count, so let the records be freed by refcounting alone.
                batch.members = []
            if ready and batch.encoding == semconv.BATCH_ENCODING_LINKS:
                self._emit_linked_batch(batch)
        except Exception:
            _logger.exception("inferprof failed to close a batch")

    def member_done(self, batch: BatchRecord, rec: RequestRecord) -> None:
        with batch.lock:
            batch.pending -= 1
            if rec.kept:
                batch.kept_members.append(
                    trace_api.SpanContext(rec.trace_id, rec.span_id, False, _SAMPLED)
                )
            ready = batch.closed and batch.pending == 0
        if ready:
            self._emit_linked_batch(batch)

    def _emit_linked_batch(self, batch: BatchRecord) -> None:
        with batch.lock:
            if batch.emitted or not batch.kept_members:
                batch.emitted = True
                return
            batch.emitted = True
        links = tuple(Link(ctx) for ctx in batch.kept_members)
        if self._encode:
            self._defer_encoded(*self._linked_batch_trace(batch, tuple(batch.stages), links))
        elif self._deferred is not None:
            stages = tuple(batch.stages)
            _freeze_stage_errors(stages, 0)
            self._defer(
                DeferredTrace(self, self._linked_batch_trace, (batch, stages, links), len(stages))
            )
        else:
            self._emit_spans(
                self._spans(*self._linked_batch_trace(batch, tuple(batch.stages), links))
            )

    def _linked_batch_trace(self, batch: BatchRecord, stages: tuple, links: tuple) -> tuple:
        end = max((st.end or 0 for st in stages), default=0)
        specs = []
        for st in stages:
            parent_stage = st.parent
            specs.append(new_spec(SpanSpec, (
                _span_name(st.name), span_id_of(st),
                span_id_of(parent_stage) if parent_stage is not None else None, _INTERNAL,
                st.start, st.end or end, batch_stage_attrs(batch, st), st.error, links,
            )))
        return batch.trace_id or new_trace_id(), specs, None

    def emit_trace(self, trace_id: int, specs: list[SpanSpec]) -> None:
        """Hand a trace of ``specs`` (errors frozen already) to the span sink, as the
        runtime hands its batch traces: encoded now, deferred to the export thread, or
        built into spans now. Never raises."""
        try:
            if self._encode:
                self._defer_encoded(trace_id, specs, None)
            elif self._deferred is not None:
                self._defer(DeferredTrace(self, _as_trace, (trace_id, specs, None), len(specs)))
            else:
                self._emit_spans(self._spans(trace_id, specs))
        except Exception:
            _logger.exception("inferprof failed to emit the spans of a trace")

    # --- the sink ----------------------------------------------------------------------
    def _defer(self, item: DeferredTrace | EncodedTrace) -> None:
        self._deferred.on_end(item)
        self.stats.emitted += item.n

    def _defer_encoded(self, trace_id: int, specs: list, trace_state: Any) -> None:
        try:
            payload = encode_trace_spans(trace_id, specs, trace_state)
        except Exception:
            _logger.exception("inferprof could not encode the spans of a trace")
            with self.stats._lock:
                self.stats.export_failed += len(specs)
            self.stats.emitted += len(specs)
            return
        self._defer(EncodedTrace(self, payload, len(specs)))

    def _defer_encoded_request(self, rec: RequestRecord, weight: float | None,
                               batches: list) -> None:
        """A kept request's trace, encoded straight from the records: its own stages, and
        the batch stages' copies from bytes each batch encodes once (:meth:`_batch_body`)."""
        stages = rec.stages
        try:
            trace_id, head, trace_state = self._request_trace(
                rec, weight, batches, own_stages=(), copy_batches=False
            )
            copies = [
                (batch_stages, functools.partial(self._batch_body, batch))
                for batch, batch_stages in batches
                if batch.encoding == semconv.BATCH_ENCODING_CHILDREN
            ]
            payload = encode_request_trace(
                trace_id, head, stages, rec.span_id, rec.end, copies, trace_state
            )
        except Exception:
            _logger.exception("inferprof could not encode the spans of a trace")
            with self.stats._lock:
                self.stats.export_failed += 1 + len(stages)
            self.stats.emitted += 1 + len(stages)
            return
        n = len(head) + len(stages) + sum(len(batch_stages) for batch_stages, _ in copies)
        self._defer(EncodedTrace(self, payload, n))

    def _batch_body(self, batch: BatchRecord, st: StageRecord) -> bytes:
        """``st``'s span minus its ids, as every member's copy has it; kept on the batch
        once it has closed (its stages and attributes are final then), so a batch with
        several kept members encodes each stage once."""
        bodies = batch.bodies
        if bodies is not None:
            body = bodies.get(st)
            if body is not None:
                return body
        body = batch_stage_body(st, batch_stage_attrs(batch, st))
        if batch.closed:
            if bodies is None:
                bodies = batch.bodies = {}
            bodies[st] = body
        return body

    def _emit_spans(self, spans: list) -> None:
        if self._processor is None:
            return  # _spans emitted them through the public API already
        on_end = self._processor.on_end
        for span in spans:
            on_end(span)
        self.stats.emitted += len(spans)

    def _spans(self, trace_id: int, specs: Iterable[SpanSpec], trace_state: Any = None) -> list:
        """``ReadableSpan`` objects for ``specs``. Without an SDK provider the spans are
        emitted through the API instead."""
        if self._processor is None:
            self._emit_via_api(trace_id, specs)
            return []
        resource, scope = self._resource, self._scope
        out = []
        parents: dict[int, trace_api.SpanContext] = {}
        for name, span_id, parent, kind, start, end, attrs, error, links in specs:
            if parent is None or isinstance(parent, trace_api.SpanContext):
                parent_ctx = parent
            else:
                parent_ctx = parents.get(parent)
                if parent_ctx is None:
                    parent_ctx = parents[parent] = trace_api.SpanContext(
                        trace_id, parent, False, _SAMPLED, trace_state
                    )
            status: Status = UNSET
            events: tuple[Event, ...] = ()
            if error is not None:
                status, events, extra = error_parts(error, end)
                if extra:
                    attrs.update(extra)
            out.append(
                ReadableSpan(
                    name=name,
                    context=trace_api.SpanContext(trace_id, span_id, False, _SAMPLED, trace_state),
                    parent=parent_ctx,
                    resource=resource,
                    attributes=attrs,
                    events=events,
                    links=links,
                    kind=kind,
                    status=status,
                    start_time=start,
                    end_time=end,
                    instrumentation_scope=scope,
                )
            )
        return out

    def _emit_via_api(self, trace_id: int, specs: Iterable[SpanSpec]) -> None:
        # A non-SDK provider chooses its own ids: map ours to the contexts it produced.
        actual: dict[int, trace_api.SpanContext] = {}
        n = 0
        for name, span_id, parent, kind, start, end, attrs, error, links in specs:
            if parent is None or isinstance(parent, trace_api.SpanContext):
                parent_ctx = parent
            else:
                parent_ctx = actual.get(parent)
            ctx = (
                trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent_ctx))
                if parent_ctx
                else None
            )
            span = self.tracer.start_span(
                name, context=ctx, kind=kind, attributes=attrs, links=links, start_time=start
            )
            if error is not None:
                status, events, extra = error_parts(error, end)
                if extra:
                    span.set_attributes(extra)
                for event in events:
                    span.add_event(event.name, event.attributes, event.timestamp)
                span.set_status(status)
            span.end(end_time=end)
            actual[span_id] = span.get_span_context()
            n += 1
        self.stats.emitted += n

    # --- lifecycle ---------------------------------------------------------------------
    def close(self, timeout_millis: int = 30000) -> None:
        """Flush and shut down, within ``timeout_millis`` for spans and metrics together
        when inferprof built the providers (an exporter that is down costs the wait, not
        more)."""
        tp, mp = self.tracer_provider, self.meter_provider
        if tp is None:
            return
        deadline = time.monotonic() + timeout_millis / 1000
        for engine in list(self.step_buffers):  # requests still generating: their steps
            engine.flush()
        summaries = self.summaries
        if summaries is not None:  # the last interval's summaries; a share of the time
            summaries.close(timeout_millis * _SUMMARY_CLOSE_SHARE / 1000)
            timeout_millis = int(max(0.0, deadline - time.monotonic()) * 1000)
        if self.config.owns_providers:
            processor = self.owned_processor
            if processor is not None:  # first, bounded; the provider's call is then a no-op
                # spans get most of the time; the final metrics collection the rest
                processor.shutdown(timeout_millis=timeout_millis * 0.8)
            tp.shutdown()
            if mp is not None and hasattr(mp, "shutdown"):
                left = max(0.0, deadline - time.monotonic())
                mp.shutdown(timeout_millis=left * 1000)
        elif hasattr(tp, "force_flush"):
            tp.force_flush(timeout_millis)


__all__ = ["Runtime", "new_span_id", "new_trace_id"]
