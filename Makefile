# Two entry points for a fresh machine that has only Python 3.10+:
#   make demo   -- set up .venv and run the main job
#   make test   -- set up .venv (with the test extra) and run the whole suite
#
# torch: on a machine without an NVIDIA driver we install the CPU wheel first (a plain `torch`
# requirement would pull ~3 GB of CUDA libraries); with a driver present, pip's default build.
# Override with `make test TORCH_SPEC='torch==2.13.0'` or point TORCH_CPU_INDEX at a mirror.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_NVIDIA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA),yes)
TORCH_SPEC ?= torch>=2.4
else
TORCH_SPEC ?= $(TORCH_CPU)
endif

.PHONY: demo test setup clean gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" || $(PY) -m pip install -q --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/edgelin demo

test: $(VENV)/.installed
	$(VENV)/bin/pytest

# fp32 and fp16 of the bundled model on CUDA: validate --providers cpu,cuda, decode/prefill timing, bench
gpu-check: $(VENV)/.installed
	$(PY) scripts/gpu_check.py --out gpu-check

clean:
	rm -rf $(VENV) build dist *.egg-info
