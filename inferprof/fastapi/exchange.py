"""One HTTP request's record: the wrapped ``receive`` and ``send`` that time it.

``receive`` is timed from the app's first read to the last body chunk, ``serialize`` from
``http.response.start`` to the last body chunk, counting ``inferprof.bytes`` both ways,
without buffering. Streamed responses (``text/event-stream``, or a body sent in several
messages without ``content-length``) are timed chunk by chunk for generation (contract
§7, §14): the time each chunk carrying generated content was handed to the server is an
emission, one token per chunk unless the app says otherwise (:func:`chunk_tokens`). A
client that goes away mid-stream marks the request ``inferprof.cancelled``.

The middleware (:mod:`inferprof.fastapi.middleware`) opens and closes these records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry.semconv.attributes import http_attributes

from inferprof import semconv
from inferprof.fastapi.routes import route_template
from inferprof.instrumentation.generation import COMPACT_AT, generation_attributes, merge_pairs
from inferprof.instrumentation.records import SCOPE, RequestRecord, StageRecord, ends_in_error

_logger = logging.getLogger("inferprof.fastapi.middleware")  # (the records are the middleware's)
_time_ns = time.time_ns
_STAGE_RECEIVE = semconv.STAGE_RECEIVE
_STAGE_SERIALIZE = semconv.STAGE_SERIALIZE
_ATTR_BYTES = semconv.ATTR_BYTES
_ROUTE = http_attributes.HTTP_ROUTE
_STATUS_CODE = http_attributes.HTTP_RESPONSE_STATUS_CODE
# Streamed responses (generation timing): not streamed, a chunked body, server-sent events.
NOT_STREAMED, _CHUNKED, _SSE = 0, 1, 2
#: The chunk that ends an OpenAI-style event stream (no content).
_SSE_DONE = (b"data: [DONE]", b"data:[DONE]")
#: How an event stream's usual chunk starts: a data: field holding a JSON object.
_SSE_JSON = (b"data: {", b"data:{")
#: Emission times send()'s short path appends to at most: one more goes through
#: _chunk_sent(), which merges at COMPACT_AT.
_FAST_TIMES_MAX = COMPACT_AT - 1

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Content:
    """Body prefixes of one request, kept only when content recording is opted in."""

    __slots__ = ("limit", "request", "response")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.request = bytearray()
        self.response = bytearray()

    def add(self, buf: bytearray, body: bytes) -> None:
        if len(buf) < self.limit:
            buf += body[: self.limit - len(buf)]


class HttpRequest(RequestRecord):
    """The record of one HTTP request, holding the middleware's state too, and the wrapped
    ``receive``/``send`` the app is given (bound methods): one object per request where
    a separate exchange object and two closures made four.

    ``receive`` and ``serialize`` are kept as timestamps on the record, and the HTTP
    attributes (route, status) as the values they come from: their stage records and
    attributes are made in :meth:`_complete`, only for a request whose trace is kept (in
    ``production`` mode most are not).
    """

    __slots__ = (
        "_otel_token",
        "_receive",
        "_scope_token",
        "_send",
        "chunk_merged",
        "chunk_times",
        "chunk_tokens",
        "content",
        "disconnected",
        "live_scope",
        "next_tokens",
        "received",
        "recv_end",
        "recv_start",
        "root_path",
        "route",
        "route_model",
        "sent",
        "ser_end",
        "ser_start",
        "sse_times",
        "status",
        "stream",
        "summary_model",
        "untimed_mark",
    )

    async def receive(self) -> Message:
        if self.recv_end:  # the body is in: later reads (disconnect listeners) pass through
            message = await self._receive()
            if message["type"] == "http.disconnect" and not self.ser_end:
                self.disconnected = True  # the client left before the response's end
            return message
        t0 = _time_ns()
        message = await self._receive()
        if message["type"] == "http.request":
            if not self.recv_start:
                self.recv_start = t0
            body = message.get("body")
            if body:
                self.received += len(body)
                if self.content is not None:
                    self.content.add(self.content.request, body)
            if not message.get("more_body", False):
                self.recv_end = _time_ns()
        elif message["type"] == "http.disconnect" and not self.ser_end:
            self.disconnected = True
        return message

    async def send(self, message: Message) -> None:
        times = self.sse_times
        if times is not None:
            # The usual chunk of an event stream: one token, as a data: field holding a
            # JSON object (so not [DONE]); what the general path below does for it, in
            # fewer steps. Any other chunk takes the general path.
            body = message.get("body")
            if (body.__class__ is bytes and message.get("more_body")
                    and message["type"] == "http.response.body"
                    and body.startswith(_SSE_JSON)):
                self.sent += len(body)
                handed = _time_ns()
                try:
                    await self._send(message)
                except OSError:
                    if not self.ser_end:
                        self.disconnected = True
                    raise
                times.append(handed)
                if len(times) >= _FAST_TIMES_MAX:
                    self.sse_times = None  # the next one may need merging (_chunk_sent)
                return
        if message["type"] == "http.response.body":
            body = message.get("body")
            more = message.get("more_body", False)
            if body:
                self.sent += len(body)
                if self.content is not None:
                    self.content.add(self.content.response, body)
            if self.live_scope is not None and not more:
                # The outer instrumentation (opentelemetry-instrumentation-asgi) ends its
                # span when the last body chunk passes it: its attributes go on now.
                self._enrich_live()
            stream = self.stream
            # When a chunk of a stream leaves: handed to the server, which writes it to the
            # socket in this call (a time taken after the call may follow the client's read)
            handed = 0
            if stream and body:
                if stream == _SSE:
                    # content: a data: field other than the [DONE] OpenAI-style streams
                    # end with (comments, keep-alives and bare event: lines dispatch nothing).
                    # find(), not `in`: bytes.__contains__ tries the operand as an int first
                    # and builds a TypeError for every chunk.
                    text = body if type(body) is bytes else bytes(body)  # (ASGI: bytes)
                    if text.find(b"data:") != -1 and text.strip() not in _SSE_DONE:
                        handed = _time_ns()
                # a body in one message is not a stream, whatever its headers
                elif more or self.chunk_times:
                    handed = _time_ns()
            try:
                await self._send(message)
            except OSError:  # ASGI 2.4 servers: the client went away mid-response
                if not self.ser_end:
                    self.disconnected = True
                raise
            if handed:  # (not for a chunk the server refused)
                times = self.chunk_times
                if (times is not None and self.next_tokens == 1 and self.chunk_tokens is None
                        and len(times) < _FAST_TIMES_MAX):
                    times.append(handed)  # the usual chunk: what _chunk_sent() does for it
                else:
                    self._chunk_sent(handed)
            if stream == _SSE:
                self.sse_times = self._fast_times()
            if not more and not self.ser_end:
                self.ser_end = _time_ns()  # also the request's end: the last byte handed over
            return
        if message["type"] == "http.response.start":
            self.status = message.get("status")
            self.ser_start = _time_ns()
            self.stream = stream = _stream_kind(message.get("headers"))
            if stream == _SSE and self.content is None and self.chunk_times is None:
                self.chunk_times = []  # (empty: no emission, as None)
                self.sse_times = self._fast_times()
        await self._send(message)

    def _fast_times(self) -> list[int] | None:
        """``chunk_times`` while the next chunk of an event stream takes send()'s short
        path: one token, no body recorded, no merge due."""
        times = self.chunk_times
        if (times is not None and self.next_tokens == 1 and self.chunk_tokens is None
                and self.content is None and len(times) < _FAST_TIMES_MAX):
            return times
        return None

    def _chunk_sent(self, when: int) -> None:
        """A chunk of generated content was handed to the server at ``when``: one emission
        (none for a chunk the app said carries no token)."""
        tokens, self.next_tokens = self.next_tokens, 1
        if not tokens:
            return
        times = self.chunk_times
        if times is None:
            times = self.chunk_times = []
        times.append(when)
        counts = self.chunk_tokens
        if counts is not None:
            counts.append(tokens)
        elif tokens != 1:
            counts = self.chunk_tokens = [1] * (len(times) - 1)
            counts.append(tokens)
        if len(times) >= COMPACT_AT:  # a runaway stream: bounded memory (generation module)
            if counts is None:
                counts = self.chunk_tokens = [1] * len(times)
            self.chunk_merged += merge_pairs(times, counts)

    def _summary_parts(self, flat: list) -> bool:
        # What _complete() makes, for a request with no engine stages (the runtime does
        # not summarise those): receive and serialize, and an error for a 5xx answer.
        ser_start = self.ser_start
        if self.recv_start and self.received:
            if ser_start:  # the usual case: both
                flat += (_STAGE_RECEIVE, self.recv_start, self.recv_end,
                         _STAGE_SERIALIZE, ser_start, self.ser_end)
            else:
                flat += (_STAGE_RECEIVE, self.recv_start, self.recv_end)
        elif ser_start:
            flat += (_STAGE_SERIALIZE, ser_start, self.ser_end)
        error = self.error
        if error is None:  # _complete() makes a 5xx answer the error
            status = self.status
            return status is not None and status >= 500
        return ends_in_error(error)

    def _summarised(self, model: str | None) -> bool | int:
        self.summary_model = model
        # (a route state other than a model equals none)
        return self.untimed_mark if self.route_model == model else False

    def _complete(self) -> None:
        # A body-less request (GET; or a streaming response listening for disconnects)
        # has nothing to time: no `receive` stage for it.
        if self.recv_start and self.received:
            self.stages.insert(
                0,
                _ended_stage(_STAGE_RECEIVE, self.recv_start, self.recv_end, self.received),
            )
        if self.ser_start:
            start = self.ser_start
            if self.chunk_times and self.generation is not None:
                # A stream the engine's stages cover (queue, prefill, decode): serialize is
                # what follows its last token, so that the stages do not overlap (§14).
                start = min(self.chunk_times[-1], self.ser_end or start)
            self.stages.append(_ended_stage(_STAGE_SERIALIZE, start, self.ser_end, self.sent))
        status = self.status
        if status is not None and status >= 500 and self.error is None:
            self.error = f"HTTP {status}"
        generation = None
        if self.chunk_times or self.generation is not None:
            generation = generation_attributes(self, self._emissions())
        if self.live_span is not None:  # another instrumentation's span
            if self.live_scope is not None:  # no last body chunk went out (the app failed)
                self._enrich_live()
            if generation:  # on it while it records (it may have ended at the last chunk)
                self.set_attributes(generation)
            return
        # Our own request span: its attributes go straight into the record (what
        # set_attribute() does, minus the check for a live span).
        self._http_attributes(self.attrs.__setitem__)
        if generation:
            self.attrs.update(generation)

    def _emissions(self) -> tuple[list[int], list[int] | None, int] | None:
        """When the response's tokens left: each streamed chunk's time; for a generation
        the engine recorded (the step API) answered in one body, the response's end."""
        if self.chunk_times:
            return self.chunk_times, self.chunk_tokens, self.chunk_merged
        gen = self.generation
        if gen is not None and gen.output and self.ser_end and not self.stream:
            return [self.ser_end], [gen.output], 0
        return None

    def _enrich_live(self) -> None:
        """The HTTP attributes on another instrumentation's request span, while it still
        records (once)."""
        scope, self.live_scope = self.live_scope, None
        try:
            self.route = route_template(scope, self.root_path or "")
        except Exception:
            _logger.exception("inferprof could not find the request's route")
        self._http_attributes(self.set_attribute)

    def _http_attributes(self, set_attribute: Callable[[str, Any], None]) -> None:
        if self.route:
            set_attribute(_ROUTE, self.route)
        if self.disconnected:  # e.g. a user stopping a streamed generation
            set_attribute(semconv.ATTR_CANCELLED, True)
        if self.status is not None:
            set_attribute(_STATUS_CODE, self.status)
        content = self.content
        if content is not None:
            set_attribute(
                semconv.ATTR_REQUEST_BODY, bytes(content.request).decode("utf-8", "replace")
            )
            set_attribute(
                semconv.ATTR_RESPONSE_BODY, bytes(content.response).decode("utf-8", "replace")
            )
            self.content = None


