"""``mosaic audit``: the independent verifier. It re-derives every claim from the folder's files with
the strict format readers and never imports the build side (selection, layout, splice, run).

:mod:`.run` is the entry (which audit a folder gets); :mod:`.mosaic_folder` audits an EXL3 mosaic,
:mod:`.gguf_folder` a GGUF export; both fill the neutral :class:`.report.AuditReport`.
"""
