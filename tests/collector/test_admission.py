"""Sharing the pending-span cap between senders (admission.py): a sender flooding a
saturated collector cannot take the room a starved sender needs, and a sender alone still
gets the whole cap."""

from __future__ import annotations

import grpc
import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from inferprof import semconv as sc
from inferprof.collector.admission import FairShare, sender_of
from inferprof.collector.engine import Engine, Overloaded
from inferprof.collector.grpc_server import _peer_host
from inferprof.collector.settings import ENV_SHARE_PENDING_CAP, CollectorSettings
from tests.collector.test_server_fixtures import breakdown, make_requests, running_app

CAP = 100  # reserve: 25 spans
SPANS = 20  # per export: 5 requests of 4 spans
PB = {"content-type": "application/x-protobuf"}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def with_instance(request, instance: str):
    """The export with every resource's ``service.instance.id`` set to ``instance`` (the
    SDK gives every Resource.create() a random one: each make_requests() call would look
    like a new replica)."""
    for rs in request.resource_spans:
        attrs = [kv for kv in rs.resource.attributes if kv.key != "service.instance.id"]
        del rs.resource.attributes[:]
        rs.resource.attributes.extend(attrs)
        if instance:
            kv = rs.resource.attributes.add()
            kv.key, kv.value.string_value = "service.instance.id", instance
    return request


