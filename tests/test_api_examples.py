"""Every public function's docstring example runs, offline, as written: each in a fresh process.

A fresh process per example because the hub's examples point huggingface_hub at a fake hub through
``HF_ENDPOINT``, which it reads once, and because an example must not lean on another's state. Each runs in
its own temporary folder (``tmp``) with ``mosaic`` imported, as a reader would type it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mosaic

RUNNER = """
import doctest, pathlib, sys
import mosaic
name, tmp = sys.argv[1], pathlib.Path(sys.argv[2])
fn = getattr(mosaic, name)
finder = doctest.DocTestFinder(recurse=False)
tests = finder.find(fn, name, globs={"mosaic": mosaic, "tmp": tmp})
assert tests and tests[0].examples, f"{name} has no example"
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
for t in tests:
    runner.run(t)
res = runner.summarize(verbose=False)
sys.exit(1 if res.failed else 0)
"""

#: The API's functions: the contract's (``The Python API``) and the recipe reader.
FUNCTIONS = ("build", "audit", "census", "plan", "measure", "evaluate", "export_gguf", "fetch", "publish", "rebuild",
             "sign", "load_recipe")
RUNTIME = {"evaluate", "measure"}


def _has_runtime() -> bool:
    from mosaic._eval.runtime import available

    return bool(available())


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_example_runs(name: str, tmp_path: Path) -> None:
    if name in RUNTIME and not _has_runtime():
        pytest.skip("no llama.cpp runtime installed (the runtime extra)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["MOSAIC_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-c", RUNNER, name, str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_function_has_an_example() -> None:
    import doctest

    for name in FUNCTIONS:
        tests = doctest.DocTestFinder(recurse=False).find(getattr(mosaic, name), name)
        assert tests and len(tests[0].examples) >= 2, name
