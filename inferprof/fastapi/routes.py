"""The path template of the route that served an HTTP request, for its span's name.

Starlette's router records the route it matched in ``scope["route"]``; where it did not
(FastAPI's own pages, mounted non-Starlette apps), the app's routes are matched again.
Starlette is imported on first use only: nothing here needs it installed.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]


def route_template(scope: Scope, open_root: str) -> str | None:
    """The path template of the route that served the request, mount prefixes included
    (``/v1/generate/{m}`` for ``app.mount("/v1", sub)``); None when no route matched.

    Starlette's router records the route it matched in ``scope["route"]``; a mounted
    app's router overwrites it with its own and extends ``root_path`` by the mount's
    path, which is where the prefix comes from. FastAPI 0.16x records only its own
    routes there (not ``/docs``, ``/openapi.json`` or mounted non-Starlette apps): for
    those the app's routes are matched again here.
    """
    root = scope.get("root_path") or ""
    prefix = root[len(open_root):] if root != open_root and root.startswith(open_root) else ""
    route = scope.get("route")
    if route is None:
        route, prefix = _match_route(scope, open_root, prefix)
        if route is None:
            return None
    path = getattr(route, "path", None)
    if not isinstance(path, str):
        return None
    if prefix and _is_mount(route) and prefix.endswith(path):
        return prefix  # the matched route is a mount, already in root_path
    return prefix + path


def _match_route(scope: Scope, open_root: str, prefix: str) -> tuple[Any, str]:
    """(route, prefix) of the app's route that fully matches the request, else (None, "")."""
    routes = getattr(scope.get("app"), "routes", None)
    if not routes:  # a pure ASGI app: no routes to match
        return None, ""
    routing = _starlette_routing()
    if routing is None:
        return None, ""
    # As served (the innermost Starlette app, its root_path); then from the root path the
    # request came in with (a mount whose app is not a Starlette app extends root_path
    # without a router of its own).
    candidates = [(scope, prefix)]
    if prefix:
        candidates.append(({**scope, "root_path": open_root}, ""))
    for candidate, candidate_prefix in candidates:
        for route in routes:
            try:
                match, _ = route.matches(candidate)
            except Exception:
                continue
            if match is routing.Match.FULL:
                return route, candidate_prefix
    return None, ""


def _starlette_routing() -> Any:
    """``starlette.routing``, or None without Starlette; imported once, on first use (a
    route matched again per request must not run the import machinery each time)."""
    global _routing
    if _routing is _UNSEEN:
        try:
            from starlette import routing as found
        except ImportError:
            found = None  # type: ignore[assignment]
        _routing = found
    return _routing




def _is_mount(route: Any) -> bool:
    routing = _starlette_routing()
    return routing is not None and isinstance(route, routing.Mount)


_UNSEEN: Any = object()
_routing: Any = _UNSEEN


__all__ = ["route_template"]
