"""``inferprof collect``: run the collector in the foreground until SIGINT/SIGTERM.

Each flag overrides its ``INFERPROF_*`` variable, which overrides ``--config``,
which overrides the built-in default (see ``docs/collector.md``).
"""

from __future__ import annotations

import logging
from typing import Any

import click

from inferprof._settings import parse_floats, parse_header
from inferprof.cli import as_flags, log_level_option
from inferprof.cli.signals import until_signal
from inferprof.collector import settings as _settings


def header_option(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
    try:
        return tuple(parse_header(v) for v in values) or None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _windows(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return parse_floats(value)
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated seconds: {exc}") from None


def gpu_hour_prices(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
    """Click callback of ``--gpu-hour-price`` (``collect`` and ``report``)."""
    from inferprof.collector.cost import parse_prices

    try:
        return parse_prices(values) or None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


#: ``--gpu-hour-price``, shared by ``collect`` and ``report``.
gpu_hour_price_option = click.option(
    "--gpu-hour-price",
    "gpu_hour_prices",
    multiple=True,
    metavar="[MODEL=]PRICE",
    callback=gpu_hour_prices,
    help="Price of one GPU-hour, for the cost per request (repeatable): MODEL=PRICE for "
    "GPUs whose samples name that hw.model, PRICE for every other GPU.",
)


def _trace_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from inferprof.collector.examples import check_template

    try:
        return check_template(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


#: ``--trace-url TEMPLATE``, the same for the collector, ``inferprof report`` and the demo.
trace_url_option = click.option(
    "--trace-url",
    metavar="TEMPLATE",
    callback=_trace_url,
    help="Link the slow traces listed: a URL with {trace_id}, e.g. "
    "http://localhost:16686/trace/{trace_id} (Jaeger) or a Grafana Explore URL.",
)


@click.command("collect")
@click.option(
    "--config", "config", type=click.Path(dir_okay=False), help="TOML or YAML settings file."
)
@click.option("--host", help="Address every listener binds (default 127.0.0.1).")
@click.option("--grpc-host", help="Address of the OTLP/gRPC listener (default: --host).")
@click.option("--grpc-port", type=int, help="OTLP/gRPC port (default 4317; 0: ephemeral).")
@click.option("--http-host", help="Address of the OTLP/HTTP listener (default: --host).")
@click.option("--http-port", type=int, help="OTLP/HTTP port (default 4318; 0: ephemeral).")
@click.option("--api-host", help="Address of the API and /metrics listener (default: --host).")
@click.option("--api-port", type=int, help="API and /metrics port (default 9464; 0: ephemeral).")
@click.option("--max-body-bytes", type=int, help="Largest request body, before and after gzip.")
@click.option(
    "--max-concurrent-requests", type=int, help="Exports processed at once per transport."
)
@click.option(
    "--body-timeout-s", type=float,
    help="Longest an OTLP/HTTP request body may take to arrive (408 after).",
)
@click.option("--grpc-workers", type=int, help="Threads serving OTLP/gRPC.")
@click.option("--retry-after-s", type=float, help="Delay clients are told to wait when overloaded.")
@click.option("--auth-token", help="Bearer token required on every listener (prefer the env var).")
@click.option(
    "--auth-token-file", type=click.Path(dir_okay=False), help="File holding the bearer token."
)
@click.option(
    "--tls-cert", type=click.Path(dir_okay=False), help="PEM certificate (chain) for TLS."
)
@click.option("--tls-key", type=click.Path(dir_okay=False), help="PEM private key for TLS.")
@click.option(
    "--forward",
    multiple=True,
    help="Re-export everything received to this OTLP endpoint (repeatable): "
    "otlp-grpc://host:port, otlp-grpcs://host:port, http(s)://host:port[/prefix], "
    "or file:///path (a dump `inferprof report` reads).",
)
@click.option(
    "--forward-header",
    "forward_headers",
    multiple=True,
    callback=header_option,
    help="key=value header/metadata sent with forwarded exports (repeatable).",
)
@click.option("--forward-ca", type=click.Path(dir_okay=False), help="CA bundle for TLS forwarding.")
@click.option(
    "--forward-queue-size", type=int, help="Exports queued per destination before dropping."
)
@click.option(
    "--forward-queue-bytes", type=int,
    help="Bytes of exports queued per destination before dropping.",
)
@click.option("--forward-timeout-s", type=float, help="Timeout of one forwarded export.")
@click.option(
    "--forward-compression",
    type=click.Choice(_settings.FORWARD_COMPRESSIONS),
    help="Compression of forwarded exports (default gzip).",
)
@click.option("--settle-s", type=float,
              help="Seconds after a request span arrives before its request is folded.")
@click.option("--trace-timeout-s", type=float, help="Longest a trace is held before it is folded.")
@click.option(
    "--windows-s", callback=_windows, help="Sliding windows kept, comma-separated seconds."
)
@click.option("--slice-s", type=float, help="Granularity of the sliding windows.")
@click.option("--relative-accuracy", type=float, help="Relative accuracy of the quantile sketches.")
@click.option("--max-series", type=int, help="Most (service, model) series kept.")
@click.option(
    "--max-stages", type=int, help="Most distinct stage names tracked (the contract's included)."
)
@click.option("--max-spans-per-trace", type=int, help="Spans kept per trace.")
@click.option(
    "--max-links-per-span", type=int,
    help="Links read per batch stage span (one per member request); the rest are dropped.",
)
@click.option("--max-pending-spans", type=int, help="Spans held unfolded before answering 429.")
@click.option(
    "--max-gpu-samples", type=int, help="GPU samples retained before answering 429."
)
@click.option("--max-gpus-per-host", type=int, help="Distinct GPUs (hw.id) kept per host.")
@click.option("--max-gpu-hosts", type=int, help="Distinct hosts GPU samples are kept for.")
@click.option(
    "--metrics-window-s", type=float,
    help="Window of the /metrics gauges, and of the API when a request names none.",
)
@click.option("--advance-interval-s", type=float, help="How often settled traces are folded.")
@click.option(
    "--triton-spans/--no-triton-spans",
    default=None,
    help="Turn Triton's own spans into queue/h2d/compute/d2h stages of the Triton "
    "service (default on).",
)
@click.option(
    "--share-pending-cap/--no-share-pending-cap",
    default=None,
    help="Near --max-pending-spans, while a sender is starved of its share of the intake, "
    "hold the others to three quarters of the cap (default on).",
)
@click.option(
    "--fleet-metrics/--no-fleet-metrics",
    default=None,
    help="Expose the sketch's buckets and tail table on /metrics, so that Prometheus "
    "sums several collectors into one breakdown (about 1,400 series per service, model "
    "and stage; default off).",
)
@trace_url_option
@gpu_hour_price_option
@log_level_option
def collect(config: str | None, log_level: str, **options: Any) -> None:
    """Receive OTLP traces and GPU metrics; serve per-stage breakdowns and /metrics.

    Every option but --log-level also reads an environment variable
    (INFERPROF_COLLECTOR_<NAME>, or INFERPROF_AUTH_TOKEN[_FILE] and INFERPROF_TLS_CERT/KEY);
    a flag beats the variable, which beats --config, which beats the default. See
    docs/collector.md.
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    options["forward"] = tuple(options.get("forward") or ()) or None
    try:
        settings = _settings.CollectorSettings.from_env(config=config, **options)
    except ValueError as exc:
        raise click.UsageError(as_flags(str(exc), options)) from None

    from inferprof.collector.app import CollectorApp

    app = CollectorApp(settings)
    with until_signal() as done:
        try:
            try:
                app.start()
            except (OSError, ValueError) as exc:
                raise click.ClickException(f"cannot start the collector: {exc}") from None
            click.echo(f"OTLP/gRPC  {app.otlp_grpc_endpoint}")
            click.echo(f"OTLP/HTTP  {app.otlp_http_endpoint}")
            click.echo(f"API        {app.api_url}  (/metrics, /api/v1/breakdown, /api/v1/services)")
            click.echo("Ctrl-C to stop.")
            while not done.wait(1.0):
                pass
            click.echo("stopping: flushing the engine and forwarding queues")
        finally:
            app.stop()


def _show_defaults(command: click.Command) -> None:
    """Append each setting's default to its help where the help does not give it: the
    options default to None on the command line (so the environment and --config can
    apply), which would leave ``--help`` without them."""
    defaults = _settings.CollectorSettings()
    for param in command.params:
        if not isinstance(param, click.Option) or not param.help or "default" in param.help:
            continue
        value = getattr(defaults, param.name or "", None)
        if value is None or value == ():
            continue
        if isinstance(value, tuple):
            value = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
        elif isinstance(value, bool):
            value = "on" if value else "off"
        elif isinstance(value, float):
            value = f"{value:g}"
        param.help = f"{param.help.rstrip('.')} (default {value})."


_show_defaults(collect)

__all__ = ["collect"]
