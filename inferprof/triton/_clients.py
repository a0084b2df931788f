"""The wrapped methods of the four tritonclient clients (HTTP, gRPC, and their ``aio``
versions), each call a ``network`` stage (``_call``).

``instrument()`` changes the class of one client *instance* to a subclass of its own class
that overrides these methods (made once per client class), so other clients are
untouched, ``isinstance`` still holds and ``uninstrument()`` only puts the class back.
Wrappers installed as instance attributes would have held bound methods of the client in
its own ``__dict__`` — a reference cycle, freed only by the cycle collector, and the
clients close their connections in ``__del__``.

What each call records, and when its stage ends:

* ``infer`` (all four): from the call to its return or exception.
* gRPC ``async_infer(callback=...)``: from the call to the callback (a gRPC thread).
* HTTP ``async_infer``: from the call to ``get_result()`` returning or failing. The client
  sends the request on a gevent greenlet that only runs when the calling thread waits on
  the result, so this is how long the result was outstanding, waiting included.
* gRPC streams: one stage per stream (``_streams``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from inferprof import semconv
from inferprof.triton import _streams
from inferprof.triton._call import OUTGOING, NetworkCall, recording, with_trace_context
from inferprof.triton._kinds import (
    STATE_KEY,
    Kind,
    State,
    finish,
    grpc_received,
    grpc_sent,
    http_received,
    http_sent,
    outgoing,
    start,
    version,
)
from inferprof.triton._triton_compat import async_request_greenlet

_logger = logging.getLogger(__name__)


# --- infer ---------------------------------------------------------------------------------


def _sync_infer(fn: Callable, kind: Kind) -> Callable:
    @functools.wraps(fn)
    def infer(self, model_name, inputs, *args, **kwargs):
        call = start(kind, model_name, inputs, version(args, kwargs)) if recording() else None
        if call is None:
            return fn(self, model_name, inputs, *args, **kwargs)
        token = OUTGOING.set(outgoing(self, call))
        try:
            result = fn(self, model_name, inputs, *args, **kwargs)
        except BaseException as exc:
            call.end(exc)
            raise
        finally:
            OUTGOING.reset(token)
        finish(call, kind, result)
        return result

    return infer


def _aio_infer(fn: Callable, kind: Kind) -> Callable:
    @functools.wraps(fn)
    async def infer(self, model_name, inputs, *args, **kwargs):
        call = start(kind, model_name, inputs, version(args, kwargs)) if recording() else None
        if call is None:
            return await fn(self, model_name, inputs, *args, **kwargs)
        token = OUTGOING.set(outgoing(self, call))
        try:
            result = await fn(self, model_name, inputs, *args, **kwargs)
        except BaseException as exc:  # CancelledError too: recorded as cancelled
            call.end(exc)
            raise
        finally:
            OUTGOING.reset(token)
        finish(call, kind, result)
        return result

    return infer


def _grpc_async_infer(fn: Callable, kind: Kind) -> Callable:
    @functools.wraps(fn)
    def async_infer(self, model_name, inputs, callback, *args, **kwargs):
        call = start(kind, model_name, inputs, version(args, kwargs)) if recording() else None
        if call is None:
            return fn(self, model_name, inputs, callback, *args, **kwargs)

        def done(result=None, error=None):
            if error is not None:
                call.end(error)
            else:
                finish(call, kind, result)
            callback(result=result, error=error)  # as tritonclient calls it

        token = OUTGOING.set(outgoing(self, call))
        try:
            return fn(self, model_name, inputs, done, *args, **kwargs)
        except BaseException as exc:
            call.end(exc)
            raise
        finally:
            OUTGOING.reset(token)

    return async_infer


def _http_async_infer(fn: Callable, kind: Kind) -> Callable:
    # The client calls the plugin on a gevent greenlet, which does not see this context's
    # variables: the trace context goes in through the call's ``headers`` argument instead.
    headers_at = _position(fn, "headers", fixed=3)

    @functools.wraps(fn)
    def async_infer(self, model_name, inputs, *args, **kwargs):
        call = start(kind, model_name, inputs, version(args, kwargs)) if recording() else None
        if call is None:
            return fn(self, model_name, inputs, *args, **kwargs)
        context = outgoing(self, call)
        if context is not None:
            try:
                if headers_at is not None and len(args) > headers_at:
                    args = (
                        *args[:headers_at],
                        with_trace_context(args[headers_at], context),
                        *args[headers_at + 1 :],
                    )
                else:
                    kwargs["headers"] = with_trace_context(kwargs.get("headers"), context)
            except Exception:
                _logger.exception("inferprof could not add trace context to a Triton request")
        try:
            pending = fn(self, model_name, inputs, *args, **kwargs)
        except BaseException as exc:
            call.end(exc)
            raise
        return _TimedAsyncRequest(pending, call, kind)

    return async_infer


def _position(fn: Callable, name: str, fixed: int) -> int | None:
    """Index of parameter ``name`` among the positional arguments after the first
    ``fixed`` ones (``self`` included); None when it cannot be passed positionally."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == name and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return i - fixed if i >= fixed else None
    return None


