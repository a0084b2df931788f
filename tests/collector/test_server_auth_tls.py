"""Bearer-token auth and TLS on every listener, with the SDK's real exporters."""

from __future__ import annotations

import datetime
import ipaddress
import ssl

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SpanExportResult

from inferprof.collector.auth import token_matches
from inferprof.collector.settings import CollectorSettings
from tests.collector.test_server_fixtures import make_requests, running_app

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _cert(subject, issuer, public_key, signing_key, *, ca, extensions=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A test CA and a server certificate for localhost / 127.0.0.1 it signed, as PEM
    files: (CA certificate, server certificate, server key)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inferprof test CA")])
    ca = _cert(
        ca_name,
        ca_name,
        ca_key.public_key(),
        ca_key,
        ca=True,
        extensions=[
            (
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                True,
            )
        ],
    )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    leaf = _cert(
        name,
        ca_name,
        key.public_key(),
        ca_key,
        ca=False,
        extensions=[
            (
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                False,
            ),
            (x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False),
            (x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False),
        ],
    )
    directory = tmp_path_factory.mktemp("tls")
    ca_path, cert_path, key_path = (
        directory / "ca.pem",
        directory / "cert.pem",
        directory / "key.pem",
    )
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(ca_path), str(cert_path), str(key_path)


def test_token_matching_is_exact_and_scheme_insensitive():
    assert token_matches(f"Bearer {TOKEN}", TOKEN)
    assert token_matches(f"bearer {TOKEN}".encode(), TOKEN)
    assert not token_matches(f"Bearer {TOKEN}x", TOKEN)
    assert not token_matches(f"Basic {TOKEN}", TOKEN)
    assert not token_matches(None, TOKEN)
    assert not token_matches("Bearer", TOKEN)


def test_auth_token_is_required_on_grpc_http_and_api_but_not_healthz():
    with running_app(auth_token=TOKEN) as app:
        spans = make_requests(4)
        # gRPC: no token -> UNAUTHENTICATED; with the token -> accepted.
        request = encode_spans(spans)
        with grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Export(request, timeout=5)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                stub.Export(request, timeout=5, metadata=[("authorization", "Bearer wrong")])
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert app.engine.stats.spans_received == 0  # nothing got past the interceptor

        exporter = GrpcExporter(
            endpoint=app.otlp_grpc_endpoint, insecure=True, headers=AUTH, timeout=10
        )
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()

        # HTTP receiver.
        url = f"{app.otlp_http_endpoint}/v1/traces"
        body = encode_spans(make_requests(2, service="http-auth")).SerializeToString()
        pb = {"content-type": "application/x-protobuf"}
        resp = httpx.post(url, content=body, headers=pb)
        assert resp.status_code == 401
        assert resp.headers["www-authenticate"].startswith("Bearer")
        # in the request's encoding, as every other OTLP/HTTP answer
        assert resp.headers["content-type"] == "application/x-protobuf"
        assert status_pb2.Status.FromString(resp.content).code == 16  # UNAUTHENTICATED
        resp = httpx.post(url, content=b"{}", headers={"content-type": "application/json"})
        assert resp.status_code == 401 and resp.json()["code"] == 16
        assert (
            httpx.post(
                url, content=body, headers={**pb, "authorization": "Bearer nope"}
            ).status_code
            == 401
        )
        assert httpx.post(url, content=body, headers={**pb, **AUTH}).status_code == 200

        # API and /metrics; /healthz stays open for probes.
        api = app.api_url
        resp = httpx.get(f"{api}/metrics")
        assert resp.status_code == 401 and "token" in resp.json()["error"]  # as API errors
        assert httpx.get(f"{api}/api/v1/breakdown", params={"service": "svc"}).status_code == 401
        assert httpx.get(f"{api}/healthz").status_code == 200
        app.engine.flush()
        resp = httpx.get(f"{api}/api/v1/breakdown", params={"service": "svc"}, headers=AUTH)
        assert resp.status_code == 200 and resp.json()["requests"] == 4
        metrics = httpx.get(f"{api}/metrics", headers=AUTH).text
        assert 'outcome="unauthenticated",signal="traces",transport="grpc"} 2.0' in metrics
        assert 'outcome="unauthenticated",signal="traces",transport="http"} 3.0' in metrics


def test_auth_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with running_app(auth_token_file=str(token_file)) as app:
        assert httpx.get(f"{app.api_url}/api/v1/services").status_code == 401
        assert httpx.get(f"{app.api_url}/api/v1/services", headers=AUTH).status_code == 200


def test_tls_and_token_with_sdk_exporters_on_grpc_and_http(tls_files, monkeypatch):
    ca, cert, key = tls_files
    # requests lets these variables override the exporter's certificate_file.
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    with running_app(auth_token=TOKEN, tls_cert=cert, tls_key=key) as app:
        assert app.otlp_grpc_endpoint.startswith("https://")
        assert app.api_url.startswith("https://")
        with open(ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(f.read())
        grpc_exporter = GrpcExporter(
            endpoint=app.otlp_grpc_endpoint, credentials=credentials, headers=AUTH, timeout=10
        )
        http_exporter = HttpExporter(
            endpoint=f"{app.otlp_http_endpoint}/v1/traces",
            certificate_file=ca,
            headers=AUTH,
            timeout=10,
        )
        try:
            assert grpc_exporter.export(make_requests(3)) is SpanExportResult.SUCCESS
            assert http_exporter.export(make_requests(2)) is SpanExportResult.SUCCESS
        finally:
            grpc_exporter.shutdown()
            http_exporter.shutdown()
        app.engine.flush()
        resp = httpx.get(
            f"{app.api_url}/api/v1/breakdown",
            params={"service": "svc"},
            headers=AUTH,
            verify=ssl.create_default_context(cafile=ca),
        )
        assert resp.status_code == 200 and resp.json()["requests"] == 5
        # Plain HTTP to a TLS listener gets no answer; an unknown CA fails verification.
        plain = app.api_url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{plain}/healthz", timeout=3)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{app.api_url}/healthz", timeout=3)  # system CAs do not know it


def test_tls_settings_must_come_in_pairs(tls_files):
    with pytest.raises(ValueError, match="together"):
        CollectorSettings(tls_cert=tls_files[1])


NON_ASCII_TOKEN = "pässwörd-☃-τ"


def test_a_non_ascii_token_works_over_http_and_the_api_and_grpc_is_warned_of(caplog):
    with caplog.at_level("WARNING", logger="inferprof.collector.app"), \
            running_app(auth_token=NON_ASCII_TOKEN) as app:
        utf8 = b"Bearer " + NON_ASCII_TOKEN.encode("utf-8")
        pb = {"content-type": "application/x-protobuf"}
        url = f"{app.otlp_http_endpoint}/v1/traces"
        body = encode_spans(make_requests(2, service="utf8")).SerializeToString()
        # Header values are bytes on the wire: the token's UTF-8 bytes match.
        ok = httpx.post(url, content=body, headers={**pb, "authorization": utf8})
        assert ok.status_code == 200
        api = httpx.get(f"{app.api_url}/metrics", headers={"authorization": utf8})
        assert api.status_code == 200
        wrong = b"Bearer " + NON_ASCII_TOKEN[:-1].encode("utf-8")
        refused = httpx.post(url, content=body, headers={**pb, "authorization": wrong})
        assert refused.status_code == 401
    # gRPC metadata values are printable ASCII (gRPC clients refuse to send others).
    assert any("gRPC" in r.getMessage() and "ASCII" in r.getMessage() for r in caplog.records)


def test_token_matching_compares_bytes():
    token = NON_ASCII_TOKEN
    assert token_matches(b"Bearer " + token.encode("utf-8"), token)
    assert token_matches(f"Bearer {token}", token)
    assert not token_matches(b"Bearer " + token.encode("utf-8")[:-1], token)
    assert not token_matches(b"Bearer \xff" + token.encode("utf-8"), token)
    # Python's http.client (under the OpenTelemetry HTTP exporter) sends Latin-1 bytes.
    assert token_matches(b"Bearer " + "pässwörd".encode("latin-1"), "pässwörd")
    assert not token_matches(b"Bearer " + "pässwörd".encode("latin-1"), "pässwört")
