"""The command line: ``mosaic census | plan | build | audit | export gguf | fetch | sign | publish | rebuild |
eval | measure``.

:mod:`mosaic.cli.commands` holds one click command per verb, each one call of the public API
(:mod:`mosaic._api.functions`) and a rendering of its result; :mod:`mosaic.cli.render` draws the tables;
:mod:`mosaic.cli.demo` is ``make demo``'s tour. ``mosaic.cli:main`` is the console script.
"""

from mosaic.cli.commands import main

__all__ = ["main"]
