"""mosaic: build mixed-precision "mosaic" checkpoints of quantized LLMs and prove how they were made.

The pipeline reads as stages, one module each:

    recipe -> sources / census -> plan -> splice -> provenance -> audit

The command line (``mosaic.cli``) is a thin layer over these modules; a release script can call
``mosaic.build.build`` or ``mosaic.audit.audit`` directly.
"""

__version__ = "0.1.0"