def _stream_kind(headers: Any) -> int:
    """How a response is sent, from its ``http.response.start`` headers (lower-case names,
    as ASGI servers and Starlette send them)."""
    if not headers:
        return _CHUNKED
    fields = dict(headers)
    if fields.get(b"content-type", b"")[:17].lower() == b"text/event-stream":
        return _SSE
    return NOT_STREAMED if b"content-length" in fields else _CHUNKED


def chunk_tokens(tokens: int) -> None:
    """The next body chunk of the current request's streamed response carries ``tokens``
    output tokens (default: one per chunk); 0: it carries none and is no emission (an
    OpenAI-style chat stream's first chunk, which names the role only). Call it before
    yielding the chunk; a no-op outside a request the middleware times."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    scope = SCOPE.get()
    if scope is not None and isinstance(scope[0], HttpRequest):
        rec = scope[0]
        rec.next_tokens = tokens
        rec.sse_times = None  # the next chunk takes send()'s general path


def _ended_stage(name: str, start: int, end: int, nbytes: int) -> StageRecord:
    st = StageRecord(name, None, start, {_ATTR_BYTES: nbytes})
    st.end = end
    return st


__all__ = ["NOT_STREAMED", "HttpRequest", "Message", "Receive", "Scope", "Send", "chunk_tokens"]
