"""``mosaic build``, stage by stage: selection (the preflight, :mod:`mosaic._recipe.exl3_rules`) → layout (every output byte placed
before writing) → metadata rewrites → splice (streamed copies, read back) → provenance → the atomic
run (:mod:`mosaic._build.run`, the entry point).
"""
