"""mosaic: build mixed-precision "mosaic" checkpoints of quantized LLMs and prove how they were made.

The pipeline reads as stages, grouped in wings (subpackages) that docs/ARCHITECTURE.md walks:

    formats -> checkpoint (census) -> build (selection -> layout -> splice -> provenance -> run)
    audit (independent) · gguf (export) · hub (fetch) · publish · plan (``mosaic plan``) · cli

The command line (``mosaic.cli``) is a thin layer over these modules; a release script can call
``mosaic.build.run.build`` or ``mosaic.audit.run.audit`` directly.
"""

__version__ = "0.1.0"
