"""The dashboard's GPU and Redis queries evaluated by Prometheus's own engine (promtool test rules) on series
laid out as Kubernetes and compose produce them: the GPU panels show the GPUs of the chosen run's opsd pods and
nothing else, whichever way dcgm-exporter's pod labels arrive; compose (no namespace, no pod) shows every GPU.

promtool comes from Debian's prometheus package (`make promtool`, part of `make test`), the Prometheus version
docker-compose.debian.yml runs.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.deploy_tools import ROOT, tool

DASHBOARD = ROOT / "deploy/grafana/dashboards/opsd.json"
# opsd's own series of one pod (a counter every role creates at start: opsd.metrics.init_series).
OPSD = 'opsd_groups_total{{job="opsd", {where}, role="{role}"}}'


def expr(title: str, var: dict[str, str], ref: str = "A") -> str:
    """Panel `title`'s query `ref` with Grafana's variables replaced as Grafana would (All = .*)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (target,) = [t for p in panels if p["title"] == title for t in p["targets"] if t["refId"] == ref]
    out = target["expr"].replace("$__rate_interval", "1m")
    for name, value in var.items():
        out = out.replace(f"${name}", value)
    assert "$namespace" not in out and "$role" not in out, out
    return out


def evaluate(tmp_path, series: list[str], tests: list[tuple[str, list[dict]]]) -> subprocess.CompletedProcess:
    """promtool test rules: each (PromQL, expected samples) at 2m over `series` (series i holds the constant i + 1)."""
    spec = {"evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": f"{i + 1}x5"} for i, s in enumerate(series)],
        "promql_expr_test": [{"expr": q, "eval_time": "2m", "exp_samples": expected} for q, expected in tests],
    }]}
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return subprocess.run([tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


def sample(value: int, **labels: str) -> dict:
    return {"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}", "value": value}


# Two runs (namespaces run-a, run-b), another team's GPU job, an idle GPU: four GPUs on node n1.
PODS = [("run-a", "rollout-0", "rollout"), ("run-a", "trainer-0", "trainer"), ("run-b", "rollout-0", "rollout")]


@pytest.mark.parametrize("honor_labels", [True, False], ids=["pod labels as sent", "renamed exported_*"])
def test_the_gpu_panels_show_only_the_chosen_runs_pods(tmp_path, honor_labels):
    def dcgm(gpu_id: int, ns: str, pod: str) -> str:
        owner = f'namespace="{ns}", pod="{pod}"'
        if not honor_labels:  # the target's labels (the exporter pod's) win; dcgm-exporter's are renamed
            owner = (f'namespace="gpu-operator", pod="nvidia-dcgm-exporter-7x2", exported_namespace="{ns}", '
                     f'exported_pod="{pod}"' if pod else 'namespace="gpu-operator", pod="nvidia-dcgm-exporter-7x2"')
        return f'DCGM_FI_DEV_GPU_UTIL{{job="dcgm", Hostname="n1", gpu="{gpu_id}", UUID="GPU-{gpu_id}", {owner}}}'

    series = [dcgm(0, "run-a", "rollout-0"), dcgm(1, "run-a", "trainer-0"), dcgm(2, "run-b", "rollout-0"),
              dcgm(3, "ml-team", "notebook-0"), dcgm(4, "", "")]
    series += [OPSD.format(where=f'namespace="{ns}", pod="{pod}"', role=role) for ns, pod, role in PODS]
    title = "GPU utilization"
    a0, a1, b0 = (sample(1, Hostname="n1", gpu="0", namespace="run-a", pod="rollout-0"),
                  sample(2, Hostname="n1", gpu="1", namespace="run-a", pod="trainer-0"),
                  sample(3, Hostname="n1", gpu="2", namespace="run-b", pod="rollout-0"))
    p = evaluate(tmp_path, series, [
        (expr(title, {"namespace": "run-a", "role": ".*"}), [a0, a1]),
        (expr(title, {"namespace": "run-a", "role": "trainer"}), [a1]),
        (expr(title, {"namespace": ".*", "role": ".*"}), [a0, a1, b0]),  # All: every opsd run, no one else's GPU
        (expr(title, {"namespace": "run-b", "role": "trainer"}), []),
    ])
    assert p.returncode == 0, p.stdout + p.stderr
    # The check can fail: every GPU of the cluster (the query before the filter) is not what the panel must show.
    p = evaluate(tmp_path, series, [("max by (Hostname, gpu, namespace, pod) (DCGM_FI_DEV_GPU_UTIL)", [a0, a1, b0])])
    assert p.returncode != 0 and 'gpu="3"' in p.stdout + p.stderr, p.stdout + p.stderr  # ml-team's


def test_compose_shows_every_gpu_and_the_redis_row(tmp_path):
    """compose: no namespace, no pod on either side (dcgm-exporter without Kubernetes, opsd by DNS discovery)."""
    series = [f'DCGM_FI_DEV_FB_USED{{job="dcgm-exporter", instance="dcgm-exporter:9400", Hostname="ws", gpu="{g}"}}'
              for g in (0, 1)]
    series += [OPSD.format(where=f'instance="{r}:8000", service="{r}"', role=r) for r in ("rollout", "trainer")]
    series += ['redis_memory_used_bytes{job="redis", instance="redis-exporter:9121"}',
               'redis_memory_max_bytes{job="redis", instance="redis-exporter:9121"}']
    all_ = {"namespace": ".*", "role": ".*"}
    p = evaluate(tmp_path, series, [
        (expr("GPU memory used", all_), [sample(1, Hostname="ws", gpu="0"), sample(2, Hostname="ws", gpu="1")]),
        (expr("Redis memory: used vs maxmemory", all_, "A"), [sample(5)]),
        (expr("Redis memory: used vs maxmemory", all_, "B"), [sample(6)]),
    ])
    assert p.returncode == 0, p.stdout + p.stderr
