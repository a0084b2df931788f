"""``inferprof gpu``: the GPU sampler as a sidecar process, until SIGINT/SIGTERM.

Each option without a value given falls back to its ``INFERPROF_GPU_*`` variable, then to
the default (see ``docs/gpu.md``); the OTLP endpoint, protocol and headers follow the
``OTEL_EXPORTER_OTLP_*`` variables like ``inferprof.configure()``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import IO, Any

import click

from inferprof import _config
from inferprof import semconv as sc
from inferprof.gpu import sampler as _sampler
from inferprof.gpu.records import METRICS, GpuSample, Source, SourceUnavailable


def _field(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
    """``NAME=METRIC[*FACTOR]`` -> {NAME: (METRIC, FACTOR)}."""
    out = {}
    for value in values:
        name, sep, target = value.partition("=")
        metric, _, factor = target.partition("*")
        try:
            if not sep or not name or metric not in METRICS:
                raise ValueError
            out[name.strip()] = (metric.strip(), float(factor) if factor else 1.0)
        except ValueError:
            raise click.BadParameter(
                f"{value!r}: expected DCGM_SERIES=METRIC[*FACTOR], METRIC one of "
                f"{', '.join(sorted(METRICS))}") from None
    return out


class _Recording:
    """A source whose readings are also appended to a recording (``--record``)."""

    def __init__(self, inner: Source, fh: IO[str]) -> None:
        self.inner = inner
        self.name = inner.name
        self.default_interval = inner.default_interval
        self._fh = fh

    def open(self) -> None:
        self.inner.open()

    def read(self) -> list[GpuSample]:
        from inferprof.gpu.replay import write_samples

        samples = self.inner.read()
        write_samples(samples, self._fh)
        self._fh.flush()
        return samples

    def close(self) -> None:
        self.inner.close()


def _source(name: str | None, opts: dict[str, Any]) -> Source:
    name = _config._choice(name, _sampler.ENV_SOURCE, sc.GPU_SOURCES, sc.GPU_SOURCE_NVML,
                           "source")
    gpus = list(opts["gpus"]) or None
    if name == sc.GPU_SOURCE_NVML:
        from inferprof.gpu.nvml import NvmlSource

        devices = None if gpus is None else [int(g) if g.isdigit() else g for g in gpus]
        return NvmlSource(devices)
    if name == sc.GPU_SOURCE_DCGM_EXPORTER:
        from inferprof.gpu.dcgm_exporter import DEFAULT_URL, DcgmExporterSource

        url = opts["dcgm_url"] or _config._env(_sampler.ENV_DCGM_URL) or DEFAULT_URL
        return DcgmExporterSource(url, fields=opts["dcgm_fields"],
                                  host_label=opts["dcgm_host_label"])
    if name == sc.GPU_SOURCE_REPLAY:
        from inferprof.gpu.replay import ReplaySource

        path = opts["replay"] or _config._env(_sampler.ENV_REPLAY)
        if path is None:
            raise ValueError(f"--source replay needs --replay FILE (or {_sampler.ENV_REPLAY})")
        return ReplaySource(path, loop=opts["loop"])
    from inferprof.gpu.synthetic import DEFAULT_GPU_ID, SyntheticSource

    util = opts["utilization"]
    return SyntheticSource(gpus or (DEFAULT_GPU_ID,), utilization=0.5 if util is None else util,
                           sm_active=opts["sm_active"], sm_occupancy=opts["sm_occupancy"])


@click.command("gpu")
@click.option("--source", type=click.Choice(sc.GPU_SOURCES),
              help="Where samples come from (default nvml). replay and synthetic are NOT "
                   "live GPU data.")
@click.option("--interval", type=float,
              help="Seconds between polls (default: nvml 0.1, dcgm-exporter 1, replay and "
                   "synthetic 0.1).")
@click.option("--export-interval", type=float, help="Seconds between OTLP exports (default 1).")
@click.option("--endpoint", help="OTLP endpoint, e.g. http://collector:4317 (default: "
                                 "OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT, else localhost:4317).")
@click.option("--protocol", type=click.Choice(_config.PROTOCOLS),
              help="OTLP protocol (default: OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL, else grpc).")
@click.option("--host-name", help="host.name of the samples: must equal the one on the "
                                  "service's spans (default: this machine's, as configure() "
                                  "sets it; dcgm-exporter: its host label).")
@click.option("--service-name", help="service.name of the sampler's resource.")
@click.option("--max-queue-size", type=int,
              help="Readings buffered while the endpoint is slow or down (default 8192).")
@click.option("--gpu", "gpus", multiple=True,
              help="nvml: sample only this GPU (UUID or index; repeatable). synthetic: a hw.id "
                   "to invent readings for (repeatable).")
@click.option("--dcgm-url", help="dcgm-exporter's metrics URL (default "
                                 "http://localhost:9400/metrics).")
@click.option("--dcgm-host-label", help="dcgm-exporter label holding host.name (default "
                                        "Hostname or hostname; 'pod' with pod mapping).")
@click.option("--dcgm-field", "dcgm_fields", multiple=True, callback=_field,
              help="Map another dcgm-exporter series: SERIES=METRIC[*FACTOR] (repeatable).")
@click.option("--replay", type=click.Path(exists=True, dir_okay=False),
              help="Recording to play back (JSON lines, see docs/gpu.md).")
@click.option("--loop/--no-loop", default=True, show_default=True,
              help="replay: start the recording over after its end.")
@click.option("--utilization", type=float, help="synthetic: utilisation ratio (default 0.5).")
@click.option("--sm-active", type=float, help="synthetic: DCGM SM activity ratio.")
@click.option("--sm-occupancy", type=float, help="synthetic: DCGM SM occupancy ratio.")
@click.option("--record", type=click.File("a", encoding="utf-8", lazy=False),
              help="Also append every reading to this file (a recording --replay plays).")
@click.option("--once", is_flag=True,
              help="Take one reading, print it as JSON lines and exit (nothing is exported).")
@click.option("--duration", type=float, help="Stop after this many seconds (default: run until "
                                             "SIGINT/SIGTERM).")
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
def gpu(source: str | None, once: bool, duration: float | None, log_level: str,
        record: IO[str] | None, **opts: Any) -> None:
    """Sample GPUs (NVML or dcgm-exporter) and ship the samples as OTLP metrics.

    Run it next to the serving process (same host.name), pointed at the collector the
    service sends its spans to. Exits non-zero, in one line, where the source cannot run.
    """
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        src = _source(source, opts)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if record is not None:
        src = _Recording(src, record)
    if once:
        _read_once(src)
        return
    try:
        sampler = _sampler.GpuSampler(
            src, interval=opts["interval"], export_interval=opts["export_interval"],
            endpoint=opts["endpoint"], protocol=opts["protocol"], host_name=opts["host_name"],
            service_name=opts["service_name"], max_queue_size=opts["max_queue_size"])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        done.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            sampler.start()
        except (SourceUnavailable, ImportError) as exc:
            raise click.ClickException(f"cannot sample GPUs: {exc}") from None
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        st = sampler.settings
        gpus = getattr(src, "gpu_ids", None) or getattr(getattr(src, "inner", None), "gpu_ids",
                                                        None)
        what = f" ({len(gpus)} GPUs: {', '.join(gpus)})" if gpus else ""
        click.echo(f"source     {st.source}{what}, every {st.interval:g} s")
        click.echo(f"OTLP       {st.endpoint or 'the exporter default'} ({st.protocol}), every "
                   f"{st.export_interval:g} s, host.name={st.host_name}")
        click.echo("Ctrl-C to stop.")
        end = None if duration is None else time.monotonic() + duration
        while not done.wait(0.2):
            if end is not None and time.monotonic() >= end:
                break
        click.echo("stopping: exporting what is buffered")
    finally:
        sampler.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    s = sampler.stats()
    click.echo(f"polls {s.polls} ({s.poll_errors} failed), readings {s.samples}, exported "
               f"{s.exported_samples} ({s.exported_points} data points), dropped "
               f"{s.dropped_buffer_full + s.dropped_export_failed}")


def _read_once(src: Source) -> None:
    from inferprof.gpu.replay import write_samples

    try:
        src.open()
    except (SourceUnavailable, ImportError) as exc:
        raise click.ClickException(f"cannot sample GPUs: {exc}") from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        samples = src.read()
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        raise click.ClickException(f"reading the {src.name} source failed: {exc}") from None
    finally:
        src.close()
    write_samples(samples, sys.stdout)


__all__ = ["gpu"]
