"""The benchmark cases, one module each, over ``bench/harness.py``; ``bench/run.py`` runs them."""
