"""The LLM demo service and its load generator as child processes (see demo/processes.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from typing import Any

from inferprof._shadowing import python_module_command
from inferprof.demo.llm.service import COMPLETIONS_PATH
from inferprof.demo.llm.settings import LLMSettings
from inferprof.demo.processes import ServiceProcess

_LOADGEN_SLACK_S = 90.0


class LLMServiceProcess(ServiceProcess):
    """``python -m inferprof.demo.llm.serve`` on 127.0.0.1:<ephemeral>."""

    module = "inferprof.demo.llm.serve"
    path = COMPLETIONS_PATH

    def child_env(self, settings: Any) -> dict[str, str]:
        if not isinstance(settings, LLMSettings):
            raise TypeError(f"LLMServiceProcess needs LLMSettings, got {type(settings).__name__}")
        return settings.env()


def run_llm_loadgen(url: str, *, duration_s: float, concurrency: int | None = None,
                    rate: float | None = None, prompt_mix: str | None = None,
                    output_mix: str | None = None, seed: int = 0,
                    extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """Run the LLM load generator in its own process; return its JSON summary."""
    cmd = python_module_command("inferprof.demo.llm.loadgen", url, "--json",
                                "--duration", str(duration_s), "--seed", str(seed))
    if rate is not None:
        cmd += ["--rate", str(rate)]
    elif concurrency is not None:
        cmd += ["--concurrency", str(concurrency)]
    if prompt_mix:
        cmd += ["--prompt-mix", prompt_mix]
    if output_mix:
        cmd += ["--output-mix", output_mix]
    cmd += list(extra_args)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, check=False,
                          timeout=duration_s + _LOADGEN_SLACK_S)
    if done.returncode != 0:
        raise RuntimeError(f"LLM load generator failed with exit status {done.returncode}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


__all__ = ["LLMServiceProcess", "run_llm_loadgen"]
