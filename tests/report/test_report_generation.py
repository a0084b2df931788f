"""``inferprof report`` on generation traces: the generation section in the table, JSON
and HTML (TTFT and ITL attribution charts)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from inferprof import semconv as sc
from inferprof.cli import main
from inferprof.report.dump import write_json_lines
from tests.collector.gen_synth import (
    inferprof_exports,
    quantiles,
    simulate,
    truth_ttft,
    vllm_exports,
)


@pytest.fixture(scope="module")
def scenario():
    return simulate(np.random.default_rng(31), n_requests=150, n_steps=2000, prefill_every=0.2)


@pytest.fixture
def jsonl(tmp_path, scenario):
    path = tmp_path / "gen.jsonl"
    write_json_lines(path, inferprof_exports(scenario))
    return path


def test_json_report_has_the_generation_section_of_section_7(jsonl, scenario):
    result = CliRunner().invoke(main, ["report", str(jsonl), "--format", "json"])
    assert result.exit_code == 0, result.output
    gen = json.loads(result.output)["generation"]
    assert set(gen) >= {"requests", "output_tokens", "ttft", "itl", "tpot",
                        "preempted_requests", "kv_cache", "verdict"}
    truth = quantiles(*truth_ttft(scenario))
    for q in ("p50", "p95", "p99"):
        assert gen["ttft"][q] == pytest.approx(truth[q], rel=0.01)
    assert [c["cause"] for c in gen["itl"]["causes"]] == list(sc.ITL_CAUSES)
    assert gen["verdict"]["bottleneck"] == sc.VERDICT_SCHEDULING


def test_table_shows_generation_figures_and_verdict(jsonl):
    result = CliRunner().invoke(main, ["report", str(jsonl)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "generation: 150 generating requests" in out
    for row in ("ttft ms", "itl ms", "tpot ms", "output tokens"):
        assert f"\n{row} " in out
    assert "ITL p95 tail by cause: " in out and "prefill_interference" in out
    assert "generation verdict: scheduling" in out


def test_html_has_ttft_and_itl_attribution_charts(jsonl, tmp_path):
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(jsonl), "--html", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "TTFT attribution" in page and "ITL attribution" in page
    assert page.count("<svg") >= 4
    assert "Generation bottleneck: scheduling" in page
    assert "prefill_interference" in page


def test_vllm_spans_offline_report_without_gaps(tmp_path, scenario):
    path = tmp_path / "vllm.jsonl"
    write_json_lines(path, vllm_exports(scenario))
    out = tmp_path / "v.html"
    result = CliRunner().invoke(main, ["report", str(path), "--html", str(out)])
    assert result.exit_code == 0, result.output
    assert "service 'vllm' / model 'meta/llama'" in result.output
    assert "generation: 150 generating requests" in result.output
    assert "ITL p95 tail by cause" not in result.output
    assert "No inter-token gaps in these traces." in out.read_text()
