"""The deployment examples under deploy/ agree with the code and with each other."""

from __future__ import annotations

import json
import pathlib
import re
import urllib.parse

import pytest
import yaml

from inferprof import semconv
from inferprof.collector import examples, exemplars
from inferprof.collector import settings as st
from inferprof.collector.command import collect
from inferprof.gpu import sampler as gpu_sampler
from inferprof.gpu.command import gpu

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
# `inferprof collect` and `inferprof gpu` (the GPU sampler DaemonSet).
FLAGS = {
    opt for cmd in (collect, gpu) for param in cmd.params for opt in getattr(param, "opts", ())
}
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


# The loadbalancing exporter's routing keys, per pipeline type, as its README lists them
# (opentelemetry-collector-contrib, exporter/loadbalancingexporter): traces never by
# resource or metric name, metrics never by trace ID.
ROUTING_KEYS = {
    "traces": {"traceID", "service"},
    "metrics": {"service", "resource", "metric", "streamID"},
}
# The summaries a service in production mode sends (contract §15).
SUMMARY_METRICS = semconv.SUMMARY_METRICS
GPU_METRICS = tuple(
    getattr(semconv, name) for name in dir(semconv)
    if name.startswith(("METRIC_GPU_", "METRIC_DCGM_")) and name != "METRIC_DCGM_PREFIX"
)
LOADBALANCING = {
    "loadbalancing-to-inferprof.yaml": "traceID",
    "loadbalancing-by-service-to-inferprof.yaml": "service",
}


def _k8s_collector() -> tuple[dict, dict, dict]:
    """The headless Service, the StatefulSet and its container, from the manifest."""
    manifests = _yaml_docs(DEPLOY / "k8s" / "inferprof-collector.yaml")
    headless = next(
        m for m in manifests if m["kind"] == "Service" and m["spec"].get("clusterIP") == "None"
    )
    statefulset = next(m for m in manifests if m["kind"] == "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return headless, statefulset, container


def _keeps(processor: dict, metric_name: str) -> bool:
    """Whether a filter processor lets a metric of this name through.

    Reads the one kind of OTTL condition the shipped configs use, `[not ]IsMatch(name,
    "regex")` in the metric context (the filter drops what any condition matches); any
    other condition fails, so the check cannot silently pass over what it does not read.
    """
    for condition in processor["metrics"]["metric"]:
        found = re.fullmatch(r'(not )?IsMatch\(name, "([^"\\]*)"\)', condition)
        assert found, condition
        negated, pattern = found.groups()
        if bool(re.search(pattern, metric_name)) != bool(negated):
            return False
    return True


def _metric_destinations(config: dict, metric_name: str) -> list[str]:
    """The exporters a metric of this name reaches, once per pipeline that sends it there."""
    out = []
    for name, pipeline in config["service"]["pipelines"].items():
        if name.split("/")[0] != "metrics":
            continue
        if all(_keeps(config["processors"][p], metric_name)
               for p in pipeline.get("processors", ()) if p.split("/")[0] == "filter"):
            out.extend(pipeline["exporters"])
    return out


@pytest.mark.parametrize("filename", sorted(LOADBALANCING))
def test_loadbalancing_examples_route_to_every_pod_of_the_k8s_statefulset(filename):
    (otelcol,) = _yaml_docs(DEPLOY / "otelcol" / filename)
    headless, statefulset, container = _k8s_collector()
    grpc_port = st.CollectorSettings().grpc_port
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["otlp-grpc"] == grpc_port
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]}["otlp-grpc"] == grpc_port
    assert statefulset["spec"]["serviceName"] == headless["metadata"]["name"]
    host = f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
    balancers = {name: e for name, e in otelcol["exporters"].items()
                 if name.split("/")[0] == "loadbalancing"}
    assert balancers
    for exporter in balancers.values():
        # the headless Service's DNS name gives one address per ready pod, on its gRPC port
        assert exporter["resolver"]["dns"] == {"hostname": host, "port": grpc_port}
        assert "endpoint" not in exporter["protocol"]["otlp"]  # the resolver sets it
    pipelines = otelcol["service"]["pipelines"]
    for name, pipeline in pipelines.items():
        signal = name.split("/")[0]
        for exporter in pipeline["exporters"]:
            if exporter in balancers:
                assert balancers[exporter]["routing_key"] in ROUTING_KEYS[signal], (name, exporter)
    (traces,) = (p for n, p in pipelines.items() if n.split("/")[0] == "traces")
    (router,) = traces["exporters"]
    assert balancers[router]["routing_key"] == LOADBALANCING[filename]
    # one otlp exporter per pod of the StatefulSet (stable names <statefulset>-<ordinal>)
    per_pod = {e["endpoint"] for name, e in otelcol["exporters"].items()
               if name.split("/")[0] == "otlp"}
    assert per_pod == {f"{statefulset['metadata']['name']}-{i}.{host}:{grpc_port}"
                       for i in range(statefulset["spec"]["replicas"])}


