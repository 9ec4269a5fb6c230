"""The public API's implementation: :mod:`.functions` (one function per command) and :mod:`.results` (what they
return). ``import mosaic`` re-exports both; the command line calls :mod:`.functions` and nothing else above the
base. Each function imports its wing when called, never at import time.
"""
