"""The Kubernetes manifests in ``deploy/kubernetes`` (and the Grafana dashboard beside them): every
resource passes the Kubernetes
schema (``kubernetes-validate``, offline, strict: unknown fields are errors), the pieces refer
to each other correctly, and every flag they give the ``syncopate`` binary is one it takes."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import ROOT, binary

MANIFESTS = ROOT / "deploy" / "kubernetes"
VERSION = "1.30"


def resources() -> list[dict[str, Any]]:
    """Every resource the kustomization lists, in its order."""
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        out += [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [r for r in resources() if r["kind"] == kind]


def test_every_manifest_is_listed_and_passes_the_schema() -> None:
    listed = set(yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    for r in resources():
        kubernetes_validate.validate(r, desired_version=VERSION, strict=True)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    deployment = copy.deepcopy(by_kind("Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["argz"] = ["coordinator"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, desired_version=VERSION, strict=True)


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (r["metadata"]["name"], r["spec"]["template"]["spec"])
        for r in resources()
        if r["kind"] in ("Deployment", "StatefulSet", "Job")
    ]


def test_references_resolve() -> None:
    secret = by_kind("Secret")[0]
    claims = {c["metadata"]["name"] for c in by_kind("PersistentVolumeClaim")}
    for name, spec in pod_specs():
        for volume in spec["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["secretName"] == secret["metadata"]["name"], name
                for item in volume["secret"]["items"]:
                    assert item["key"] in secret["stringData"], (name, item)
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"], name
                    assert ref["key"] in secret["stringData"], (name, ref)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec["volumes"]}, name
    # Services select the pods they front, on the ports those listen on.
    workloads = [r for r in resources() if r["kind"] in ("Deployment", "StatefulSet")]
    for svc in by_kind("Service"):
        selector = svc["spec"]["selector"]
        fronted = [
            w
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(fronted) == 1, svc["metadata"]["name"]
        ports = {
            p["containerPort"]
            for c in fronted[0]["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        assert {p.get("targetPort", p["port"]) for p in svc["spec"]["ports"]} <= ports


def test_every_address_and_flag_is_one_the_binary_takes() -> None:
    (coordinator_svc,) = [s for s in by_kind("Service") if "coordinator" in s["metadata"]["name"]]
    address = f"{coordinator_svc['metadata']['name']}:{coordinator_svc['spec']['ports'][0]['port']}"
    help_of: dict[str, str] = {}
    for name, spec in pod_specs():
        for c in spec["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "command" in c:
                # A worker script: it reaches the coordinator through its service's name.
                assert env["SYNCOPATE_COORDINATOR"] == address, name
                assert (ROOT / c["command"][1].replace("/opt/syncopate/", "")).exists(), name
                continue
            role, *flags = c["args"]
            if role not in help_of:
                out = subprocess.run(
                    [str(binary()), role, "--help"], capture_output=True, text=True, check=True
                )
                help_of[role] = out.stdout
            for flag in flags:
                key = flag.split("=")[0]
                assert re.search(rf"^\s+{re.escape(key)}\b", help_of[role], re.M), (name, key)
                if key == "--coordinator":
                    assert flag == f"--coordinator={address}", name


def test_the_grafana_dashboard_queries_only_metrics_the_cluster_exposes() -> None:
    """Every ``syncopate_*`` series a panel of ``deploy/grafana/syncopate.json`` queries is a
    family ``docs/observability.md`` lists (with the suffix its type gives it on the wire); the Rust
    suite checks that list against what the coordinator and servers expose."""

    dashboard = json.loads((ROOT / "deploy" / "grafana" / "syncopate.json").read_text())
    documented: dict[str, str] = {}
    for line in (ROOT / "docs" / "observability.md").read_text().splitlines():
        m = re.match(r"\| `(syncopate_\w+)` \| (\w+) \|", line)
        if m:
            documented[m.group(1)] = m.group(2)
    suffixes = {
        "counter": ["_total"],
        "gauge": [""],
        "info": ["_info"],
        "histogram": ["_bucket", "_sum", "_count"],
    }
    series = {name + s for name, kind in documented.items() for s in suffixes[kind]}
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"syncopate_\w+", target["expr"]))
    assert queried, "the dashboard queries nothing"
    assert queried <= series, sorted(queried - series)
    # Panels do not overlap on the grid.
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not (cells & mine), panel["title"]
        cells |= mine