@pytest.mark.parametrize("filename", sorted(LOADBALANCING))
def test_loadbalancing_examples_send_summaries_to_one_pod_and_gpu_samples_to_all(filename):
    # Summaries are DELTA counts that the fleet tables sum across collectors: a copy on a
    # second collector would count the same requests twice. GPU samples carry no trace
    # ID: every collector joins those of the hosts its traces came from.
    (otelcol,) = _yaml_docs(DEPLOY / "otelcol" / filename)
    exporters = otelcol["exporters"]
    per_pod = sorted(n for n in exporters if n.split("/")[0] == "otlp")
    assert len(GPU_METRICS) >= 8
    for metric in GPU_METRICS:
        assert sorted(_metric_destinations(otelcol, metric)) == per_pod, metric
    for metric in SUMMARY_METRICS:
        (destination,) = _metric_destinations(otelcol, metric)
        assert destination.split("/")[0] == "loadbalancing", metric
        assert exporters[destination]["routing_key"] in ROUTING_KEYS["metrics"]
    # a metric neither of them names (an application's own) still reaches the pods
    assert sorted(_metric_destinations(otelcol, "http.server.request.duration")) == per_pod


def test_agent_example_sends_summaries_and_gpu_samples_to_its_one_collector():
    (otelcol,) = _yaml_docs(DEPLOY / "otelcol" / "agent-to-inferprof.yaml")
    for metric in SUMMARY_METRICS + GPU_METRICS:
        assert _metric_destinations(otelcol, metric) == ["otlp/inferprof"], metric


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
    assert checked >= 9  # agent: 1; per load-balancing file: 2 routers and one per instance


def test_k8s_manifests_validate_against_the_kubernetes_api_schema():
    # Strict: unknown fields (a typo in a probe, a misplaced securityContext) fail too.
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    resources = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in _yaml_docs(path)]
    assert {r["kind"] for r in resources} >= {"StatefulSet", "Service", "Secret"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)  # raises if invalid


