"""``inferprof gpu``: the GPU sampler as a sidecar process, until SIGINT/SIGTERM (or
``--duration``, or the end of a recording played with ``--no-loop``).

Each option without a value given falls back to its ``INFERPROF_GPU_*`` variable, then to
the default (see ``docs/gpu.md``); the OTLP endpoint, protocol and headers follow the
``OTEL_EXPORTER_OTLP_*`` variables like ``inferprof.configure()``. ``OTEL_SDK_DISABLED=true``
or ``INFERPROF_MODE=off`` turn it off (one line, exit 0), as they turn ``start_sampler()``
off; ``--once`` still reads (it exports nothing).
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

import click
from click.core import ParameterSource

from inferprof import _settings
from inferprof import environment_variables as ev
from inferprof import semconv as sc
from inferprof.cli import as_flags, configure_logging, log_level_option
from inferprof.cli.signals import until_signal
from inferprof.gpu import sampler as _sampler
from inferprof.gpu.records import METRICS, GpuSample, Source, SourceUnavailable
from inferprof.instrumentation.config import DEFAULT_MODE, PROTOCOLS


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

    @property
    def exhausted(self) -> bool:
        return bool(getattr(self.inner, "exhausted", False))

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


#: Options that configure one kind of source: parameter -> (flag, the sources it applies to).
#: Given with another source they are a usage error, not silently ignored.
_SOURCE_OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpus": ("--gpu", (sc.GPU_SOURCE_NVML, sc.GPU_SOURCE_SYNTHETIC)),
    "dcgm_url": ("--dcgm-url", (sc.GPU_SOURCE_DCGM_EXPORTER,)),
    "dcgm_host_label": ("--dcgm-host-label", (sc.GPU_SOURCE_DCGM_EXPORTER,)),
    "dcgm_fields": ("--dcgm-field", (sc.GPU_SOURCE_DCGM_EXPORTER,)),
    "replay": ("--replay", (sc.GPU_SOURCE_REPLAY,)),
    "loop": ("--loop/--no-loop", (sc.GPU_SOURCE_REPLAY,)),
    "utilization": ("--utilization", (sc.GPU_SOURCE_SYNTHETIC,)),
    "sm_active": ("--sm-active", (sc.GPU_SOURCE_SYNTHETIC,)),
    "sm_occupancy": ("--sm-occupancy", (sc.GPU_SOURCE_SYNTHETIC,)),
}


def _check_applies(ctx: click.Context, name: str) -> None:
    for param, (flag, sources) in _SOURCE_OPTIONS.items():
        if name not in sources and ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE:
            if param == "loop":
                flag = "--loop" if ctx.params.get("loop") else "--no-loop"
            raise ValueError(f"{flag} does not apply to the {name} source (it configures "
                             f"{' and '.join(sources)})")


def _source(name: str | None, opts: dict[str, Any]) -> Source:
    name = _settings.choice(name, _sampler.ENV_SOURCE, sc.GPU_SOURCES, sc.GPU_SOURCE_NVML,
                           "source")
    _check_applies(click.get_current_context(), name)
    gpus = list(opts["gpus"]) or None
    if name == sc.GPU_SOURCE_NVML:
        from inferprof.gpu.nvml import NvmlSource

        devices = None if gpus is None else [int(g) if g.isdigit() else g for g in gpus]
        return NvmlSource(devices)
    if name == sc.GPU_SOURCE_DCGM_EXPORTER:
        from inferprof.gpu.dcgm_exporter import DEFAULT_URL, DcgmExporterSource

        url = opts["dcgm_url"] or _settings.env(_sampler.ENV_DCGM_URL) or DEFAULT_URL
        return DcgmExporterSource(url, fields=opts["dcgm_fields"],
                                  host_label=opts["dcgm_host_label"])
    if name == sc.GPU_SOURCE_REPLAY:
        from inferprof.gpu.replay import ReplaySource

        path = opts["replay"] or _settings.env(_sampler.ENV_REPLAY)
        if path is None:
            raise ValueError(f"--source replay needs --replay FILE (or {_sampler.ENV_REPLAY})")
        return ReplaySource(path, loop=opts["loop"])
    from inferprof.gpu.synthetic import DEFAULT_GPU_ID, SyntheticSource

    util = opts["utilization"]
    return SyntheticSource(gpus or (DEFAULT_GPU_ID,), utilization=0.5 if util is None else util,
                           sm_active=opts["sm_active"], sm_occupancy=opts["sm_occupancy"])


def _disabled_by() -> str | None:
    """The variable that turns inferprof off in this environment, as start_sampler() reads
    them; None when it is on."""
    if _settings.flag(None, ev.OTEL_SDK_DISABLED, False):
        return f"{ev.OTEL_SDK_DISABLED}=true"
    mode = _settings.choice(None, ev.INFERPROF_MODE, sc.MODES, DEFAULT_MODE, "mode")
    return f"{ev.INFERPROF_MODE}={sc.MODE_OFF}" if mode == sc.MODE_OFF else None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _describe(src: Source) -> str:
    """What the banner says about the source, beyond its name."""
    from inferprof.gpu.dcgm_exporter import DcgmExporterSource
    from inferprof.gpu.replay import ReplaySource

    if isinstance(src, DcgmExporterSource):
        return f" {src.url}"
    if isinstance(src, ReplaySource):
        return f" {src.path}" + ("" if src.loop else " (once, no loop)")
    gpus = list(getattr(src, "gpu_ids", None) or ())
    if not gpus:
        return ""
    gpm = getattr(src, "gpm_gpu_ids", None)
    profiling = "" if gpm is None else (
        "; SM activity/occupancy through GPM on " + (
            "all" if len(gpm) == len(gpus) else "none" if not gpm else ", ".join(gpm)))
    return f" ({_plural(len(gpus), 'GPU')}: {', '.join(gpus)}{profiling})"


def _gpm_dropped(src: Source) -> str:
    """The summary's words on GPM figures dropped as untrustworthy (the NVML source)."""
    dropped = getattr(src, "gpm_dropped", None)
    if dropped is None:
        return ""
    return f", GPM figures dropped from {_plural(dropped, 'poll')} (a metric failed)"


