"""The private asyncio shape inferprof relies on (inferprof.instrumentation.asyncio_compat)."""

from __future__ import annotations

import asyncio
import threading

from inferprof.instrumentation import asyncio_compat


def test_the_private_function_is_used_and_answers_none_without_a_loop() -> None:
    # a release without it would fall back to the slower public wrapper: fail loudly
    assert asyncio_compat.running_loop is asyncio._get_running_loop
    assert asyncio_compat.running_loop() is None


def test_it_names_the_running_loop_of_this_thread_only() -> None:
    seen: list[object] = []

    async def main() -> None:
        seen.append(asyncio_compat.running_loop())
        other: list[object] = []
        t = threading.Thread(target=lambda: other.append(asyncio_compat.running_loop()))
        t.start()
        t.join()
        seen.append(other[0])
        seen.append(asyncio.get_running_loop())

    asyncio.run(main())
    assert seen[0] is seen[2] and seen[0] is not None
    assert seen[1] is None  # another thread runs no loop
    assert asyncio_compat.running_loop() is None  # the loop ended


def test_the_public_fallback_answers_alike() -> None:
    fallback = asyncio_compat._public_running_loop
    assert fallback() is None

    async def main() -> object:
        return fallback() is asyncio.get_running_loop()

    assert asyncio.run(main()) is True