def test_kubernetes_scrape_job_scrapes_each_collector_pod_of_the_manifest():
    # Prometheus must scrape every pod, not the load-balanced Service (a different pod per
    # scrape): the shipped job keeps the headless Service's port by name, and that Service
    # must expose it; the job name is the one the CollectorDown alert watches.
    (config,) = _yaml_docs(DEPLOY / "prometheus" / "kubernetes-scrape.yml")
    job, fleet = config["scrape_configs"]
    # the fleet job scrapes the same pods' /metrics/fleet, which the manifest turns on
    assert fleet["metrics_path"] == "/metrics/fleet"
    assert fleet["relabel_configs"] == job["relabel_configs"]
    assert int(fleet["scrape_timeout"][:-1]) <= int(fleet["scrape_interval"][:-1])
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    assert keep["source_labels"] == [
        "__meta_kubernetes_service_name", "__meta_kubernetes_endpoint_port_name"]
    service_name, port_name = keep["regex"].split(";")
    manifests = _yaml_docs(DEPLOY / "k8s" / "inferprof-collector.yaml")
    headless = next(
        m for m in manifests if m["kind"] == "Service" and m["spec"].get("clusterIP") == "None"
    )
    assert service_name == headless["metadata"]["name"]
    assert port_name in {p["name"] for p in headless["spec"]["ports"]}
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [
        headless["metadata"]["namespace"]]
    statefulset = next(m for m in manifests if m["kind"] == "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert port_name in {p["name"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[st.ENV_FLEET_METRICS] == "true"
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    down = next(r for g in alerts["groups"] for r in g["rules"]
                if r.get("alert") == "InferprofCollectorDown")
    assert f'job="{job["job_name"]}"' in down["expr"]


def _mounts(workload: dict) -> dict[str, dict]:
    """mount path -> the volume mounted there, for a Deployment's one container."""
    spec = workload["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def test_kustomization_wires_otelcol_and_prometheus_to_the_collectors():
    # `kubectl apply -k deploy/`: the ConfigMaps are the deploy files themselves, mounted
    # where the programs read them, under the names the manifests ask for.
    (kustomization,) = _yaml_docs(DEPLOY / "kustomization.yaml")
    resources = {path: _yaml_docs(DEPLOY / path) for path in kustomization["resources"]}
    assert set(resources) == {f"k8s/{p.name}" for p in (DEPLOY / "k8s").glob("*.yaml")}
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for docs in resources.values()
                    for d in docs}
    generated = {}
    for generator in kustomization["configMapGenerator"]:
        files = dict(f.split("=", 1) for f in generator["files"])
        assert all((DEPLOY / path).is_file() for path in files.values()), files
        generated[generator["name"]] = files

    otelcol = by_kind_name[("Deployment", "otel-collector")]
    (container,) = otelcol["spec"]["template"]["spec"]["containers"]
    (config_arg,) = container["args"]
    config_path = pathlib.PurePosixPath(config_arg.removeprefix("--config="))
    volume = _mounts(otelcol)[str(config_path.parent)]
    files = generated[volume["configMap"]["name"]]
    assert files[config_path.name] in {f"otelcol/{name}" for name in LOADBALANCING}
    token = next(e for e in container["env"] if e["name"] == st.ENV_AUTH_TOKEN)
    assert token["valueFrom"]["secretKeyRef"]["name"] in {
        name for kind, name in by_kind_name if kind == "Secret"}
    # the GPU samplers and the services export to this Service, on its OTLP/gRPC port
    service = by_kind_name[("Service", "otel-collector")]
    sampler = by_kind_name[("DaemonSet", "inferprof-gpu-sampler")]
    env = {e["name"]: e.get("value") for c in sampler["spec"]["template"]["spec"]["containers"]
           for e in c["env"]}
    endpoint = urllib.parse.urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}"
    assert endpoint.port in {p["port"] for p in service["spec"]["ports"]}

    prometheus = by_kind_name[("Deployment", "prometheus")]
    (container,) = prometheus["spec"]["template"]["spec"]["containers"]
    config_path = pathlib.PurePosixPath(next(
        a for a in container["args"] if a.startswith("--config.file=")).split("=", 1)[1])
    mounts = _mounts(prometheus)
    files = generated[mounts[str(config_path.parent)]["configMap"]["name"]]
    assert files[config_path.name] == "prometheus/kubernetes-scrape.yml"
    (scrape,) = _yaml_docs(DEPLOY / files[config_path.name])
    for rule_file in scrape["rule_files"]:
        path = pathlib.PurePosixPath(rule_file)
        assert str(path.parent) == str(config_path.parent) and path.name in files, rule_file
    assert {files[pathlib.PurePosixPath(r).name] for r in scrape["rule_files"]} >= {
        "prometheus/alerts.yml", "prometheus/fleet.yml"}
    for job in scrape["scrape_configs"]:
        credentials = pathlib.PurePosixPath(job["authorization"]["credentials_file"])
        assert mounts[str(credentials.parent)]["secret"]["secretName"] == token[
            "valueFrom"]["secretKeyRef"]["name"]
        assert credentials.name == token["valueFrom"]["secretKeyRef"]["key"]
    # discovery of the collectors' endpoints in their namespace
    role = by_kind_name[("Role", "prometheus-discovery")]
    assert role["metadata"]["namespace"] in scrape["scrape_configs"][0][
        "kubernetes_sd_configs"][0]["namespaces"]["names"]
    assert any("endpoints" in r["resources"] and "list" in r["verbs"] for r in role["rules"])
    binding = by_kind_name[("RoleBinding", "prometheus-discovery")]
    assert binding["subjects"][0]["name"] == prometheus["spec"]["template"]["spec"][
        "serviceAccountName"]