def _host_used(src: Source, st: _sampler.SamplerSettings) -> str:
    """The host.name the exports will carry, as the banner says it."""
    from inferprof.gpu.dcgm_exporter import HOST_LABELS, DcgmExporterSource
    from inferprof.gpu.replay import ReplaySource

    if st.host_override:
        return st.host_name
    if isinstance(src, DcgmExporterSource):
        label = src.host_label or " or ".join(HOST_LABELS)
        return f"from the exporter's {label} label (else {st.host_name})"
    if isinstance(src, ReplaySource) and src.hosts:
        return f"the recording's ({', '.join(src.hosts)}; else {st.host_name})"
    return st.host_name


@click.command("gpu")
@click.option("--source", type=click.Choice(sc.GPU_SOURCES),
              help=f"Where samples come from (default nvml; env {_sampler.ENV_SOURCE}). replay "
                   "and synthetic are NOT live GPU data.")
@click.option("--interval", type=float,
              help="Seconds between polls (default: nvml 0.1, dcgm-exporter 1, replay and "
                   f"synthetic 0.1; env {_sampler.ENV_INTERVAL}).")
@click.option("--export-interval", type=float,
              help=f"Seconds between OTLP exports (default 1; env "
                   f"{_sampler.ENV_EXPORT_INTERVAL}).")
@click.option("--endpoint", help="OTLP endpoint, e.g. http://collector:4317 (default: "
                                 "OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT, else "
                                 "http://localhost:4317, or http://localhost:4318/v1/metrics "
                                 "with http/protobuf).")
@click.option("--protocol", type=click.Choice(PROTOCOLS),
              help="OTLP protocol (default: OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL, else grpc).")
@click.option("--host-name", help="host.name of the samples: must equal the one on the "
                                  "service's spans (default: this machine's, as configure() "
                                  "sets it; dcgm-exporter: its host label; env "
                                  f"{_sampler.ENV_HOST_NAME}).")
@click.option("--service-name", help="service.name of the sampler's resource (default: "
                                     f"OTEL_SERVICE_NAME, else {_sampler._DEFAULT_SERVICE_NAME}).")
@click.option("--max-queue-size", type=int,
              help="Readings buffered while the endpoint is slow or down (default 8192; env "
                   f"{_sampler.ENV_MAX_QUEUE_SIZE}).")
@click.option("--gpu", "gpus", multiple=True,
              help="nvml: sample only this GPU (UUID or index; repeatable). synthetic: a hw.id "
                   "to invent readings for (repeatable; default the nil UUID "
                   "GPU-00000000-0000-0000-0000-000000000000, which the collector joins only "
                   "to spans of the same host.name).")
@click.option("--dcgm-url", help="dcgm-exporter's metrics URL (default "
                                 "http://localhost:9400/metrics; env "
                                 f"{_sampler.ENV_DCGM_URL}).")
@click.option("--dcgm-host-label", help="dcgm-exporter label holding host.name (default "
                                        "Hostname or hostname; 'pod' with pod mapping).")
@click.option("--dcgm-field", "dcgm_fields", multiple=True, callback=_field,
              help="Map another dcgm-exporter series: SERIES=METRIC[*FACTOR] (repeatable).")
@click.option("--replay", type=click.Path(exists=True, dir_okay=False),
              help="Recording to play back (JSON lines, see docs/gpu.md; env "
                   f"{_sampler.ENV_REPLAY}).")
