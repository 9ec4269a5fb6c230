"""``mosaic measure``: what each unit buys, measured on the model itself.

The units are the plan's (:mod:`mosaic._plan.gguf_units`: a layer, its routed experts, or one tensor kind
of a layer) and the document is the one ``mosaic plan`` reads (:mod:`mosaic._plan.measurement`); here
:mod:`.parts` lays the base and the donors out once as split parts so that a candidate is the base's
parts with one swapped (a link, not a copy), :mod:`.journal` keeps each result durably as it finishes, :mod:`.backends` the runtimes
that score a candidate (llama.cpp for GGUF on the CPU; exllamav3 for EXL3 on a GPU), and :mod:`.run`
puts them together.
"""