def test_k8s_collector_memory_bounds_fit_its_limit():
    # Worst case by docs/collector.md's sizing: pending spans x 1 KiB, plus per transport
    # (gRPC, HTTP) max-concurrent-requests x max-body-bytes; with room for the process.
    manifests = _yaml_docs(DEPLOY / "k8s" / "inferprof-collector.yaml")
    statefulset = next(m for m in manifests if m["kind"] == "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    defaults = st.CollectorSettings()
    pending = int(env.get(st.ENV_MAX_PENDING_SPANS, defaults.max_pending_spans))
    concurrent = int(env.get(st.ENV_MAX_CONCURRENT_REQUESTS, defaults.max_concurrent_requests))
    body = int(env.get(st.ENV_MAX_BODY_BYTES, defaults.max_body_bytes))
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    worst = pending * 1024 + 2 * concurrent * body
    assert worst <= 0.75 * float(limit[:-2]) * 2**30, (worst / 2**30, limit)


COMPOSE = DEPLOY / "compose"
DASHBOARD = DEPLOY / "grafana" / "inferprof-dashboard.json"


def _host_ports(service: dict) -> dict[int, int]:
    """host port -> container port of a compose service's published ports."""
    out = {}
    for spec in service.get("ports", ()):
        host, container = str(spec).rsplit(":", 2)[-2:]
        out[int(host)] = int(container.split("/")[0])
    return out


def test_compose_forwards_to_jaeger_on_ports_clear_of_the_collectors_defaults():
    (compose,) = _yaml_docs(COMPOSE / "compose.yaml")
    services = compose["services"]
    defaults = st.CollectorSettings()
    collector_ports = {defaults.grpc_port, defaults.http_port, defaults.api_port}
    jaeger = services["jaeger"]
    published = _host_ports(jaeger)
    # `inferprof collect` on its defaults and this Jaeger run side by side
    assert not set(published) & collector_ports
    assert published[14317] == 4317 and published[14318] == 4318  # OTLP, for a host collector
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    command = services["inferprof"]["command"]
    forward = command[command.index("--forward") + 1]
    assert forward == "otlp-grpc://jaeger:4317"  # Jaeger's OTLP/gRPC inside the network
    st.validate_forward_url(forward)
    # the breakdown's examples link to Jaeger's UI as published on the host
    template = command[command.index("--trace-url") + 1]
    assert examples.check_template(template) == template
    ui = urllib.parse.urlsplit(examples.link(template, "0" * 32))
    assert ui.port in published and published[ui.port] == 16686
    prometheus = services["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in prometheus
    (prom_config,) = _yaml_docs(COMPOSE / "prometheus.yml")
    mounted = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert set(prom_config["rule_files"]) <= mounted
    assert any(path.endswith("budgets.yml") for path in prom_config["rule_files"])


def test_grafana_exemplars_link_to_the_trace_data_source():
    (config,) = _yaml_docs(COMPOSE / "grafana" / "datasources.yaml")
    by_uid = {ds["uid"]: ds for ds in config["datasources"]}
    destinations = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert [d["name"] for d in destinations] == [exemplars.TRACE_ID_LABEL]
    assert by_uid[destinations[0]["datasourceUid"]]["type"] in ("jaeger", "tempo")
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    # the dashboard's trace variable offers the provisioned trace data source's type
    assert variables["traces"]["type"] == "datasource"
    assert variables["traces"]["query"] == by_uid[destinations[0]["datasourceUid"]]["type"]
    # exemplars are asked for on histogram queries only (no other series carries them),
    # on the stage and the request histograms both
    with_exemplars = [t["expr"] for p in dashboard["panels"] for t in p["targets"]
                      if t.get("exemplar")]
    assert all("_bucket{" in expr for expr in with_exemplars)
    assert any("inferprof_stage_duration_seconds_bucket" in e for e in with_exemplars)
    assert any("inferprof_request_duration_seconds_bucket" in e for e in with_exemplars)


def test_dashboard_trace_links_template_to_a_search_of_the_service():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    builtins = {"__from", "__to"}
    links = [link for p in dashboard["panels"] for link in p.get("links", ())]
    assert len(links) >= 2
    for link in links:
        used = set(re.findall(r"\$\{([^}:]+)", link["url"]))
        assert used <= variables | builtins, used
        # Grafana's interpolation: each ${name} replaced by its value
        url = link["url"]
        for name, value in (("traces", "jaeger"), ("service", "checkout"),
                            ("__from", "1700000000000"), ("__to", "1700003600000")):
            url = url.replace("${" + name + "}", value)
        parts = urllib.parse.urlsplit(url)
        assert parts.path == "/explore"
        query = urllib.parse.parse_qs(parts.query)
        (pane,) = json.loads(query["panes"][0]).values()
        assert pane["datasource"] == "jaeger"
        (search,) = pane["queries"]
        assert search["datasource"]["uid"] == "jaeger"
        assert search["queryType"] == "search" and search["service"] == "checkout"
        assert pane["range"] == {"from": "1700000000000", "to": "1700003600000"}
