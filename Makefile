# `make test` and `make demo` set everything up themselves on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 6006
PYTEST_ARGS ?=
# Two processes (CI has 2 cores), fed test by test; a file with module-scoped
# fixtures keeps its tests in one (its `xdist_group`).
XDIST ?= -n 2 --dist loadgroup

.PHONY: test test-oldest test-next fuzz demo docs benchmark benchmarks proto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# -qq: errors only; setuptools' banner on compat editable installs is not one.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -qq -e '.[$*]' --config-settings editable_mode=compat
	touch $@

# The core behaviour runs again on Keras 2 (tf_keras), with its users' switch:
# exactness, items, replicas, every optimizer, options meeting, checkpoints.
# The covering array, the summaries, the noise scale and the transparency
# sweep read what the window holds, alike on both (Keras 3 only, to keep the
# suite's time; test_tf_keras.py and test_legacy_optimizers.py run there too).
TF_KERAS_TESTS := tests/test_callback.py tests/test_hook.py tests/test_schedule.py \
	tests/test_nonfinite.py tests/test_resume.py tests/test_distribution.py \
	tests/test_window.py tests/test_features_meet.py tests/test_items.py \
	tests/test_optimizers.py tests/test_gradient_cache.py tests/test_refusals.py \
	tests/test_interrupts.py tests/test_backup.py

# Keras 3 on JAX and on PyTorch runs the whole suite too: a test of what a
# backend does not serve says so (`backend` marker, with the test of that
# backend's refusal). The test extra installs every backend; a user names one
# (`.[tensorflow]`, `.[jax]`, `.[torch]`: no TensorFlow, tests/test_install.py).

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)
	TF_USE_LEGACY_KERAS=1 $(BIN)/python -m pytest $(XDIST) -m "not keras3 and not once" $(TF_KERAS_TESTS) $(PYTEST_ARGS)
	KERAS_BACKEND=jax $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)
	KERAS_BACKEND=torch $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)
	$(MAKE) test-oldest

# A smoke subset on the oldest pair pyproject.toml supports, Keras 3 and 2.
OLDEST := tensorflow==2.16.2 keras==3.7.0 tf_keras==2.16.0 tensorboard==2.16.2 protobuf==4.25.3
OLDEST_VENV := .venv-oldest
# Window-wide losses read private Keras (the loss, its tracker, seed generators):
# their exactness set and the dropout replay run here too.
OLDEST_TESTS := tests/test_hook.py tests/test_window.py \
	tests/test_gradient_cache.py::test_a_window_of_micro_batches_is_the_large_batch \
	tests/test_gradient_cache.py::test_the_second_forward_pass_draws_the_first_passes_dropout_masks

$(OLDEST_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -qq $(OLDEST) 'pytest>=8' 'pytest-xdist>=3' -e . --config-settings editable_mode=compat
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest $(XDIST) $(OLDEST_TESTS) $(PYTEST_ARGS)
	TF_USE_LEGACY_KERAS=1 $(OLDEST_VENV)/bin/python -m pytest $(XDIST) -m "not keras3 and not once" \
		tests/test_hook.py $(PYTEST_ARGS)

# Keras' next release, before it is out: its pre-release (the `keras-nightly`
# distribution, installed without its dependencies over the test extra's Keras)
# and keras_hub's to match, pinned here only (tfaccum/_keras/private.py's
# NEWEST_TESTED names the same; tests/test_structure.py checks it). NEXT_TESTS
# reads every private name each adapter reads at least once, on each backend;
# `make test-next NEXT_TESTS=tests` runs the whole suite there.
NEXT_KERAS := 3.16.0.dev2026102704
NEXT_KERAS_HUB := 0.33.0.dev202610250352
NEXT_VENV := .venv-next
NEXT_TESTS ?= tests/test_hook.py tests/test_window.py tests/test_items.py \
	tests/test_gradient_cache.py tests/test_structure.py
NEXT_TF_TESTS ?= tests/test_distribution.py tests/test_layers.py
NEXT_TF_KERAS_TESTS ?= tests/test_hook.py

$(NEXT_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEXT_VENV)/bin/python -m pip install -qq -e '.[test]' --config-settings editable_mode=compat
	$(NEXT_VENV)/bin/python -m pip uninstall -qq -y keras keras-hub
	$(NEXT_VENV)/bin/python -m pip install -qq --no-deps keras-nightly==$(NEXT_KERAS) \
		keras-hub-nightly==$(NEXT_KERAS_HUB)
	touch $@

test-next: $(NEXT_VENV)/.installed
	$(NEXT_VENV)/bin/python -m pytest $(XDIST) $(NEXT_TESTS) $(NEXT_TF_TESTS) $(PYTEST_ARGS)
	TF_USE_LEGACY_KERAS=1 $(NEXT_VENV)/bin/python -m pytest $(XDIST) -m "not keras3 and not once" \
		$(NEXT_TF_KERAS_TESTS) $(PYTEST_ARGS)
	KERAS_BACKEND=jax $(NEXT_VENV)/bin/python -m pytest $(XDIST) $(NEXT_TESTS) $(PYTEST_ARGS)
	KERAS_BACKEND=torch $(NEXT_VENV)/bin/python -m pytest $(XDIST) $(NEXT_TESTS) $(PYTEST_ARGS)

# Differential fuzzing at length: random cases (the suite runs a fixed set of
# 25), tfaccum against plain Keras at the large batch. FUZZ_SEED repeats a run.
FUZZ_EXAMPLES ?= 300
fuzz: $(VENV)/.installed-test
	TFACCUM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) TFACCUM_FUZZ_RANDOM=1 $(BIN)/python -m pytest \
		-p no:cacheprovider tests/test_fuzz.py $(if $(FUZZ_SEED),--hypothesis-seed=$(FUZZ_SEED)) $(PYTEST_ARGS)

demo: $(VENV)/.installed-examples
	rm -rf runs/demo
	$(BIN)/python examples/quickstart.py --logdir runs/demo
	@echo "Serving the Accumulation dashboard: http://127.0.0.1:$(PORT)/#accumulation"
	$(BIN)/tensorboard --logdir runs/demo --host 127.0.0.1 --port $(PORT)

# The documentation site, built offline into site/ (MkDocs, Material, mkdocstrings):
# --strict fails on a broken link or a reference that does not resolve.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

benchmark: $(VENV)/.installed-examples
	$(BIN)/python benchmarks/throughput.py

# The whole benchmark set, each table written into benchmarks/RESULTS.md (about
# 2 hours on 2 cores; BENCHMARKS=memory,precision for some). keras_hub: the test extra.
benchmarks: $(VENV)/.installed-test
	$(BIN)/python benchmarks/run_all.py $(if $(BENCHMARKS),--only $(BENCHMARKS))

# Regenerates tfaccum/accumulation_pb2.py. protoc 25 writes code that runs on
# every protobuf from 4.21 on (newer protoc pins the protobuf runtime).
proto:
	$(PYTHON) -m venv .venv-proto
	.venv-proto/bin/python -m pip install --quiet 'grpcio-tools==1.62.*'
	.venv-proto/bin/python -m grpc_tools.protoc -Itfaccum --python_out=tfaccum tfaccum/accumulation.proto

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(NEXT_VENV) .venv-proto runs .pytest_cache
