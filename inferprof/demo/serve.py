"""Run the demo service under uvicorn and say which port it got.

``python -m inferprof.demo.serve --port 0`` binds an ephemeral port on 127.0.0.1 and,
once the server accepts connections, prints one JSON line ``{"port": N, "pid": P}``
on stdout. Whoever started it (``inferprof demo``, the tests, the benchmark) reads
that line instead of guessing a free port, so there is no bind race. Service options
come from ``INFERPROF_DEMO_*`` env vars (see ``settings.py``) or the flags below.
SIGINT/SIGTERM stop it gracefully: the batcher is closed and telemetry flushed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from inferprof._optional import require
from inferprof.demo.settings import INSTRUMENTATIONS, DemoSettings

DEFAULT_HOST = "127.0.0.1"


def _server_class() -> Any:
    uvicorn = require("uvicorn", "demo")

    class _AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1]
                import os

                print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)

    return _AnnouncingServer


def run(settings: DemoSettings, host: str = DEFAULT_HOST, port: int = 0) -> None:
    from inferprof.demo.service import create_app

    serve_app(create_app(settings), host=host, port=port)


def serve_app(app: Any, host: str = DEFAULT_HOST, port: int = 0) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM, announcing the port on stdout."""
    uvicorn = require("uvicorn", "demo")
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=5)
    _server_class()(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferprof.demo.serve",
                                     description="Run the inferprof demo service.")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    parser.add_argument("--instrumentation", choices=INSTRUMENTATIONS)
    parser.add_argument("--model-size")
    parser.add_argument("--max-batch-size", type=int)
    parser.add_argument("--max-delay-ms", type=float)
    parser.add_argument("--endpoint", help="OTLP endpoint to export to")
    parser.add_argument("--service-name")
    args = parser.parse_args(argv)
    try:
        settings = DemoSettings.from_env(
            instrumentation=args.instrumentation, model_size=args.model_size,
            max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms,
            endpoint=args.endpoint, service_name=args.service_name,
        )
    except ValueError as exc:
        parser.error(str(exc))
    run(settings, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
