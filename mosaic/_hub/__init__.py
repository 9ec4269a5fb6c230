"""The Hugging Face Hub, read side: pinned snapshots and the hub's own digests (:mod:`.snapshot`) and
``mosaic fetch`` (:mod:`.download`). Publishing, which needs the audit too, sits above in :mod:`mosaic._release.publishing`.
"""
