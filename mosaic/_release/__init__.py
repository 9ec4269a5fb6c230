"""Getting a mosaic to people and back: ``mosaic sign`` (:mod:`.signing`), ``mosaic publish`` (:mod:`.publishing`)
and ``mosaic rebuild`` (:mod:`.rebuilding`, a published mosaic made again from its sources). Each one audits or
verifies before it vouches for anything; the signature format itself is :mod:`mosaic._provenance.signature`.
"""
