"""``python -m mosaic.cli``: the same as the ``mosaic`` console script."""

from mosaic.cli.commands import main

main()
