"""Vendor the schemas of the CRDs that k8s/ uses, at the versions k8s/crds/pins.yaml pins.

    python scripts/crd_schemas.py kedacore/keda=GITDIR prometheus-operator/prometheus-operator=GITDIR

GITDIR: a clone (or bare git dir) of that repository holding the pinned commit. For each pinned file,
each served version's openAPIV3Schema is written to k8s/crds/<group>_<kind>_<version>.json without its
descriptions (documentation: most of the bytes), as compact JSON naming where it came from; then
k8s/crds/README.md lists them. Nothing else of those projects is copied. tests/test_deploy_crds.py
validates the rendered manifests against these files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "k8s" / "crds"


def without_descriptions(schema):
    """`schema` with every `description` of a schema node dropped (a property named "description" stays)."""
    if isinstance(schema, list):
        return [without_descriptions(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description" and isinstance(value, str):
            continue
        if key == "properties":  # keys here are field names, not schema keywords
            out[key] = {name: without_descriptions(sub) for name, sub in value.items()}
        else:
            out[key] = without_descriptions(value)
    return out


def git_show(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repos", nargs="+", metavar="OWNER/NAME=GITDIR")
    args = ap.parse_args()
    git_dirs = dict(arg.split("=", 1) for arg in args.repos)
    pins = yaml.safe_load((CRDS / "pins.yaml").read_text())
    if missing := set(pins) - set(git_dirs):
        ap.error(f"no GITDIR for {sorted(missing)}")
    for old in CRDS.glob("*.json"):
        old.unlink()
    rows = []
    for repo, pin in pins.items():
        tagged = subprocess.run(["git", "--git-dir", git_dirs[repo], "rev-parse", f"{pin['version']}^{{commit}}"],
                                check=True, capture_output=True, text=True).stdout.strip()
        if tagged != pin["commit"]:
            raise SystemExit(f"{repo}: tag {pin['version']} is {tagged}, pins.yaml says {pin['commit']}")
        for path in pin["files"]:
            crd = yaml.safe_load(git_show(git_dirs[repo], pin["commit"], path))
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served", True):
                    continue
                name = f"{group}_{kind}_{version['name']}.json"
                (CRDS / name).write_text(json.dumps({
                    "group": group, "kind": kind, "version": version["name"],
                    "source": {"repo": repo, "version": pin["version"], "commit": pin["commit"], "path": path},
                    "openAPIV3Schema": without_descriptions(version["schema"]["openAPIV3Schema"]),
                }, sort_keys=True, separators=(",", ":")) + "\n")
                rows.append(f"| {name} | {repo} `{path}` | {pin['version']} | {pin['commit']} | {pin['license']} |")
    (CRDS / "README.md").write_text(
        "# CRD schemas\n\n"
        "The openAPIV3Schema of each custom resource k8s/ uses, at the version pins.yaml pins, descriptions\n"
        "dropped, for offline validation (tests/test_deploy_crds.py). Written by scripts/crd_schemas.py: do not\n"
        "edit. Schemas only; each project's license applies to its file.\n\n"
        "| file | from | version | commit | license |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
