"""The file formats, strictly: safetensors (reader and streaming writer) and the GGUF container.

The bottom floor: these modules import nothing of mosaic but :mod:`mosaic._base.errors` and
:mod:`mosaic._base.faults`, and know nothing of models, recipes or mosaics.
"""