def export(service: str):
    return with_instance(encode_spans(make_requests(SPANS // 4, service=service)), "1")


def held_engine(clock: Clock, **kwargs) -> Engine:
    # Nothing settles during a test: only flush() frees the cap.
    return Engine(
        max_pending_spans=CAP, settle_s=600.0, trace_timeout_s=600.0, clock=clock, **kwargs
    )


def try_ingest(engine: Engine, service: str) -> bool:
    try:
        engine.ingest_traces(export(service))
    except Overloaded:
        return False
    return True


def test_a_sender_alone_fills_the_whole_cap():
    engine = held_engine(Clock())
    admitted = 0
    while try_ingest(engine, "a"):
        admitted += 1
    assert admitted == CAP // SPANS
    assert engine.pending_spans() == CAP


def _fill(engine, service, clock=None):
    """Exports from ``service`` until one is refused; returns how many got in."""
    n = 0
    while try_ingest(engine, service):
        n += 1
        if clock is not None:
            clock.t += 0.01
    return n


def test_a_flooding_sender_is_refused_where_a_starved_one_still_gets_in():
    clock = Clock()
    engine = held_engine(clock)
    assert _fill(engine, "a", clock) == CAP // SPANS  # alone: the whole cap
    assert not try_ingest(engine, "b")  # b is refused: now it is a starved sender
    engine.flush()
    # a is held to cap - reserve while b is starved: 3 exports (60), a 4th would pass 75
    assert _fill(engine, "a", clock) == 3
    assert engine.pending_spans() == 60
    with pytest.raises(Overloaded, match="kept for a sender starved of its share"):
        engine.ingest_traces(export("a"))
    # b finds the reserve, up to the cap; nobody goes past it
    assert try_ingest(engine, "b")
    assert try_ingest(engine, "b")
    assert engine.pending_spans() == CAP
    assert not try_ingest(engine, "b")
    assert not try_ingest(engine, "a")


def test_senders_getting_their_shares_may_all_fill_the_cap():
    engine = held_engine(Clock())
    for _ in range(2):  # a and b alternate: neither is starved, nothing is held back
        assert try_ingest(engine, "a")
        assert try_ingest(engine, "b")
    assert try_ingest(engine, "a")
    assert engine.pending_spans() == CAP


def test_turned_off_the_first_to_come_takes_the_whole_cap():
    engine = held_engine(Clock(), share_pending_cap=False)
    assert try_ingest(engine, "b")
    while try_ingest(engine, "a"):
        pass
    assert engine.pending_spans() == CAP  # a took the rest of the cap
    assert not try_ingest(engine, "b")


def test_the_setting_defaults_on_and_reads_flag_env_and_config(tmp_path):
    assert CollectorSettings().engine_kwargs()["share_pending_cap"] is True
    env = {ENV_SHARE_PENDING_CAP: "off"}
    assert CollectorSettings.from_env(environ=env).share_pending_cap is False
    cfg = tmp_path / "c.toml"
    cfg.write_text("share-pending-cap = false\n")
    assert CollectorSettings.from_env(config=cfg, environ={}).share_pending_cap is False
    assert CollectorSettings.from_env(
        config=cfg, environ={}, share_pending_cap=True
    ).share_pending_cap is True
    with pytest.raises(ValueError, match="share_pending_cap"):
        CollectorSettings(share_pending_cap="no")
    with pytest.raises(TypeError, match="share_pending_cap"):
        Engine(share_pending_cap="no")


def test_replicas_of_one_service_are_separate_senders_and_a_batching_collector_is_its_client():
    one = with_instance(encode_spans(make_requests(2, service="svc")), "")
    # naming no instance (neither service.instance.id nor host.name): the client does
    assert sender_of(one, "10.0.0.7") == ("svc", "", "10.0.0.7")
    assert sender_of(one, "10.0.0.8") != sender_of(one, "10.0.0.7")
    with_instance(one, "pod-1")
    assert sender_of(one, "10.0.0.7") == ("svc", "pod-1")
    host = with_instance(encode_spans(make_requests(2, service="svc")), "")
    for rs in host.resource_spans:
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = "host.name", "node-3"
    assert sender_of(host, None) == ("svc", "node-3")
    mixed = with_instance(encode_spans(make_requests(2, service="svc")), "pod-2")
    mixed.resource_spans.extend(one.resource_spans)
    assert sender_of(mixed, "10.0.0.7") == ("", "", "10.0.0.7")
    assert sender_of(mixed, "10.0.0.8") != sender_of(mixed, "10.0.0.7")


def test_a_sender_that_stopped_trying_no_longer_holds_room_back():
    share = FairShare(CAP, tau_s=2.0, active_s=10.0)
    share.admitted(("a",), 60, 0.0)
    assert share.limit(("b",), 0.0) == CAP  # b: nothing admitted, under its share
    assert share.limit(("a",), 0.1) == CAP - 25  # a: over its share while b is trying
    assert share.limit(("a",), 11.0) == CAP  # b quiet for longer than active_s
    # shares decay with the time spans stay pending: b's large intake long ago does
    # not make it the flooding sender now
    share.admitted(("b",), 50, 11.0)
    share.admitted(("a",), 5, 40.0)
    assert share.limit(("b",), 40.0) == CAP
    assert share.limit(("a",), 40.0) == CAP - 25


def test_the_grpc_peer_is_named_without_its_port():
    class Ctx:
        def __init__(self, peer):
            self._peer = peer

        def peer(self):
            return self._peer

    assert _peer_host(Ctx("ipv4:10.0.0.7:51234")) == "10.0.0.7"
    assert _peer_host(Ctx("ipv6:[::1]:51234")) == "::1"
    assert _peer_host(Ctx("unix:/tmp/s")) == "unix:/tmp/s"
    assert _peer_host(Ctx("")) is None


def test_over_real_transports_the_starved_grpc_sender_gets_in_while_the_http_flood_is_refused():
    held = {"max_pending_spans": CAP, "settle_s": 600.0, "trace_timeout_s": 600.0,
            "advance_interval_s": 60.0}
    with running_app(**held) as app:
        url = f"{app.otlp_http_endpoint}/v1/traces"
        channel = grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}")
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)

        def flood():
            out = []
            for _ in range(6):
                resp = httpx.post(url, content=export("http-replica").SerializeToString(),
                                  headers=PB)
                out.append(resp.status_code)
            return out, resp

        try:
            statuses, _ = flood()  # alone, the HTTP replica fills the cap
            assert statuses == [200] * 5 + [429]
            with pytest.raises(grpc.RpcError) as refused:
                stub.Export(export("grpc-replica"), timeout=5)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            app.engine.flush()  # the cap frees up; the gRPC replica is starved now
            statuses, last = flood()
            assert statuses == [200, 200, 200, 429, 429, 429]
            assert "kept for a sender starved of its share" in last.text
            stub.Export(export("grpc-replica"), timeout=5)  # the reserve: in
            stub.Export(export("grpc-replica"), timeout=5)
            assert app.engine.pending_spans() <= CAP
        finally:
            channel.close()
        app.engine.flush()
        assert breakdown(app, "grpc-replica").json()["requests"] == 2 * SPANS // 4
        assert breakdown(app, "http-replica").json()["requests"] == 8 * SPANS // 4


def test_the_sender_table_forgets_quiet_senders_and_stays_bounded():
    from inferprof.collector.admission import MAX_SENDERS

    share = FairShare(CAP, tau_s=2.0, active_s=10.0)
    for i in range(MAX_SENDERS + 500):  # pod churn: a new instance id each time
        share.admitted(("svc", f"pod-{i}"), 1, i * 0.001)
    assert share.senders(MAX_SENDERS * 0.001 + 0.5) == MAX_SENDERS
    assert share.senders(100.0) == 0  # nobody tried for active_s
    share.admitted(("svc", "pod-0"), 1, 100.0)
    assert share.senders(100.0) == 1


def test_the_senders_table_keeps_long_names_cut():
    # Up to MAX_SENDERS senders are remembered: their names are bounded as series names are.
    long = with_instance(encode_spans(make_requests(1, service="s" * 100_000)), "i" * 100_000)
    name, instance = sender_of(long, "10.0.0.7")
    assert len(name.encode()) <= sc.MAX_LABEL_BYTES and len(instance.encode()) <= sc.MAX_LABEL_BYTES
    other = with_instance(encode_spans(make_requests(1, service="s" * 100_000)), "i" * 99_999)
    assert sender_of(other, "10.0.0.7") != (name, instance)  # still told apart
