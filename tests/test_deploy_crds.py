"""Every object the Kubernetes files render passes a schema check, custom resources included.

Rendered: each overlay of k8s/overlays/, and each overlay with each component of k8s/components/ it leaves
out (found by glob, so new ones are covered). Core kinds go through kubernetes-validate's bundled Kubernetes
schemas; custom resources (KEDA's ScaledObject and TriggerAuthentication, the Prometheus Operator's
PodMonitor, ...) through the openAPIV3Schema of the CRD versions k8s/crds/pins.yaml pins (vendored by
scripts/crd_schemas.py), with jsonschema. Both strictly: an unknown field is an error, as it is for
`kubectl apply` (server-side field validation Strict) and for the API server's structural schemas. Not
checked offline: the CRDs' CEL rules (x-kubernetes-validations) and admission webhooks. Negative controls
prove each check can fail.
"""

from __future__ import annotations

import copy
import os
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.deploy_tools import CRDS, ROOT, check, crd_errors, crd_schemas, run_tool, tool

K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").is_file())
# A wrong type (or format) per custom kind: a field path in the gpu overlay's object, and a value the CRD refuses.
WRONG_TYPES = {
    "ScaledObject": (("spec", "maxReplicaCount"), "8"),  # int32
    "TriggerAuthentication": (("spec", "secretTargetRef", 0, "key"), 7),  # string
    "PodMonitor": (("spec", "podMetricsEndpoints", 0, "interval"), "15 seconds"),  # a Duration: ^(0|([0-9]+)s...)$
}


def builds() -> list[tuple[str, str | None]]:
    """(overlay, a component added to it or None) for every overlay, alone and with each component it lacks."""
    out = []
    for overlay in OVERLAYS:
        k = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
        included = {Path(c).name for c in k.get("components", [])}
        out += [(overlay, None)] + [(overlay, c) for c in COMPONENTS if c not in included]
    return out


@cache
def render(overlay: str, component: str | None, tmp: Path) -> list[dict]:
    """The objects `kubectl kustomize` renders for the overlay (with `component` appended to its components)."""
    source = K8S / "overlays" / overlay
    if component is None:
        text = run_tool([tool("kubectl"), "kustomize", str(source)]).stdout
    else:
        k = yaml.safe_load((source / "kustomization.yaml").read_text())
        work = tmp / f"{overlay}+{component}"
        work.mkdir(parents=True)
        for key in ("resources", "components", "transformers"):
            k[key] = [os.path.relpath((source / p).resolve(), work) for p in k.get(key, [])]
        k["components"].append(os.path.relpath(K8S / "components" / component, work))
        (work / "kustomization.yaml").write_text(yaml.safe_dump(k))
        text = run_tool([tool("kubectl"), "kustomize", str(work)]).stdout
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("builds")


# ------------------------------------------------------------------ the CRD schemas
# ------------------------------------------------------------------ the checks
@pytest.mark.parametrize(("overlay", "component"), builds(), ids=lambda x: x or "as shipped")
def test_every_rendered_object_passes_its_schema(overlay, component, tmp):
    objs = render(overlay, component, tmp)
    problems, custom = check(objs)
    assert not problems, "\n".join(problems)
    assert custom >= 1 and len(objs) > custom


def test_the_builds_cover_every_overlay_component_and_vendored_kind(tmp):
    assert OVERLAYS and COMPONENTS
    seen_components = {c for _, c in builds() if c} | {
        Path(c).name for o in OVERLAYS
        for c in yaml.safe_load((K8S / "overlays" / o / "kustomization.yaml").read_text()).get("components", [])}
    assert seen_components == set(COMPONENTS)
    kinds = {(o["apiVersion"], o["kind"]) for overlay, component in builds() for o in render(overlay, component, tmp)}
    assert set(crd_schemas()) <= kinds, f"vendored but never rendered: {set(crd_schemas()) - kinds}"


def test_the_vendored_schemas_are_the_pinned_versions_and_documented():
    pins = yaml.safe_load((CRDS / "pins.yaml").read_text())
    readme = (CRDS / "README.md").read_text()
    k8s_readme = (K8S / "README.md").read_text()
    for crd in crd_schemas().values():
        src = crd["source"]
        pin = pins[src["repo"]]
        assert (src["version"], src["commit"]) == (pin["version"], pin["commit"]) and src["path"] in pin["files"], src
        name = f"{crd['group']}_{crd['kind']}_{crd['version']}.json"
        assert f"| {name} | {src['repo']} `{src['path']}` | {pin['version']} | {pin['commit']} | {pin['license']} |" in readme
    for repo, pin in pins.items():
        assert re.fullmatch(r"[0-9a-f]{40}", pin["commit"]) and pin["license"], repo
        assert f"{repo} {pin['version']}" in k8s_readme, f"k8s/README.md does not name {repo} {pin['version']}"


@pytest.mark.parametrize("kind", sorted(WRONG_TYPES))
def test_the_crd_check_rejects_an_unknown_field_and_a_wrong_type(kind, tmp):
    """Negative controls: each vendored kind's check fails on a misspelt field and on a value of the wrong type."""
    assert {k for _, k in crd_schemas()} == set(WRONG_TYPES), "every vendored kind needs its negative control"
    (obj,) = [o for o in render("gpu", None, tmp) if o["kind"] == kind][:1]
    assert not crd_errors(obj)
    typo = copy.deepcopy(obj)
    typo["spec"]["maxReplicas"] = 8  # no such field in any of them (HPA's name, not KEDA's)
    assert any("Additional properties are not allowed" in p for p in crd_errors(typo)), crd_errors(typo)
    path, value = WRONG_TYPES[kind]
    wrong = copy.deepcopy(obj)
    node = wrong
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = crd_errors(wrong)
    assert any(".".join(map(str, path)) in p for p in errors), errors


def test_a_custom_resource_without_a_pinned_crd_is_reported():
    """A kind with no vendored schema goes to kubernetes-validate, which has none either: a problem, not a pass."""
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "trainer"},
              "spec": {"replicatedJobs": []}}
    problems, custom = check([jobset])
    assert custom == 0 and problems == ["no schema for JobSet jobset.x-k8s.io/v1alpha2: a custom resource? "
                                        "pin its CRD in k8s/crds/pins.yaml"]
