"""The deployment examples under deploy/ agree with the code and with each other."""

from __future__ import annotations

import pathlib
import re

import yaml

from inferprof.collector import settings as st
from inferprof.collector.command import collect
from inferprof.gpu import sampler as gpu_sampler
from inferprof.gpu.command import gpu

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
# `inferprof collect` and `inferprof gpu` (the GPU sampler DaemonSet).
FLAGS = {opt for cmd in (collect, gpu) for param in cmd.params for opt in getattr(param, "opts", ())}
ENV_VARS = {
    getattr(module, name)
    for module in (st, gpu_sampler)
    for name in dir(module)
    if name.startswith("ENV_")
}


def _yaml_docs(path: pathlib.Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def test_every_deploy_yaml_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 6
    for path in files:
        assert _yaml_docs(path), path


def test_flags_and_variables_used_in_deploy_files_exist():
    for path in DEPLOY.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text()
        for flag in re.findall(r'"(--[a-z][a-z0-9-]+)"', text):
            assert flag in FLAGS, (path, flag)
        for var in re.findall(r"\b(INFERPROF_[A-Z_]+)\b", text):
            assert var in ENV_VARS, (path, var)


def test_otelcol_pipelines_only_name_defined_components():
    for path in (DEPLOY / "otelcol").glob("*.yaml"):
        (config,) = _yaml_docs(path)
        for pipeline in config["service"]["pipelines"].values():
            for kind in ("receivers", "processors", "exporters"):
                for name in pipeline.get(kind, ()):
                    assert name in config[kind], (path, kind, name)


def test_loadbalancing_example_routes_by_trace_to_the_k8s_headless_service():
    (otelcol,) = _yaml_docs(DEPLOY / "otelcol" / "loadbalancing-to-inferprof.yaml")
    lb = otelcol["exporters"]["loadbalancing/inferprof"]
    assert lb["routing_key"] == "traceID"
    manifests = _yaml_docs(DEPLOY / "k8s" / "inferprof-collector.yaml")
    headless = next(
        m for m in manifests if m["kind"] == "Service" and m["spec"].get("clusterIP") == "None"
    )
    statefulset = next(m for m in manifests if m["kind"] == "StatefulSet")
    host = f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
    assert lb["resolver"]["dns"]["hostname"] == host
    assert statefulset["spec"]["serviceName"] == headless["metadata"]["name"]
    pod0 = f"{statefulset['metadata']['name']}-0.{host}:4317"
    assert otelcol["exporters"]["otlp/inferprof-0"]["endpoint"] == pod0


def test_every_otelcol_exporter_to_inferprof_sends_the_bearer_token():
    # The k8s collector requires a token on every listener (INFERPROF_AUTH_TOKEN_FILE):
    # an exporter without the header would have its exports refused, UNAUTHENTICATED.
    manifests = _yaml_docs(DEPLOY / "k8s" / "inferprof-collector.yaml")
    statefulset = next(m for m in manifests if m["kind"] == "StatefulSet")
    env = {e["name"] for c in statefulset["spec"]["template"]["spec"]["containers"]
           for e in c.get("env", ())}
    assert st.ENV_AUTH_TOKEN_FILE in env or st.ENV_AUTH_TOKEN in env
    checked = 0
    for path in (DEPLOY / "otelcol").glob("*.yaml"):
        (config,) = _yaml_docs(path)
        for name, exporter in config["exporters"].items():
            if "inferprof" not in name:
                continue
            if name.startswith("loadbalancing"):
                exporter = exporter["protocol"]["otlp"]
            auth = exporter.get("headers", {}).get("authorization", "")
            assert auth.startswith("Bearer "), (path.name, name)
            checked += 1
    assert checked >= 4  # agent: 1; load balancing: the router and one per instance


def test_k8s_manifests_validate_against_the_kubernetes_api_schema():
    # Strict: unknown fields (a typo in a probe, a misplaced securityContext) fail too.
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    resources = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in _yaml_docs(path)]
    assert {r["kind"] for r in resources} >= {"StatefulSet", "Service", "Secret"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)  # raises if invalid
