"""``mosaic plan``: which units to take from which donor under a size, rate or count budget.

:mod:`.units` (what moves together) → :mod:`.scores` (what each unit is worth) → :mod:`.costs` (exact
bytes and bits) → :mod:`.solver` (the exact choice) → :mod:`.planner` (the command: sources, the
written recipe, checked by the real build layout before it is returned).
"""
