"""The floor every wing stands on: error classes, fault points, hashing, progress reporting, safe text, the version.

Nothing here knows about checkpoints, and nothing here imports another wing.
"""
