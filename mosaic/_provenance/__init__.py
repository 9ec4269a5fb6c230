"""What a mosaic folder says about itself, and the formats of those files.

:mod:`.records` (file names, PROVENANCE.json's columnar tensor records and serialization, the ``sha256sum``
manifest), the model cards rendered from PROVENANCE alone (:mod:`.card` for EXL3, :mod:`.gguf_card` for GGUF),
and the OpenSSF signature ``model.sig`` (:mod:`.signature`). The builder writes them; the audit re-derives them.
"""
