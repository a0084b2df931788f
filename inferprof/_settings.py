"""The settings toolkit: argument -> environment variable -> default.

As in the OpenTelemetry SDK: a bad argument raises ``ValueError`` at the call site; a bad
environment value is logged and replaced by the default (a typo in a deployment must not
stop the service). The variables' names are constants in ``inferprof.environment_variables``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from typing import Any

_logger = logging.getLogger("inferprof.settings")

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


def env(name: str) -> str | None:
    """The variable ``name``, stripped; None when unset or blank."""
    value = os.environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def choice(arg: Any, name: str, allowed: tuple[str, ...], default: str, what: str) -> str:
    """One of ``allowed``: ``arg``, else the variable ``name`` (case-insensitive), else
    ``default``."""
    if arg is not None:
        if arg not in allowed:
            raise ValueError(f"{what} must be one of {allowed}, got {arg!r}")
        return str(arg)
    raw = env(name)
    if raw is None:
        return default
    if raw.lower() in allowed:
        return raw.lower()
    _logger.warning("ignoring %s=%r: expected one of %s; using %r", name, raw, allowed, default)
    return default


def number(arg: Any, name: str, default: float, what: str, ok: Callable[[float], bool],
           expected: str) -> float:
    """A number: ``arg`` (``ValueError`` unless ``ok``), else the variable ``name``
    (ignored with a warning unless ``ok``), else ``default``."""
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, (int, float)) or not ok(float(arg)):
            raise ValueError(f"{what} must be {expected}, got {arg!r}")
        return float(arg)
    raw = env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
        if ok(value):
            return value
    except ValueError:
        pass
    _logger.warning("ignoring %s=%r: not %s; using %r", name, raw, expected, default)
    return default


def fraction(arg: Any, name: str, default: float, what: str, *, open_low: bool) -> float:
    """A number in (0, 1] (``open_low``) or [0, 1]."""

    def ok(v: float) -> bool:
        return (v > 0.0 if open_low else v >= 0.0) and v <= 1.0

    interval = "(0, 1]" if open_low else "[0, 1]"
    return number(arg, name, default, what, ok, f"a number in {interval}")


def rate(arg: Any, name: str, default: float, what: str, zero: str = "no limit") -> float:
    """A non-negative finite number of requests per second (0: ``zero``, no limit unless
    the setting says otherwise)."""
    return number(arg, name, default, what, lambda v: 0.0 <= v < math.inf,
                  f"a number >= 0 (requests per second; 0: {zero})")


def positive_seconds(arg: Any, name: str, default: float, what: str) -> float:
    """A positive finite number of seconds."""
    return number(arg, name, default, what, lambda v: v > 0 and math.isfinite(v),
                  "a positive number of seconds")


def flag(arg: Any, name: str, default: bool) -> bool:
    """A boolean: ``arg``, else the variable (1/0, true/false, yes/no, on/off)."""
    if arg is not None:
        if not isinstance(arg, bool):
            raise ValueError(f"expected a bool, got {arg!r}")
        return arg
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in TRUE:
        return True
    if raw.strip().lower() in FALSE:
        return False
    _logger.warning("ignoring %s=%r: not a boolean; using %r", name, raw, default)
    return default


def positive_int(arg: Any, name: str, default: int, what: str) -> int:
    """A positive int: ``arg``, else the variable ``name``, else ``default``."""
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, int) or arg <= 0:
            raise ValueError(f"{what} must be a positive int, got {arg!r}")
        return arg
    raw = env(name)
    if raw is None:
        return default
    try:
        value = int(raw)
        if value > 0:
            return value
    except ValueError:
        pass
    _logger.warning("ignoring %s=%r: not a positive integer; using %r", name, raw, default)
    return default


def url(name: str) -> str | None:
    """A URL-valued variable. One without a scheme is logged: OpenTelemetry's exporters
    read these variables themselves as well, so it cannot be ignored, only named."""
    value = env(name)
    if value and "://" not in value:
        _logger.warning("%s=%r is not a URL such as http://127.0.0.1:4318: exports to it "
                        "will fail", name, value)
    return value or None


def parse_flag(raw: str) -> bool:
    """A boolean variable's value (1/0, true/false, yes/no, on/off); ``ValueError`` else."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be a boolean (1/0, true/false), got {raw!r}")


def parse_str(raw: str) -> str:
    """A string variable's value, as it is."""
    return raw


def parse_int(raw: str) -> int:
    return int(raw)


def parse_float(raw: str) -> float:
    return float(raw)


def parse_list(raw: str) -> tuple[str, ...]:
    """A comma-separated list; blank items dropped."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def parse_floats(raw: str) -> tuple[float, ...]:
    """A comma-separated list of numbers."""
    return tuple(float(part) for part in parse_list(raw))


def parse_header(item: str) -> tuple[str, str]:
    """One ``key=value`` header: the key lower-cased, both stripped."""
    key, sep, val = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"header {item!r} is not key=value")
    return key.strip().lower(), val.strip()


def parse_headers(raw: str) -> tuple[tuple[str, str], ...]:
    """A comma-separated list of ``key=value`` headers."""
    return tuple(parse_header(item) for item in parse_list(raw))


#: A settings record's checks: field -> (value -> the error, or None when it is good).
Checks = Mapping[str, Callable[[Any], "str | None"]]


def check_fields(record: Any, checks: Checks) -> None:
    """``ValueError`` naming the first field of the dataclass ``record`` its check refuses
    (a bad argument raises)."""
    for f in fields(record):
        check = checks.get(f.name)
        error = check(getattr(record, f.name)) if check is not None else None
        if error:
            raise ValueError(f"{f.name}: {error}")


def from_environ(
    table: Iterable[tuple[str, str, Callable[[str], Any]]],
    checks: Checks,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The fields a settings record takes from the environment: ``table`` rows of (field,
    variable, parse). A value that does not parse or that its check refuses is logged and
    left out, so the field's default stands (a bad environment value never stops a
    service)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, var, parse in table:
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        try:
            value = parse(raw)
            check = checks.get(name)
            error = check(value) if check is not None else None
        except ValueError as exc:
            error = str(exc)
        if error:
            _logger.warning("ignoring %s=%r (%s); using the default", var, raw, error)
            continue
        values[name] = value
    return values


__all__ = [
    "FALSE", "TRUE", "Checks", "check_fields", "choice", "env", "flag", "fraction",
    "from_environ", "number", "parse_flag", "parse_float", "parse_floats", "parse_header",
    "parse_headers", "parse_int", "parse_list", "parse_str", "positive_int", "positive_seconds",
    "rate", "url",
]
