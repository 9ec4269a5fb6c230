"""Where a recipe's sources are on this machine: a ``path``, the Hugging Face cache, or the hub read by ranges.

:mod:`.resolve` turns an EXL3 recipe's sources into folders; :mod:`.gguf` opens a GGUF recipe's sources as models
(a file, a split set, a pinned hub quantization by its file or glob).
"""
