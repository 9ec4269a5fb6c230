"""The fault suite: a build interrupted or failing anywhere loses nothing and leaves nothing that looks finished.

Fault table (trials at the default size; every trial also re-checks the sources' digests and then
reruns the build, which must produce the reference folder byte for byte):

| fault class                                   | trials | outcome                                                         | bytes lost |
|-----------------------------------------------|--------|-----------------------------------------------------------------|------------|
| SIGKILL at a named point (plan, each source    | 27     | no output folder; a hidden `.name.mosaic-partial-*` folder at    | 0          |
| hashed, each copy step, each shard written and |        | most, removed by the next build; with --force over an existing   |            |
| verified, carried files, metadata, card,       |        | output, the previous output is kept or restored                  |            |
| provenance, manifest, fsyncs, before/while     |        |                                                                 |            |
| renaming)                                      |        |                                                                 |            |
| SIGINT (Ctrl-C) at 6 points, on worker threads | 6      | exit 130, one line `mosaic: interrupted`, temporary folder gone  | 0          |
| and the main thread                            |        |                                                                 |            |
| SIGTERM while copying                          | 1      | as Ctrl-C                                                        | 0          |
| injected ENOSPC / EIO at the write, the read,  | 5      | exit 2, one `mosaic: error:` line naming the errno, no output    | 0          |
| the fsync of a written file                    |        |                                                                 |            |
| real disk full (a 3 MB tmpfs)                  | 1      | exit 2, `No space left on device`, no output, nothing left        | 0          |
| not enough space, known before writing         | 1      | exit 2 before any byte is written (tests/test_build.py)           | 0          |
| a source changed during the build              | 1      | exit 1, the tensor named, no output                               | 0          |
| a source shrinking during the build            | 1      | exit 2, "source ended", no output                                 | 0          |
| an unwritable output parent                    | 1      | exit 2, names the parent                                          | 0          |
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from mosaic._build import run as build_mod
from mosaic._build import splice as splice_mod
from mosaic._build.run import PARTIAL_TAG, build
from mosaic.cli.commands import main
from mosaic.testing.exl3 import every_group_geometry, write_checkpoint
from tests.conftest import run_cli

from .conftest import tree_digest
from .test_build import recipe_doc, write_recipe


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("faults")
    g = every_group_geometry(experts=16, shard_size=1 << 20)
    base = write_checkpoint(root / "base", g.with_(seed=21))
    donor = write_checkpoint(root / "donor", g.with_(seed=22, bits=4, style="library"))
    recipe = write_recipe(root, recipe_doc(base, donor, [
        {"from": "q3", "layers": [1, 3, 5], "modules": ["mlp.experts"]},
        {"from": "q3", "keys": ["lm_head.*"]},
    ], at=root))
    ref = build(recipe, out=root / "reference").out_dir
    return {
        "root": root,
        "recipe": recipe,
        "base": base,
        "donor": donor,
        "ref": tree_digest(ref),
        "sources": [tree_digest(base), tree_digest(donor)],
    }


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if PARTIAL_TAG in p.name)


def assert_recovers(world: dict, out: Path) -> None:
    """Sources untouched; the next build cleans up and produces the reference folder."""
    assert [tree_digest(world["base"]), tree_digest(world["donor"])] == world["sources"]
    res = build(world["recipe"], out=out, force=out.exists())
    assert tree_digest(res.out_dir) == world["ref"]
    assert leftovers(out.parent) == []


KILL_POINTS = [
    "plan:1", "source:1", "source:3", "source:6", "copy:1", "copy:2", "copy:4", "copy:7",
    "written:1", "written:2", "verified:1", "verified:2", "carried:1", "carried:3",
    "metadata:1", "metadata:2", "metadata:3", "card:1", "provenance:1", "manifest:1", "fsync:1", "fsync:4", "rename:1",
]


@pytest.mark.parametrize("where", KILL_POINTS)
def test_sigkill_anywhere(world: dict, tmp_path: Path, where: str) -> None:
    out = tmp_path / "out"
    r = run_cli(["build", str(world["recipe"]), "--out", str(out), "--jobs", "2"], fault=f"{where}:kill")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    assert not out.exists()
    assert all(name.startswith(f".out{PARTIAL_TAG}") for name in leftovers(tmp_path))
    assert_recovers(world, out)


@pytest.mark.parametrize("where", ["copy:2", "verified:1", "rename:1", "swap:1"])
def test_sigkill_while_replacing_keeps_the_previous_output(world: dict, tmp_path: Path, where: str) -> None:
    out = tmp_path / "out"
    build(world["recipe"], out=out)
    (out / "marker-of-the-previous-build").write_text("old")  # to recognise the previous output
    r = run_cli(["build", str(world["recipe"]), "--out", str(out), "--force"], fault=f"{where}:kill")
    assert r.returncode == -signal.SIGKILL
    build_mod.clean_stale_partials(out)  # what the next build does first
    assert (out / "marker-of-the-previous-build").exists(), "the previous output was lost"
    assert_recovers(world, out)


@pytest.mark.parametrize(("where", "action"), [("source:2", "int"), ("copy:3", "int"), ("verified:2", "int"), ("provenance:1", "int"), ("plan:1", "int"), ("copy:2", "term"),
                                               ("fsync:3", "int")])
def test_interrupt_prints_one_line_and_exits_130(world: dict, tmp_path: Path, where: str, action: str) -> None:
    out = tmp_path / "out"
    r = run_cli(["build", str(world["recipe"]), "--out", str(out), "--jobs", "2"], fault=f"{where}:{action}")
    assert r.returncode == 130, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == ["mosaic: interrupted"]
    assert not out.exists() and leftovers(tmp_path) == []
    assert_recovers(world, out)


@pytest.mark.parametrize(("where", "action", "needle"), [
    ("copy:2", "enospc", "No space left on device"),
    ("metadata:1", "enospc", "No space left on device"),
    ("source:2", "eio", "Input/output error"),
    ("written:1", "eio", "Input/output error"),
    ("fsync:2", "eio", "Input/output error"),  # a write-back error surfaces at the fsync of a finished file
])
def test_injected_storage_errors(world: dict, tmp_path: Path, where: str, action: str, needle: str) -> None:
    out = tmp_path / "out"
    r = run_cli(["build", str(world["recipe"]), "--out", str(out)], fault=f"{where}:{action}")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mosaic: error:") and needle in lines[0]
    assert not out.exists() and leftovers(tmp_path) == []
    assert_recovers(world, out)


def test_real_disk_full(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small filesystem here; the injected ENOSPC cases cover the write path")
    try:
        # pretend the space check passed, so the build meets the full disk while writing
        monkeypatch.setattr(build_mod, "SPACE_MARGIN", 0)
        monkeypatch.setattr(build_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))  # type: ignore[attr-defined]
        r = CliRunner().invoke(main, ["build", str(world["recipe"]), "--out", str(mnt / "out")])
        assert r.exit_code == 2, r.output
        assert "No space left on device" in r.stderr and r.stderr.count("\n") == 1
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    assert [tree_digest(world["base"]), tree_digest(world["donor"])] == world["sources"]


def test_source_changed_during_build(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    donor = tmp_path / "donor"
    shutil.copytree(world["donor"], donor)
    doc = recipe_doc(world["base"], donor, [{"from": "q3", "layers": [3], "modules": ["mlp.experts"]}], at=tmp_path)
    recipe = write_recipe(tmp_path, doc)
    idx = json.loads((donor / "model.safetensors.index.json").read_text())
    name = "model.layers.3.mlp.experts.2.down_proj.trellis"
    shard = donor / idx["weight_map"][name]
    from mosaic._formats.safetensors_reader import read_header

    a, _ = read_header(shard).file_range(name)
    real = splice_mod.write_shard

    def tampering_write(layout, dst, **kw):  # the donor changes after it was hashed, before it is copied
        with open(shard, "r+b") as f:
            f.seek(a + 3)
            f.write(b"\xff\xee")
        return real(layout, dst, **kw)

    monkeypatch.setattr(splice_mod, "write_shard", tampering_write)
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert name in r.stderr and r.stderr.startswith("mosaic: error: build verification failed")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_source_shrinks_during_build(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    donor = tmp_path / "donor"
    shutil.copytree(world["donor"], donor)
    recipe = write_recipe(tmp_path, recipe_doc(world["base"], donor, [{"from": "q3", "layers": [5], "modules": ["mlp.experts"]}], at=tmp_path))
    real = splice_mod.write_shard

    def truncating_write(layout, dst, **kw):
        for t in layout.tensors:
            if "donor" in t.source_path:
                os.truncate(t.source_path, t.source_offset + 1)
        return real(layout, dst, kernel_copy=False, **{k: v for k, v in kw.items() if k != "kernel_copy"})

    monkeypatch.setattr(splice_mod, "write_shard", truncating_write)
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert "source ended" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unwritable_output_parent(world: dict, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = CliRunner().invoke(main, ["build", str(world["recipe"]), "--out", str(blocker / "sub" / "out")])
    assert r.exit_code == 2 and "cannot create the output's parent folder" in r.stderr
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fsynced descriptor through /proc")
def test_every_output_file_is_durable_before_the_folder_is_renamed(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsyncs run in the background while the build reads back what it wrote, but the folder is
    renamed into place only once every file in it (PROVENANCE.json, card and manifest included) is synced."""
    synced: set[str] = set()
    renamed: list[set[str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))

    def rename(src: object, dst: object) -> None:
        if PARTIAL_TAG in Path(str(src)).name and Path(str(dst)) == out:
            renamed.append({str(p) for p in Path(str(src)).rglob("*") if p.is_file()} - synced)
        real_rename(src, dst)

    out = tmp_path / "out"
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    build(world["recipe"], out=out)
    assert renamed == [set()], f"not synced when renamed: {renamed}"
    assert tree_digest(out) == world["ref"]


