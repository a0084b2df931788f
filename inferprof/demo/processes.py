"""Start and stop the demo service and the load generator as separate processes.

The demo, the integration tests and the overhead benchmark all need the same
thing: the service under real uvicorn in its own process (so its CPU time can be
read from ``/proc`` and it competes with the client the way a real server does),
and the load generator in another. :class:`ServiceProcess` always stops what it
started, even when startup fails half-way.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import IO, Any

from inferprof._shadowing import python_module_command
from inferprof.demo.service import CLASSIFY_PATH, HEALTH_PATH
from inferprof.demo.settings import (
    ENV_ENDPOINT,
    ENV_GC_FREEZE,
    ENV_GC_THRESHOLD,
    ENV_INSTRUMENTATION,
    ENV_MAX_BATCH_SIZE,
    ENV_MAX_DELAY_MS,
    ENV_MAX_TOKENS,
    ENV_MODEL_SIZE,
    ENV_SERVICE_NAME,
    DemoSettings,
)

_STARTUP_TIMEOUT_S = 60.0
# One BLAS thread: the service already runs an event loop and a batch worker, and on a
# small machine extra BLAS threads spin against them (measured on 2 cores: half the
# CPU per request and a 5x lower p99). A caller's own setting wins.
_THREAD_DEFAULTS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_STOP_TIMEOUT_S = 15.0


def settings_env(settings: DemoSettings) -> dict[str, str]:
    """The ``INFERPROF_DEMO_*`` variables that reproduce ``settings`` in a child process."""
    env = {
        ENV_INSTRUMENTATION: settings.instrumentation,
        ENV_MODEL_SIZE: settings.model_size,
        ENV_MAX_BATCH_SIZE: str(settings.max_batch_size),
        ENV_MAX_DELAY_MS: str(settings.max_delay_ms),
        ENV_SERVICE_NAME: settings.service_name,
        ENV_MAX_TOKENS: str(settings.max_tokens),
        ENV_GC_FREEZE: "1" if settings.gc_freeze else "0",
        ENV_GC_THRESHOLD: str(settings.gc_threshold),
    }
    if settings.endpoint:
        env[ENV_ENDPOINT] = settings.endpoint
    return env


class ServiceProcess:
    """The demo service under uvicorn in a child process, bound to 127.0.0.1:<ephemeral>.

    Subclasses run another service the same way: ``module`` is what ``python -m`` runs
    (it must announce its port as ``inferprof.demo.serve`` does), ``path`` the endpoint
    ``url`` names, and ``child_env`` the variables that carry the settings.
    """

    module = "inferprof.demo.serve"
    path = CLASSIFY_PATH

    def __init__(self, settings: Any, *, extra_env: Mapping[str, str] | None = None,
                 startup_timeout_s: float = _STARTUP_TIMEOUT_S) -> None:
        self.settings = settings
        self._env = {**_THREAD_DEFAULTS, **os.environ, **self.child_env(settings),
                     **(extra_env or {})}
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self.port: int | None = None

    def child_env(self, settings: Any) -> dict[str, str]:
        return settings_env(settings)

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("service not started")
        return self._proc.pid

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("service not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base_url + self.path

    def start(self) -> ServiceProcess:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self._proc = subprocess.Popen(
            python_module_command(self.module, "--port", "0"),
            stdout=subprocess.PIPE, stderr=self._stderr, env=self._env,
        )
        try:
            self.port = self._read_port()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _read_port(self) -> int:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + self._startup_timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=0.2):
                    line = self._proc.stdout.readline()
                    port = _announced_port(line)
                    if port is not None:
                        return port
                if self._proc.poll() is not None:
                    break
        raise RuntimeError(f"demo service did not start:\n{self.stderr_text()}")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.base_url + HEALTH_PATH, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"demo service is not healthy:\n{self.stderr_text()}"
                    ) from None
                time.sleep(0.05)

    def stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> int | None:
        """Graceful stop (SIGTERM: uvicorn drains, the app flushes telemetry), then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            return proc.returncode
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def close(self) -> None:
        self.stop()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _announced_port(line: bytes) -> int | None:
    """The port from serve.py's ``{"port": N}`` line; None for anything else on stdout."""
    try:
        return int(json.loads(line)["port"])
    except (ValueError, KeyError, TypeError):
        return None


def run_loadgen(url: str, *, duration_s: float, concurrency: int | None = None,
                rate: float | None = None, burst: int = 1, mix: str | None = None,
                seed: int = 0, extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """Run the load generator in its own process; return its JSON summary."""
    cmd = python_module_command("inferprof.demo.loadgen", url, "--json",
                                "--duration", str(duration_s), "--seed", str(seed))
    if rate is not None:
        cmd += ["--rate", str(rate), "--burst", str(burst)]
    elif concurrency is not None:
        cmd += ["--concurrency", str(concurrency)]
    if mix:
        cmd += ["--mix", mix]
    cmd += list(extra_args)
    # stderr is inherited so its progress bar reaches the user's terminal.
    done = subprocess.run(cmd, stdout=subprocess.PIPE, check=False,
                          timeout=duration_s + _STARTUP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed with exit status {done.returncode}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


__all__ = ["ServiceProcess", "run_loadgen", "settings_env"]
