"""``mosaic measure``: what each unit buys, measured on the model itself.

:mod:`.units` names the units (a layer, its routed experts, or one tensor kind of a layer),
:mod:`.parts` lays the base and the donors out once as split parts so that a candidate is the base's
parts with one swapped (a link, not a copy), :mod:`.journal` keeps each result durably as it finishes,
:mod:`.document` is the ``mosaic.measurement/v1`` document and its schema, :mod:`.backends` the runtimes
that score a candidate (llama.cpp for GGUF on the CPU; exllamav3 for EXL3 on a GPU), and :mod:`.run`
puts them together.
"""
