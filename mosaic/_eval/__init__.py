"""``mosaic eval``: the quality panel of the Spark card for any mosaic — top-1 agreement with a teacher,
KL(teacher ‖ candidate), the text's own NLL, per row and compared between candidates.

:mod:`.rows` reads the pre-registered rows, :mod:`.panel` holds the arithmetic (numpy only),
:mod:`.reference` the teacher's saved top-k, :mod:`.backends` the runtimes (llama.cpp for GGUF, exllamav3
for EXL3 on a GPU), :mod:`.run` puts them together.
"""