class _TimedAsyncRequest:
    """The HTTP client's ``InferAsyncRequest``, whose ``get_result()`` ends the stage."""

    __slots__ = ("_call", "_kind", "_pending")

    def __init__(self, pending: Any, call: NetworkCall, kind: Kind) -> None:
        self._pending = pending
        self._call = call
        self._kind = kind

    def get_result(self, block=True, timeout=None):
        try:
            result = self._pending.get_result(block=block, timeout=timeout)
        except BaseException as exc:
            # ``block=False`` raises while the request is still in flight: not an end.
            if block or _finished(self._pending):
                self._call.end(exc)
            raise
        finish(self._call, self._kind, result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pending, name)


def _finished(pending: Any) -> bool:
    greenlet = async_request_greenlet(pending)
    try:
        return greenlet is None or bool(greenlet.ready())
    except Exception:  # another client version: take the failure as the end
        _logger.debug("inferprof could not tell whether a Triton request ended", exc_info=True)
        return True


# --- the four clients ---------------------------------------------------------------------

HTTP = Kind(
    "http",
    semconv.TRITON_PROTOCOL_HTTP,
    http_sent,
    http_received,
    {"infer": _sync_infer, "async_infer": _http_async_infer},
)
GRPC = Kind(
    "grpc",
    semconv.TRITON_PROTOCOL_GRPC,
    grpc_sent,
    grpc_received,
    {
        "infer": _sync_infer,
        "async_infer": _grpc_async_infer,
        "start_stream": _streams.start_stream,
        "async_stream_infer": _streams.async_stream_infer,
        "stop_stream": _streams.stop_stream,
    },
)
HTTP_AIO = Kind(
    "http.aio", semconv.TRITON_PROTOCOL_HTTP, http_sent, http_received, {"infer": _aio_infer}
)
GRPC_AIO = Kind(
    "grpc.aio",
    semconv.TRITON_PROTOCOL_GRPC,
    grpc_sent,
    grpc_received,
    {"infer": _aio_infer, "stream_infer": _streams.stream_infer},
)


def kind_of(client: Any) -> Kind | None:
    """The family of a tritonclient ``InferenceServerClient`` (or a subclass of one),
    found from the class's module: nothing is imported to tell."""
    for cls in type(client).__mro__:
        if cls.__name__ != "InferenceServerClient":
            continue
        module = cls.__module__ + "."
        if module.startswith("tritonclient.http.aio."):
            return HTTP_AIO
        if module.startswith("tritonclient.grpc.aio."):
            return GRPC_AIO
        if module.startswith("tritonclient.http."):
            return HTTP
        if module.startswith("tritonclient.grpc."):
            return GRPC
    return None


_SUBCLASSES: dict[type, type] = {}


def _instrumented_class(cls: type, kind: Kind) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": cls.__qualname__}
        for name, factory in kind.methods.items():
            fn = getattr(cls, name, None)
            if fn is not None:
                namespace[name] = factory(fn, kind)
        sub = _SUBCLASSES.setdefault(cls, type(cls.__name__, (cls,), namespace))
    return sub


def patch(client: Any, state: State) -> None:
    vars(client)[STATE_KEY] = state
    client.__class__ = _instrumented_class(state.cls, state.kind)


def unpatch(client: Any, state: State) -> None:
    client.__class__ = state.cls
    vars(client).pop(STATE_KEY, None)
    stream, state.stream = state.stream, None
    if stream is not None:
        stream.close()


__all__ = ["GRPC", "GRPC_AIO", "HTTP", "HTTP_AIO", "kind_of", "patch", "unpatch"]
