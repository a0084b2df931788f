"""FastAPI / Starlette / any-ASGI integration: ``InferprofMiddleware`` and ``instrument(app)``.

Pure ASGI: nothing here imports FastAPI or Starlette. See ``docs/instrumenting.md``.
"""

from __future__ import annotations

from inferprof.fastapi.exchange import chunk_tokens
from inferprof.fastapi.middleware import InferprofMiddleware, instrument

__all__ = ["InferprofMiddleware", "chunk_tokens", "instrument"]
