"""``mosaic export gguf``: an EXL3 checkpoint repacked as GGUF for ranma.cpp (:mod:`.gguf`), with
the tokenizer converted as llama.cpp's converter writes it (:mod:`.vocab`).

The export's audit lives with the other audits, in :mod:`mosaic._audit.gguf_folder`.
"""
