"""Options of the demo service: keyword argument -> ``INFERPROF_DEMO_*`` env var -> default.

The env vars exist so the service can be started by plain ``uvicorn`` (which can only
pass an import string). A bad argument raises ``ValueError``; a bad env value is
logged and replaced by the default, so a typo never stops a service from starting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from inferprof import _settings, semconv
from inferprof import environment_variables as ev
from inferprof.demo.model import DEFAULT_MODEL_SIZE, MODEL_SIZES

#: No telemetry at all (the baseline).
INSTRUMENTATION_NONE = "none"
#: opentelemetry-instrumentation-fastapi alone: one server span per request, no stages.
INSTRUMENTATION_OTEL = "otel"
INSTRUMENTATIONS = (INSTRUMENTATION_NONE, INSTRUMENTATION_OTEL, *semconv.MODES)

ENV_INSTRUMENTATION = ev.INFERPROF_DEMO_INSTRUMENTATION
ENV_MODEL_SIZE = ev.INFERPROF_DEMO_MODEL_SIZE
ENV_MAX_BATCH_SIZE = ev.INFERPROF_DEMO_MAX_BATCH_SIZE
ENV_MAX_DELAY_MS = ev.INFERPROF_DEMO_MAX_DELAY_MS
ENV_MAX_TOKENS = ev.INFERPROF_DEMO_MAX_TOKENS
ENV_SERVICE_NAME = ev.INFERPROF_DEMO_SERVICE_NAME
ENV_ENDPOINT = ev.INFERPROF_DEMO_OTLP_ENDPOINT
ENV_GC_FREEZE = ev.INFERPROF_DEMO_GC_FREEZE
ENV_GC_THRESHOLD = ev.INFERPROF_DEMO_GC_THRESHOLD

_DEFAULT_INSTRUMENTATION = semconv.MODE_FULL
_DEFAULT_MAX_BATCH_SIZE = 16
_DEFAULT_MAX_DELAY_MS = 5.0
_DEFAULT_MAX_TOKENS = 256
_DEFAULT_SERVICE_NAME = "inferprof-demo"
#: CPython's own is 700 (net container allocations between young collections).
_DEFAULT_GC_THRESHOLD = 7000
DEFAULT_MODEL_NAME = "demo-topic"


@dataclass(frozen=True)
class DemoSettings:
    """How the demo service is built. Every field has a matching env var (see above)."""

    instrumentation: str = _DEFAULT_INSTRUMENTATION
    model_size: str = DEFAULT_MODEL_SIZE
    max_batch_size: int = _DEFAULT_MAX_BATCH_SIZE
    max_delay_ms: float = _DEFAULT_MAX_DELAY_MS
    max_tokens: int = _DEFAULT_MAX_TOKENS
    service_name: str = _DEFAULT_SERVICE_NAME
    #: OTLP endpoint; None leaves it to inferprof's / OpenTelemetry's own env vars.
    endpoint: str | None = None
    model_name: str = DEFAULT_MODEL_NAME
    #: ``gc.freeze()`` once started, as long-running Python servers commonly do: the
    #: start-up objects (modules, the tokenizer, FastAPI's routing) then never get scanned
    #: again by full garbage collections, which otherwise stall every request in flight
    #: for tens of milliseconds (docs/overhead.md, "Garbage collection and the p99").
    gc_freeze: bool = True
    #: Young-generation threshold set once started (``gc.set_threshold(n, ...)``, the
    #: older generations' thresholds unchanged); 0 leaves CPython's (700). At 700 a
    #: burst of a few dozen requests crosses it once or twice depending on how many
    #: objects each request allocates, so any per-request allocation doubles the young
    #: collections (docs/overhead.md, "Young collections and gc.set_threshold").
    gc_threshold: int = _DEFAULT_GC_THRESHOLD

    def __post_init__(self) -> None:
        _settings.check_fields(self, _CHECKS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> DemoSettings:
        """Settings from ``INFERPROF_DEMO_*``; keyword arguments win over the environment."""
        values = _settings.from_environ(_ENV, _CHECKS, environ)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)


def _one_of(choices: tuple[str, ...] | list[str]) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}; got {v!r}"


def _positive(v: Any) -> str | None:
    return None if isinstance(v, (int, float)) and v > 0 else f"must be > 0, got {v!r}"


def _non_negative(v: Any) -> str | None:
    return None if isinstance(v, (int, float)) and v >= 0 else f"must be >= 0, got {v!r}"


def _non_negative_int(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    return None if ok else f"must be an integer >= 0, got {v!r}"


def _non_empty(v: Any) -> str | None:
    return None if isinstance(v, str) and v else f"must be a non-empty string, got {v!r}"


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "instrumentation": _one_of(INSTRUMENTATIONS),
    "model_size": _one_of(sorted(MODEL_SIZES)),
    "max_batch_size": _positive,
    "max_delay_ms": _non_negative,
    "max_tokens": _positive,
    "service_name": _non_empty,
    "model_name": _non_empty,
    "gc_threshold": _non_negative_int,
}

_ENV: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("instrumentation", ENV_INSTRUMENTATION, str.strip),
    ("model_size", ENV_MODEL_SIZE, str.strip),
    ("max_batch_size", ENV_MAX_BATCH_SIZE, int),
    ("max_delay_ms", ENV_MAX_DELAY_MS, float),
    ("max_tokens", ENV_MAX_TOKENS, int),
    ("service_name", ENV_SERVICE_NAME, str.strip),
    ("endpoint", ENV_ENDPOINT, str.strip),
    ("gc_freeze", ENV_GC_FREEZE, _settings.parse_flag),
    ("gc_threshold", ENV_GC_THRESHOLD, int),
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ENV_ENDPOINT",
    "ENV_GC_FREEZE",
    "ENV_GC_THRESHOLD",
    "ENV_INSTRUMENTATION",
    "ENV_MAX_BATCH_SIZE",
    "ENV_MAX_DELAY_MS",
    "ENV_MAX_TOKENS",
    "ENV_MODEL_SIZE",
    "ENV_SERVICE_NAME",
    "INSTRUMENTATIONS",
    "INSTRUMENTATION_NONE",
    "INSTRUMENTATION_OTEL",
    "DemoSettings",
]
