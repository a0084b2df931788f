"""gRPC streams: one ``network`` stage per stream.

The sync client's stream runs from ``start_stream`` to ``stop_stream`` (which returns once
every response has been handled); the ``aio`` client's from ``stream_infer`` to the end of
its response iterator (or its ``cancel()``). The stage counts the inference requests sent
and the responses received, takes its model name from the first request, and carries the
first error response as its error. Triton reads the trace context once per stream, from
the stream's opening metadata, so every request on a stream continues the trace of the
request that opened it: open a stream per request for a per-request view. A stream left
open past its request ends with the request (the runtime closes open stages there).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from inferprof import semconv
from inferprof.triton._call import OUTGOING, NetworkCall, begin, recording
from inferprof.triton._kinds import Kind, outgoing, state_of, version

_logger = logging.getLogger(__name__)


class _Stream:
    """One stream's stage: requests and responses counted, the first error kept."""

    __slots__ = ("call", "error", "kind", "requests", "responses")

    def __init__(self, call: NetworkCall, kind: Kind) -> None:
        self.call = call
        self.kind = kind
        self.requests = 0
        self.responses = 0
        self.error: BaseException | None = None

    def sent(self, model_name: Any, inputs: Any, model_version: Any) -> None:
        try:
            if self.requests == 0 and model_name is not None:
                attrs = {semconv.ATTR_TRITON_MODEL_NAME: str(model_name)}
                if model_version:
                    attrs[semconv.ATTR_TRITON_MODEL_VERSION] = str(model_version)
                self.call.set_attributes(attrs)
            self.requests += 1
            self.call.add_bytes(sent=self.kind.sent(inputs or ()))
        except Exception:
            _logger.debug("inferprof could not record a Triton stream request", exc_info=True)

    def received(self, result: Any, error: Any) -> None:
        self.responses += 1
        if error is not None:
            if self.error is None:
                self.error = error
            return
        if result is not None:
            try:
                self.call.add_bytes(received=self.kind.received(result))
            except Exception:
                _logger.debug("inferprof could not count a Triton response's bytes", exc_info=True)

    def close(self, error: BaseException | None = None) -> None:
        call = self.call
        if call.ended:
            return
        call.set_attributes(
            {
                semconv.ATTR_TRITON_STREAM_REQUESTS: self.requests,
                semconv.ATTR_TRITON_STREAM_RESPONSES: self.responses,
            }
        )
        call.end(error if error is not None else self.error)

    def callback(self, callback: Callable) -> Callable:
        def on_response(result=None, error=None):
            self.received(result, error)
            callback(result=result, error=error)

        return on_response

    async def inputs(self, iterator: Any):
        async for item in iterator:
            if isinstance(item, dict):
                self.sent(item.get("model_name"), item.get("inputs"), item.get("model_version"))
            yield item


def start_stream(fn: Callable, kind: Kind) -> Callable:
    @functools.wraps(fn)
    def start_stream(self, callback, *args, **kwargs):
        call = begin({semconv.ATTR_TRITON_PROTOCOL: kind.protocol}) if recording() else None
        if call is None:
            return fn(self, callback, *args, **kwargs)
        stream = _Stream(call, kind)
        token = OUTGOING.set(outgoing(self, call))
        try:
            out = fn(self, stream.callback(callback), *args, **kwargs)
        except BaseException as exc:  # e.g. a stream is already open: that one is unchanged
            call.end(exc)
            raise
        finally:
            OUTGOING.reset(token)
        state_of(self).stream = stream
        return out

    return start_stream


def async_stream_infer(fn: Callable, kind: Kind) -> Callable:
    @functools.wraps(fn)
    def async_stream_infer(self, model_name, inputs, *args, **kwargs):
        stream = state_of(self).stream
        if stream is not None:
            stream.sent(model_name, inputs, version(args, kwargs))
        return fn(self, model_name, inputs, *args, **kwargs)

    return async_stream_infer


def stop_stream(fn: Callable, kind: Kind) -> Callable:
    @functools.wraps(fn)
    def stop_stream(self, *args, **kwargs):
        state = state_of(self)
        stream, state.stream = state.stream, None
        try:
            # Returns once the stream's responses have all been handled.
            out = fn(self, *args, **kwargs)
        except BaseException as exc:
            if stream is not None:
                stream.close(exc)
            raise
        if stream is not None:
            stream.close()
        return out

    return stop_stream


def stream_infer(fn: Callable, kind: Kind) -> Callable:
    @functools.wraps(fn)
    def stream_infer(self, inputs_iterator, *args, **kwargs):
        call = begin({semconv.ATTR_TRITON_PROTOCOL: kind.protocol}) if recording() else None
        if call is None:
            return fn(self, inputs_iterator, *args, **kwargs)
        stream = _Stream(call, kind)
        token = OUTGOING.set(outgoing(self, call))
        try:
            responses = fn(self, stream.inputs(inputs_iterator), *args, **kwargs)
        except BaseException as exc:
            call.end(exc)
            raise
        finally:
            OUTGOING.reset(token)
        return _StreamResponses(responses, stream)

    return stream_infer


class _StreamResponses:
    """The ``aio`` client's response iterator; the stage ends with the iteration."""

    __slots__ = ("_responses", "_stream")

    def __init__(self, responses: Any, stream: _Stream) -> None:
        self._responses = responses
        self._stream = stream

    def __aiter__(self) -> _StreamResponses:
        return self

    async def __anext__(self):
        try:
            item = await self._responses.__anext__()
        except StopAsyncIteration:
            self._stream.close()
            raise
        except BaseException as exc:
            self._stream.close(exc)
            raise
        result, error = item
        self._stream.received(result, error)
        return item

    def cancel(self):
        out = self._responses.cancel()
        self._stream.close(asyncio.CancelledError())  # recorded as cancelled, not an error
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._responses, name)


__all__ = ["async_stream_infer", "start_stream", "stop_stream", "stream_infer"]
