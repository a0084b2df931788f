"""Optional bearer-token authentication for every collector listener.

One token, compared in constant time. gRPC calls without ``authorization: Bearer
<token>`` metadata end with ``UNAUTHENTICATED``; HTTP requests without the header
get 401 with ``WWW-Authenticate: Bearer``. ``/healthz`` stays open so liveness
probes need no secret (it reveals nothing but "up").
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

_log = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "authorization"
BEARER_PREFIX = "bearer "
_BEARER = BEARER_PREFIX.encode()
#: HTTP paths served without a token.
OPEN_PATHS = frozenset({"/healthz"})


def token_matches(header_value: str | bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` value carries ``token`` (scheme case-insensitive).

    Compared as bytes: an HTTP header arrives as bytes, which are the token's UTF-8 bytes
    (or, from clients that encode headers as Latin-1, such as Python's ``http.client``
    under the OpenTelemetry HTTP exporter, its Latin-1 bytes when it has them); a gRPC
    metadata value arrives as text and is compared as its UTF-8 bytes."""
    if header_value is None:
        return False
    if isinstance(header_value, str):
        header_value = header_value.encode("utf-8", "replace")
    if header_value[: len(_BEARER)].lower() != _BEARER:
        return False
    given = header_value[len(_BEARER) :].strip()
    utf8 = hmac.compare_digest(given, token.encode("utf-8"))
    try:
        latin1 = hmac.compare_digest(given, token.encode("latin-1"))
    except UnicodeEncodeError:
        latin1 = False
    return utf8 or latin1


class GrpcAuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose metadata lacks the bearer token, before the handler runs."""

    def __init__(self, token: str, on_reject: Callable[[str], None] | None = None) -> None:
        self._token = token
        self._on_reject = on_reject

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(
            deny, request_deserializer=lambda b: b, response_serializer=lambda b: b
        )

    def intercept_service(self, continuation, handler_call_details):
        metadata: Iterable[tuple[str, Any]] = handler_call_details.invocation_metadata or ()
        value = next((v for k, v in metadata if k.lower() == AUTHORIZATION_HEADER), None)
        if token_matches(value, self._token):
            return continuation(handler_call_details)
        if self._on_reject is not None:
            try:
                self._on_reject(handler_call_details.method)
            except Exception:  # a metrics hiccup must not change the answer
                _log.debug("auth reject hook failed", exc_info=True)
        return self._deny


ASGIApp = Callable[
    [dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]
]


class BearerAuthMiddleware:
    """Pure ASGI middleware: 401 unless ``Authorization: Bearer <token>``; passes
    ``OPEN_PATHS`` and non-HTTP scopes through."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str,
        open_paths: Iterable[str] = OPEN_PATHS,
        on_reject: Callable[[str], None] | None = None,
        otlp: bool = False,
    ) -> None:
        self.app = app
        self._token = token
        self._open = frozenset(open_paths)
        self._on_reject = on_reject
        #: an OTLP receiver answers in the request's encoding (a google.rpc.Status);
        #: the API answers ``{"error": ...}`` like its other errors
        self._otlp = otlp

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self._open:
            await self.app(scope, receive, send)
            return
        value = None
        for key, val in scope.get("headers") or ():
            if key.lower() == AUTHORIZATION_HEADER.encode():
                value = val
                break
        if token_matches(value, self._token):
            await self.app(scope, receive, send)
            return
        if self._on_reject is not None:
            try:
                self._on_reject(scope.get("path", ""))
            except Exception:  # a metrics hiccup must not change the answer
                _log.debug("auth reject hook failed", exc_info=True)
        reason = "missing or wrong bearer token"
        if self._otlp:
            from inferprof.collector.decode import error_body, format_of

            content_type = next((v.decode("latin-1") for k, v in scope.get("headers") or ()
                                 if k.lower() == b"content-type"), None)
            body, ctype = error_body(reason, format_of(content_type), 401)
        else:
            body, ctype = json.dumps({"error": reason}).encode(), "application/json"
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", ctype.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="inferprof"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


__all__ = ["OPEN_PATHS", "BearerAuthMiddleware", "GrpcAuthInterceptor", "token_matches"]
