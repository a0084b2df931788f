"""A FastAPI service for the summaries' end-to-end test (``test_summaries_e2e.py``).

inferprof in ``production`` mode at its defaults (the endpoint and protocol from the
``OTEL_*`` environment), stages of known durations, and, as each request ends, its own
timings written to ``INFERPROF_TEST_TIMINGS`` (one JSON line per request): the start and
end of the request and of every stage span its trace would hold (its own stages, and the
middleware's ``receive`` and ``serialize``). Read from the record as the runtime gets it,
before inferprof decides whether to keep its trace. A request the timing budget leaves
untimed writes ``{"untimed": true, "start", "end", "error"}``, as the middleware counts it
(contract §15), with ``"stages"`` too when it is summarised with them (the runtime's
``summarise_untimed``). A last line holds inferprof's ``stats()`` after its shutdown.

``{"i": i, "fail": "503"}`` answers 503.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException

import inferprof
import inferprof.fastapi
from inferprof.instrumentation.active import active_runtime

_out = open(os.environ["INFERPROF_TEST_TIMINGS"], "w", encoding="utf-8")  # noqa: SIM115


def _recording(finish: Any) -> Any:
    def finish_request(rec: Any) -> None:
        stages = [[st.name, st.start, st.end or rec.end] for st in rec.stages]
        if rec.recv_start and rec.received:
            stages.append(["receive", rec.recv_start, rec.recv_end])
        if rec.ser_start:
            stages.append(["serialize", rec.ser_start, rec.ser_end])
        _out.write(json.dumps({"start": rec.start, "end": rec.end, "stages": stages}) + "\n")
        finish(rec)

    return finish_request


def _recording_untimed(add_untimed: Any) -> Any:
    def counted(entry: tuple) -> Any:
        start, end, error, _model = entry
        _out.write(json.dumps({"untimed": True, "start": start, "end": end,
                               "error": bool(error)}) + "\n")
        return add_untimed(entry)

    return counted


def _recording_summarised(summarise: Any) -> Any:
    def summarised(rec: Any, start: int, end: int, error: bool, model: Any,
                   parts: list) -> Any:
        stages = [[st.name, st.start, st.end or end] for st in rec.stages if st.start]
        stages += [list(parts[i:i + 3]) for i in range(0, len(parts), 3)]
        _out.write(json.dumps({"untimed": True, "start": start, "end": end,
                               "error": bool(error), "stages": stages}) + "\n")
        return summarise(rec, start, end, error, model, parts)

    return summarised


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    inferprof.configure(service_name="summaries-e2e", mode="production")
    rt = active_runtime()
    rt.finish_request = _recording(rt.finish_request)
    if rt.summaries is not None and hasattr(rt.summaries, "add_untimed"):
        rt.summaries.add_untimed = _recording_untimed(rt.summaries.add_untimed)
    rt.summarise_untimed = _recording_summarised(rt.summarise_untimed)
    yield
    inferprof.shutdown()  # the last interval's summaries and the queued traces
    from dataclasses import asdict

    from inferprof.instrumentation import stats

    _out.write(json.dumps({"stats": asdict(stats())}) + "\n")
    _out.close()


app = FastAPI(lifespan=lifespan)
inferprof.fastapi.instrument(app, model_name="m")


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@app.post("/v1/work")
async def work(body: dict) -> dict:
    i = int(body["i"])
    with inferprof.stage("tokenize"):
        _busy(0.0005 + (i % 7) * 0.0002)
    with inferprof.stage("compute"):
        # 4 to 14 ms, spread evenly: a tail without a cluster at its edge (the
        # collector's tail starts at the p95's bucket, a 1% wide one)
        _busy(0.004 + ((i * 37) % 100) * 0.0001)
        with inferprof.stage("d2h"):  # nested: overlaps compute
            _busy(0.0005 + (i % 5) * 0.0002)
    await asyncio.sleep(0.001)  # no stage: unattributed
    with inferprof.stage("postprocess"):
        _busy(0.0003 + (i % 3) * 0.0004)
    if body.get("fail") == "503":
        raise HTTPException(status_code=503)
    return {"i": i}
