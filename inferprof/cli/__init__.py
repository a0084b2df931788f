"""The ``inferprof`` console command.

Subcommands live next to the code they drive and are imported only when invoked,
so ``inferprof --help`` works without the optional extras installed.
"""

from __future__ import annotations

import importlib

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

# subcommand -> "module:attribute" of its click command.
_SUBCOMMANDS = {
    "demo": ("inferprof.demo.command:demo", "Run the demo service under load and print its breakdown."),
    "collect": ("inferprof.collector.command:collect", "Receive OTLP and serve per-stage breakdowns."),
    "report": ("inferprof.report.command:report", "Per-stage breakdown of OTLP files, offline."),
    "gpu": ("inferprof.gpu.command:gpu", "Sample GPUs (NVML, dcgm-exporter) and ship them as OTLP."),
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


__all__ = ["main"]
