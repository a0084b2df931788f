"""Run the LLM demo service under uvicorn and say which port it got.

``python -m inferprof.demo.llm.serve --port 0`` binds 127.0.0.1 on a free port and
prints ``{"port": N, "pid": P}`` once it accepts connections, as
``python -m inferprof.demo.serve`` does. Options come from the env
(:class:`~inferprof.demo.llm.settings.LLMSettings`); SIGINT/SIGTERM stop it gracefully:
the engine stops and telemetry is flushed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from inferprof.demo.llm.settings import LLMSettings
from inferprof.demo.serve import DEFAULT_HOST, serve_app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferprof.demo.llm.serve",
                                     description="Run the inferprof LLM demo service.")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    args = parser.parse_args(argv)
    from inferprof.demo.llm.service import create_app

    serve_app(create_app(LLMSettings.from_env()), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
