"""The one place inferprof reads what asyncio keeps private.

``asyncio.get_running_loop()`` raises ``RuntimeError`` in a thread running no event loop;
an engine thread asks that once per step (``Step.__enter__``), and building and catching
the exception costs several times the question. ``asyncio._get_running_loop()`` (listed
in ``asyncio.events.__all__``, "low-level") answers None instead. A Python without it
gets the public function, wrapped: slower, never wrong. The tests
(``tests/instrumentation/test_asyncio_compat.py``) assert its shape, so a release that
changes it fails there instead of slowing engine loops down unnoticed.
"""

from __future__ import annotations

import asyncio
from asyncio import AbstractEventLoop
from collections.abc import Callable


def _public_running_loop() -> AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


#: The event loop running in this thread, or None (never raises).
running_loop: Callable[[], AbstractEventLoop | None] = getattr(
    asyncio, "_get_running_loop", _public_running_loop)

__all__ = ["running_loop"]
