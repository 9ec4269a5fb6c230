"""The command line: ``mosaic census | plan | build | audit | export gguf | fetch | publish``.

:mod:`mosaic.cli.commands` holds one click command per verb, each a thin call into the wing that
does the work; :mod:`mosaic.cli.render` draws the tables. ``mosaic.cli:main`` is the console script.
"""

from mosaic.cli.commands import main

__all__ = ["main"]
