"""The ``inferprof`` console command.

Subcommands live next to the code they drive and are imported only when invoked,
so ``inferprof --help`` works without the optional extras installed.
"""

from __future__ import annotations

import importlib
import logging
import time

import click

#: What ``--log-level`` accepts (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: The ``--log-level`` option of the long-running subcommands.
log_level_option = click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="INFO",
    show_default=True,
    help="Python logging level.",
)


class ExporterLogLimit(logging.Filter):
    """A handler filter for the long-running commands: the OpenTelemetry SDK's exporters log
    a line on every failed export attempt (about 20 a minute with a collector down); let
    through the first of each logger and level, then one a ``period_s``, saying how many
    were held back. inferprof's own failure lines are rate-limited where they are logged."""

    def __init__(self, period_s: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.period_s = period_s
        self._clock = clock
        self._last: dict[tuple[str, int], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("opentelemetry.exporter."):
            return True
        key = (record.name, record.levelno)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.period_s:
            self._last[key] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        self._last[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it since the last one shown)"
        return True


def configure_logging(level: str) -> None:
    """Logging of a long-running subcommand: ``level``, one line per record, and the
    OpenTelemetry exporters' per-attempt failure lines held to one a minute."""
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ExporterLogLimit) for f in handler.filters):
            handler.addFilter(ExporterLogLimit())


def as_flags(message: str, names) -> str:
    """A settings error as the command line says it: a leading setting name among ``names``
    becomes its flag (``grpc_port`` -> ``--grpc-port``), and a tuple of values after
    ``, got `` is written as typed (``(0.0,)`` -> ``0``)."""
    name, sep, rest = message.partition(" ")
    if name in names:
        message = f"--{name.replace('_', '-')}{sep}{rest}"
    head, got, value = message.rpartition(", got ")
    if got and value.startswith("(") and value.endswith(")"):
        items = [v.strip().strip("'\"") for v in value[1:-1].split(",") if v.strip()]
        message = f"{head}, got {','.join(_plain(v) for v in items)}"
    elif got:
        message = f"{head}, got {_plain(value)}"
    return message


def _plain(value: str) -> str:
    # 0.0 -> 0 and 2.50 -> 2.5, but 123456789 stays whole (":g" would give 1.23457e+08).
    try:
        number = float(value)
    except ValueError:
        return value
    return str(int(number)) if number.is_integer() else repr(number)


# subcommand -> "module:attribute" of its click command.
_SUBCOMMANDS = {
    "demo": ("inferprof.demo.command:demo",
             "Run the demo service under load and print its breakdown."),
    "collect": ("inferprof.collector.command:collect",
                "Receive OTLP and serve per-stage breakdowns."),
    "report": ("inferprof.report.command:report", "Per-stage breakdown of OTLP files, offline."),
    "gpu": ("inferprof.gpu.command:gpu",
            "Sample GPUs (NVML, dcgm-exporter) and ship them as OTLP."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = _SUBCOMMANDS.get(cmd_name)
        if spec is None:
            return None
        module_name, attr = spec[0].split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_text) for name, (_, help_text) in sorted(_SUBCOMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="inferprof")
def main() -> None:
    """inferprof: per-stage tail-latency attribution for model-serving services."""
    from inferprof._shadowing import shadowing_folder, shadowing_message

    folder = shadowing_folder()
    if folder is not None:
        click.echo(shadowing_message(folder), err=True)


__all__ = ["as_flags", "main"]
