"""Options of the LLM demo service: keyword argument -> env var -> default.

The instrumentation, service name and OTLP endpoint are read from the same
``INFERPROF_DEMO_*`` variables as the classify demo's; the engine's own options from
``INFERPROF_DEMO_LLM_*``. A bad argument raises ``ValueError``; a bad env value is
logged and replaced by the default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from inferprof import _settings, semconv
from inferprof import environment_variables as ev
from inferprof.demo.llm.model import ModelConfig
from inferprof.demo.settings import (
    ENV_ENDPOINT,
    ENV_GC_FREEZE,
    ENV_INSTRUMENTATION,
    ENV_SERVICE_NAME,
    INSTRUMENTATION_NONE,
)
from inferprof.demo.tokenizer import DEFAULT_VOCAB_SIZE

#: ``none`` runs no telemetry code; the inferprof modes configure inferprof.
LLM_INSTRUMENTATIONS = (INSTRUMENTATION_NONE, *semconv.MODES)

ENV_MODEL_SIZE = ev.INFERPROF_DEMO_LLM_MODEL_SIZE
ENV_KV_BLOCKS = ev.INFERPROF_DEMO_LLM_KV_BLOCKS
ENV_BLOCK_SIZE = ev.INFERPROF_DEMO_LLM_BLOCK_SIZE
ENV_MAX_BATCHED_TOKENS = ev.INFERPROF_DEMO_LLM_MAX_BATCHED_TOKENS
ENV_MAX_RUNNING = ev.INFERPROF_DEMO_LLM_MAX_RUNNING
ENV_MAX_IN_FLIGHT = ev.INFERPROF_DEMO_LLM_MAX_IN_FLIGHT

#: Named model sizes: (d_model, n_layers, d_ff), 4 heads each.
LLM_MODEL_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (64, 1, 128),
    "small": (256, 2, 1024),
}
DEFAULT_LLM_MODEL_NAME = "demo-llm"
#: Longest sequence (prompt + output), in tokens.
MAX_SEQ_LEN = 2048


@dataclass(frozen=True)
class LLMSettings:
    """How the LLM demo service is built (see docs/demo.md, "The LLM demo")."""

    instrumentation: str = semconv.MODE_FULL
    service_name: str = "inferprof-demo-llm"
    #: OTLP endpoint; None leaves it to inferprof's / OpenTelemetry's own env vars.
    endpoint: str | None = None
    model_name: str = DEFAULT_LLM_MODEL_NAME
    model_size: str = "small"
    #: KV-cache size in blocks of ``block_size`` tokens: the budget that forces evictions.
    kv_blocks: int = 96
    block_size: int = 16
    #: Tokens per engine step, prefill chunks and decode tokens together.
    max_batched_tokens: int = 256
    #: Requests in the running batch at most.
    max_running: int = 16
    #: Requests accepted and not yet finished at most; beyond it, 429.
    max_in_flight: int = 256
    gc_freeze: bool = True

    def __post_init__(self) -> None:
        _settings.check_fields(self, _CHECKS)

    def model_config(self) -> ModelConfig:
        d_model, n_layers, d_ff = LLM_MODEL_SIZES[self.model_size]
        return ModelConfig(vocab_size=DEFAULT_VOCAB_SIZE, d_model=d_model, n_heads=4,
                           n_layers=n_layers, d_ff=d_ff, max_seq_len=MAX_SEQ_LEN)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides: Any) -> LLMSettings:
        values = _settings.from_environ(_ENV, _CHECKS, environ)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def env(self) -> dict[str, str]:
        """The variables that reproduce these settings in a child process."""
        out = {ENV_INSTRUMENTATION: self.instrumentation, ENV_SERVICE_NAME: self.service_name,
               ENV_MODEL_SIZE: self.model_size, ENV_KV_BLOCKS: str(self.kv_blocks),
               ENV_BLOCK_SIZE: str(self.block_size),
               ENV_MAX_BATCHED_TOKENS: str(self.max_batched_tokens),
               ENV_MAX_RUNNING: str(self.max_running),
               ENV_MAX_IN_FLIGHT: str(self.max_in_flight),
               ENV_GC_FREEZE: "1" if self.gc_freeze else "0"}
        if self.endpoint:
            out[ENV_ENDPOINT] = self.endpoint
        return out


def _positive_int(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
    return None if ok else f"must be an integer >= 1, got {v!r}"


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}; got {v!r}"


def _non_empty(v: Any) -> str | None:
    return None if isinstance(v, str) and v.strip() else f"must be a non-empty string, got {v!r}"


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "instrumentation": _one_of(LLM_INSTRUMENTATIONS),
    "service_name": _non_empty,
    "model_name": _non_empty,
    "model_size": _one_of(tuple(LLM_MODEL_SIZES)),
    "kv_blocks": _positive_int,
    "block_size": _positive_int,
    "max_batched_tokens": _positive_int,
    "max_running": _positive_int,
    "max_in_flight": _positive_int,
}

_ENV: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("instrumentation", ENV_INSTRUMENTATION, str.strip),
    ("service_name", ENV_SERVICE_NAME, str.strip),
    ("endpoint", ENV_ENDPOINT, str.strip),
    ("model_size", ENV_MODEL_SIZE, str.strip),
    ("kv_blocks", ENV_KV_BLOCKS, int),
    ("block_size", ENV_BLOCK_SIZE, int),
    ("max_batched_tokens", ENV_MAX_BATCHED_TOKENS, int),
    ("max_running", ENV_MAX_RUNNING, int),
    ("max_in_flight", ENV_MAX_IN_FLIGHT, int),
    ("gc_freeze", ENV_GC_FREEZE, _settings.parse_flag),
)

__all__ = [
    "DEFAULT_LLM_MODEL_NAME",
    "ENV_BLOCK_SIZE",
    "ENV_KV_BLOCKS",
    "ENV_MAX_BATCHED_TOKENS",
    "ENV_MAX_IN_FLIGHT",
    "ENV_MAX_RUNNING",
    "ENV_MODEL_SIZE",
    "LLM_INSTRUMENTATIONS",
    "LLM_MODEL_SIZES",
    "MAX_SEQ_LEN",
    "LLMSettings",
]