@click.option("--loop/--no-loop", default=True, show_default=True,
              help="replay: start the recording over after its end; --no-loop exits once it "
                   "has played.")
@click.option("--utilization", type=float, help="synthetic: utilisation ratio (default 0.5).")
@click.option("--sm-active", type=float, help="synthetic: DCGM SM activity ratio.")
@click.option("--sm-occupancy", type=float, help="synthetic: DCGM SM occupancy ratio.")
@click.option("--record", type=click.File("a", encoding="utf-8", lazy=False),
              help="Also append every reading to this file (a recording --replay plays).")
@click.option("--once", is_flag=True,
              help="Take one reading, print it as JSON lines and exit (nothing is exported).")
@click.option("--duration", type=float, help="Stop after this many seconds (default: run until "
                                             "SIGINT/SIGTERM).")
@log_level_option
def gpu(source: str | None, once: bool, duration: float | None, log_level: str,
        record: IO[str] | None, **opts: Any) -> None:
    """Sample GPUs (nvml, dcgm-exporter; replay or synthetic without one) and ship the
    samples as OTLP metrics.

    Run it next to the serving process (same host.name), pointed at the collector the
    service sends its spans to. An option not given reads the variable named in its help;
    a flag beats the variable, which beats the default. OTEL_SDK_DISABLED=true or
    INFERPROF_MODE=off: prints one line and exits 0. Exits non-zero, in one line, where the
    source cannot run. See docs/gpu.md.
    """
    configure_logging(log_level)
    try:
        if duration is not None and not (duration > 0 and math.isfinite(duration)):
            raise ValueError(f"--duration must be a positive number of seconds, got {duration:g}")
        src = _source(source, opts)
        # Built for --once too: it validates every setting and settles the host name.
        sampler = _sampler.GpuSampler(
            _Recording(src, record) if record is not None else src,
            interval=opts["interval"], export_interval=opts["export_interval"],
            endpoint=opts["endpoint"], protocol=opts["protocol"], host_name=opts["host_name"],
            service_name=opts["service_name"], max_queue_size=opts["max_queue_size"])
    except ValueError as exc:
        raise click.UsageError(as_flags(str(exc), opts)) from None
    if once:
        _read_once(sampler)
        return
    disabled_by = _disabled_by()
    if disabled_by is not None:
        click.echo(f"GPU sampling is disabled by {disabled_by}: nothing sampled or exported.")
        return
    with until_signal() as done:
        try:
            try:
                sampler.start()
            except (SourceUnavailable, ImportError) as exc:
                raise click.ClickException(f"cannot sample GPUs: {exc}{_elsewhere(src)}") from None
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
            st = sampler.settings
            click.echo(f"source     {st.source}{_describe(src)}, every {st.interval:g} s")
            click.echo(f"OTLP       {st.endpoint} ({st.protocol}), every "
                       f"{st.export_interval:g} s, host.name={_host_used(src, st)}")
            click.echo("Ctrl-C to stop." if duration is None
                       else f"Stops after {duration:g} s (or Ctrl-C).")
            end = None if duration is None else time.monotonic() + duration
            while not done.wait(0.2):
                if sampler.exhausted:
                    click.echo("the recording has played (--no-loop)")
                    break
                if end is not None and time.monotonic() >= end:
                    break
            click.echo("stopping: exporting what is buffered")
        finally:
            sampler.stop()
    s = sampler.stats()
    click.echo(f"polls {s.polls} ({s.poll_errors} failed), readings {s.samples}, exported "
               f"{s.exported_samples} ({s.exported_points} data points; "
               f"{s.export_failures} exports failed), dropped {s.dropped_buffer_full} "
               f"(buffer full) + {s.dropped_export_failed} (export failed), buffered "
               f"{s.buffered}" + _gpm_dropped(src))


def _read_once(sampler: _sampler.GpuSampler) -> None:
    from inferprof.gpu.replay import write_samples

    try:
        samples = sampler.read_once()
    except (SourceUnavailable, ImportError) as exc:
        raise click.ClickException(
            f"cannot sample GPUs: {exc}{_elsewhere(sampler.source)}"
        ) from None
    except ValueError as exc:  # from open(): a GPU that is not there, a malformed recording
        raise click.UsageError(str(exc)) from None
    except RuntimeError as exc:  # a failed read: one line, not a traceback
        raise click.ClickException(str(exc)) from None
    write_samples(samples, sys.stdout)


def _elsewhere(src: object) -> str:
    """After a failed NVML source: where else GPU samples can come from."""
    if getattr(src, "name", None) != sc.GPU_SOURCE_NVML:
        return ""
    return (". Without a GPU here: --source dcgm-exporter --dcgm-url URL (a node's exporter), "
            "--source replay --replay FILE (a recording) or --source synthetic (invented "
            "readings, to try the verdicts); docs/gpu.md")


__all__ = ["gpu"]

