"""``mosaic build``, stage by stage: selection (the preflight) → layout (every output byte placed
before writing) → metadata rewrites → splice (streamed copies, read back) → provenance → the atomic
run (:mod:`mosaic.build.run`, the entry point).
"""
