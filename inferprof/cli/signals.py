"""Long-running commands (``collect``, ``gpu``) stop cleanly on SIGINT and SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def until_signal() -> Iterator[threading.Event]:
    """Yield an event that SIGINT or SIGTERM sets (instead of raising KeyboardInterrupt
    wherever the main thread happens to be); the previous handlers come back on exit."""
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        done.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield done
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["until_signal"]
