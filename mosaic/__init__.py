"""mosaic: build mixed-precision "mosaic" checkpoints of quantized LLMs and prove how they were made.

The pipeline's stages live in private wings (``mosaic._checkpoint``, ``mosaic._build``, ``mosaic._audit``, ...)
that docs/ARCHITECTURE.md walks; the command line (``mosaic.cli``) is the interface.
"""

from mosaic._base.version import __version__

__all__ = ["__version__"]
