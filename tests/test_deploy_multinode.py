"""docker-compose.multinode.yml: the trainer as two containers ("nodes") in one torchrun world.

Validated here without a Docker engine (compose-spec schema, yamllint, `docker-compose config` of the merged
files) and cross-checked with what the trainer needs: one rendezvous for both nodes, node rank 0 alone with the
run volume and Redis, the config's ranks per node equal to torchrun's. `make compose-check` runs it for real
(scripts/compose_check.py --trainer-nodes 2); the log lines that check reads are matched against a real 2-rank
world in tests/test_distributed.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from opsd.config import RunConfig
from tests.deploy_tools import run_tool, tool

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
MULTINODE = ROOT / "docker-compose.multinode.yml"
sys.path.insert(0, str(ROOT / "scripts"))
import compose_check  # noqa: E402


def merged(tmp_path: Path) -> dict:
    env = tmp_path / "compose.env"
    env.write_text("REDIS_PASSWORD=test-redis-0123456789\nOPSD_API_TOKEN=test-token-0123456789\n"
                   "GRAFANA_ADMIN_PASSWORD=test-grafana-0123456789\n")
    args = [tool("docker-compose"), "--env-file", str(env), "-f", str(COMPOSE), "-f", str(MULTINODE), "config"]
    return yaml.safe_load(run_tool(args).stdout)["services"]


def torchrun_args(command: list[str]) -> dict[str, str]:
    """The `--name=value` options before `-m services.trainer` of a `python -m services.trainer.torchrun` command."""
    assert command[:3] == ["python", "-m", "services.trainer.torchrun"], command
    launcher = command[3:command.index("-m", 3)]
    assert command[command.index("-m", 3) + 1] == "services.trainer", command
    return dict(a.removeprefix("--").split("=", 1) for a in launcher)


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume, whether `config` wrote it short (src:dst:mode) or long."""
    return [(v["source"], v["target"]) if isinstance(v, dict) else tuple(v.split(":")[:2]) for v in service["volumes"]]


def test_multinode_override_matches_compose_spec_and_lints():
    run_tool([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(MULTINODE)])
    run_tool([tool("yamllint"), "--strict", "-d", "{extends: relaxed, rules: {line-length: disable}}", str(MULTINODE)])


def test_two_trainer_nodes_share_one_rendezvous_and_only_rank_0_holds_the_run(tmp_path):
    services = merged(tmp_path)
    rank0, rank1 = services["trainer"], services["trainer-1"]
    args0, args1 = torchrun_args(rank0["command"]), torchrun_args(rank1["command"])
    assert (args0.pop("node-rank"), args1.pop("node-rank")) == ("0", "1")
    assert args0 == args1 == {"nnodes": "2", "nproc-per-node": "1", "master-addr": "trainer", "master-port": "29500"}
    tail = rank0["command"][rank0["command"].index("services.trainer"):]
    assert tail == rank1["command"][rank1["command"].index("services.trainer"):]  # same config file and run dir name
    assert rank1["image"] == rank0["image"]
    # Node rank 0: the run volume and Redis. Node rank 1: neither (it gets everything over the process group).
    assert ("opsd-data", "/data") in mounts(rank0)
    assert [target for _, target in mounts(rank1)] == ["/app/configs"]
    assert "REDIS_URL" in rank0["environment"] and "REDIS_URL" not in rank1["environment"]
    assert "OPSD_API_TOKEN" not in rank1["environment"]
    # Both end like a Job's pods: rank 0 exits 0 at DONE (and so releases node 1's torchrun from its exit
    # barrier), rank 1 when rank 0 stops it; neither restarts after a success.
    assert rank0["environment"]["OPSD_EXIT_WHEN_DONE"] == "1"
    assert rank0["restart"] == rank1["restart"] == "on-failure"
    assert rank1["depends_on"] == {"trainer": {"condition": "service_started"}}  # healthy needs rank 1 joined
    assert rank1["healthcheck"]["test"] == ["NONE"]  # no HTTP on ranks > 0
    assert rank1["cap_drop"] == ["ALL"] and rank1["security_opt"] == ["no-new-privileges:true"] and rank1["init"]


def test_the_checks_two_node_config_runs_one_rank_per_container_with_ddp(tmp_path):
    path = tmp_path / "compose-check.yaml"
    path.write_text(yaml.safe_dump(compose_check.multinode_config()))
    cfg = RunConfig.load(path)
    per_node = torchrun_args(yaml.safe_load(MULTINODE.read_text())["services"]["trainer"]["command"])["nproc-per-node"]
    assert cfg.trainer.nproc_per_node == int(per_node)  # else the trainer refuses to start
    assert cfg.trainer.data_parallel == "ddp" and cfg.model.name == "tiny-random"
    # Version 1 (the first the two ranks trained) is used by a later step's workers before DONE clears weights/.
    assert cfg.run.steps == compose_check.MULTINODE_STEPS >= 2
    assert cfg.run.method == "alignopsd"  # rollout and teacher both load the versions