def test_a_failed_build_leaves_no_descriptor_open(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that fails while written files wait for their fsync closes every one of them."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("counts descriptors through /proc")
    before = len(os.listdir("/proc/self/fd"))

    def failing(fd: int) -> None:
        os.close(fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(splice_mod, "_fsync_close", failing)
    with pytest.raises(OSError, match="Input/output error"):
        build(world["recipe"], out=tmp_path / "out")
    assert len(os.listdir("/proc/self/fd")) == before
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_untouched_base_shard_shrinks_during_build(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A base file copied whole shrinks after the plan: the build names it and fails verification."""
    base = tmp_path / "base"
    shutil.copytree(world["base"], base)
    recipe = write_recipe(tmp_path, recipe_doc(base, world["donor"], [{"from": "q3", "layers": [5], "modules": ["mlp.experts"]}], at=tmp_path))
    monkeypatch.setenv("MOSAIC_NO_DIGEST_CACHE", "1")  # the copy is compared with the base file, not hashed before
    real = splice_mod.digest_sources

    def then_truncate(plan, *a, **kw):  # type: ignore[no-untyped-def]
        out = real(plan, *a, **kw)
        s = next(s for s in plan.shards if s.untouched)
        os.truncate(s.copy_of, s.size - 100)
        return out

    monkeypatch.setattr(splice_mod, "digest_sources", then_truncate)
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("mosaic: error: build verification failed") and "planned" in r.stderr
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_few_descriptors_wait_for_their_fsync(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many files a build writes, at most MAX_WAITING are held open for their fsync."""
    monkeypatch.setattr(splice_mod.Flusher, "MAX_WAITING", 1)
    held: list[int] = []
    real = splice_mod._fsync_close

    def counting(fd: int) -> None:
        held.append(len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else 0)
        real(fd)

    monkeypatch.setattr(splice_mod, "_fsync_close", counting)
    out = build(world["recipe"], out=tmp_path / "out").out_dir
    assert tree_digest(out) == world["ref"] and len(held) == len(list(out.iterdir()))


def test_a_descriptor_handed_over_too_late_is_closed(tmp_path: Path) -> None:
    """Handing a written file to a flusher that a failed build has abandoned closes it rather than
    leaking it (the error still surfaces)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("counts descriptors through /proc")
    f = splice_mod.Flusher()
    f.abandon()
    before = len(os.listdir("/proc/self/fd"))
    fd = os.open(tmp_path / "x", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(RuntimeError):
        f.take(os.dup(fd))
    os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == before
