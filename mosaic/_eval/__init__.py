"""``mosaic eval``: the quality panel of the Spark card for any mosaic — top-1 agreement with a teacher,
KL(teacher ‖ candidate), the text's own NLL, per row and compared between candidates.

:mod:`.rows` reads the pre-registered rows, :mod:`.panel` holds the arithmetic (numpy only), :mod:`.scoring`
the loop that runs every model in lock step (its blocks of positions on :mod:`.rowpool`'s threads), :mod:`.reference` the teacher's saved top-k, :mod:`.backends` the
models (llama.cpp for GGUF, exllamav3 for EXL3 on a GPU), :mod:`.worker` the process llama.cpp runs in (its
other side :mod:`.worker_main`, their messages :mod:`.wire`, the bindings :mod:`.runtime`), :mod:`.run` puts
them together.
"""
