"""Assembly tests run twice: with the engine reading each export's decoded message span
by span (``Assembler.columnar`` off: the reference), and with it reading the export's
protobuf bytes as columns (``wire.SpanReader.columns``, ``Assembler._ingest_columns``),
as the receivers have it do. Both must give the same figures."""

from __future__ import annotations

import pytest

from inferprof.collector.assembly import Assembler
from inferprof.collector.engine import Engine

#: Test modules whose engine tests run on both paths.
_BOTH_PATHS = frozenset(
    {
        "test_attribution",
        "test_engine",
        "test_engine_batched_fold",
        "test_engine_expiry",
        "test_engine_links",
        "test_generation",
        "test_summaries",
        "test_triton_spans",
    }
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if (
        metafunc.module.__name__.rsplit(".", 1)[-1] in _BOTH_PATHS
        and "ingest_path" in metafunc.fixturenames
    ):
        metafunc.parametrize("ingest_path", ["message", "bytes"], indirect=True)


@pytest.fixture(autouse=True)
def ingest_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``bytes``: ``Engine.ingest_traces`` is handed the export's serialized bytes with
    it, as the receivers hand what they received; ``message`` (of the modules above): the
    span-by-span reference. Other tests run the engine as it is."""
    path = getattr(request, "param", "message")
    if getattr(request, "param", None) == "message":
        monkeypatch.setattr(Assembler, "columnar", False)
    if path == "bytes":
        # Every scope by columns, however small (test exports are).
        monkeypatch.setattr(Assembler, "columnar_min_spans", 1)
        ingest = Engine.ingest_traces

        def with_bytes(self, request, peer=None, payload=None):  # type: ignore[no-untyped-def]
            if payload is None:
                payload = request.SerializeToString()
            return ingest(self, request, peer, payload)

        monkeypatch.setattr(Engine, "ingest_traces", with_bytes)
    return path
