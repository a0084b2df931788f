"""Triton Inference Server clients as ``network`` stages, with the trace continued in Triton.

::

    import tritonclient.grpc.aio as grpcclient
    import inferprof.triton

    triton = inferprof.triton.instrument(grpcclient.InferenceServerClient("triton:8001"))

    async def handler(...):                       # inside an inferprof request
        result = await triton.infer("bert", inputs)   # one ``network`` stage

``instrument(client)`` works on ``tritonclient.http`` and ``tritonclient.grpc``
``InferenceServerClient`` and their ``aio`` versions. Each ``infer`` (and ``async_infer``,
and each gRPC stream) becomes a ``network`` stage of the current request — or, outside a
request, an ordinary span, as ``inferprof.stage`` does — with the Triton model name and
version, the protocol and the binary tensor bytes; a Triton error is recorded on it and
re-raised unchanged. The stage's W3C ``traceparent``/``tracestate`` go into the call's
HTTP headers or gRPC metadata through tritonclient's plugin mechanism, so a Triton server
tracing in OpenTelemetry mode puts its own spans (request, queue, compute) under the
``network`` span of the same trace. With inferprof off or not configured a call costs one
check.

For calls the clients do not make (Triton's ``generate``/``generate_stream`` endpoints,
its REST API through httpx or requests), ``call()`` records the same stage and gives the
headers to send::

    async with inferprof.triton.call("llm") as call:
        r = await http.post(f"{url}/v2/models/llm/generate", json=body, headers=call.headers)

See ``docs/triton.md``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from inferprof._optional import require

C = TypeVar("C")


def instrument(client: C, *, propagate: bool | str = True) -> C:
    """Record every inference call of ``client`` as a ``network`` stage; returns ``client``.

    ``propagate``: send each call's trace context to Triton — ``True`` (default), ``False``,
    or ``"sampled"``: only for requests whose trace is sampled at the start (Triton traces
    every request that carries a trace context, whatever its sampled flag and its own
    ``rate``; see docs/triton.md). An application plugin already registered on the client
    (``BasicAuth``...) is kept and runs first; register yours before calling
    ``instrument()``, since a client holds one plugin. Instrumenting a client twice changes
    nothing. Raises ``TypeError`` for anything but a tritonclient ``InferenceServerClient``,
    ``ValueError`` for another ``propagate``, ``ImportError`` naming ``inferprof[triton]``
    without tritonclient.
    """
    require("tritonclient", "triton")
    from inferprof.triton._clients import kind_of, patch
    from inferprof.triton._kinds import PROPAGATE_SAMPLED, STATE_KEY, State

    if not (isinstance(propagate, bool) or propagate == PROPAGATE_SAMPLED):
        raise ValueError(f"propagate must be True, False or 'sampled', got {propagate!r}")
    kind = kind_of(client)
    if kind is None:
        raise TypeError(
            "inferprof.triton.instrument() takes a tritonclient InferenceServerClient "
            f"(http, grpc, http.aio or grpc.aio), got {type(client).__qualname__}"
        )
    if STATE_KEY in vars(client):
        return client
    state = State(kind, type(client), propagate)
    if propagate is not False:
        from inferprof.triton._plugin import TraceContextPlugin

        previous = client.plugin()
        plugin = TraceContextPlugin(previous)
        if previous is not None:
            client.unregister_plugin()
        client.register_plugin(plugin)
        state.plugin = plugin
    patch(client, state)
    return client


def uninstrument(client: C) -> C:
    """Undo :func:`instrument`: the client's own methods again, and the plugin it had
    before (if ours is still the registered one). A stream still open ends its stage now."""
    from inferprof.triton._clients import unpatch
    from inferprof.triton._kinds import STATE_KEY

    state = vars(client).get(STATE_KEY) if hasattr(client, "__dict__") else None
    if state is None:
        return client

    unpatch(client, state)
    plugin = state.plugin
    if plugin is not None and client.plugin() is plugin:
        client.unregister_plugin()
        if plugin.previous is not None:
            client.register_plugin(plugin.previous)
    return client


def call(
    model_name: str,
    *,
    model_version: str | int | None = None,
    protocol: str = "http",
    headers: Any = None,
    propagate: bool | str = True,
) -> Any:
    """A ``network`` stage for one Triton request made without an instrumented client, and
    the headers to send with it: ``with``/``async with inferprof.triton.call("llm") as c:``
    then send ``c.headers``. Needs no tritonclient.

    ``headers``: headers of your own, copied (never modified) into ``c.headers`` with the
    stage's ``traceparent``/``tracestate`` added (replacing any of the same name in any
    letter case), per ``propagate`` as in :func:`instrument`. ``c.add_bytes(sent=...,
    received=...)`` counts bytes; an exception leaving the block is recorded on the stage
    and propagates unchanged. Outside a request the stage is a span of its own; with
    inferprof off or not configured nothing is recorded and ``c.headers`` is a copy of
    ``headers``. ``ValueError`` for an empty model name, a protocol other than ``"http"`` or
    ``"grpc"``, or another ``propagate``.
    """
    from inferprof.triton._manual import call as _call

    return _call(
        model_name,
        model_version=model_version,
        protocol=protocol,
        headers=headers,
        propagate=propagate,
    )


def is_instrumented(client: Any) -> bool:
    """Whether :func:`instrument` applies to ``client`` now."""
    from inferprof.triton._kinds import STATE_KEY

    return STATE_KEY in getattr(client, "__dict__", ())


__all__ = ["call", "instrument", "is_instrumented", "uninstrument"]
