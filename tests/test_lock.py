"""One writer per output: ``<out>.lock`` held by measure, build, rebuild, export gguf, plan --out and sign; a second
writer is refused in one line."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

import mosaic
from mosaic._base.errors import OutputError
from mosaic._base.lock import OutputLock, lock_path, output_lock
from mosaic._build.run import PARTIAL_TAG, build
from mosaic.cli.commands import main
from mosaic.testing.exl3 import Geometry as Exl3Geometry
from mosaic.testing.gguf import Geometry, write_llama_gguf
from mosaic.testing.keys import write_signing_key

from .conftest import run_cli, tree_digest
from .test_build import BASE, DONOR, recipe_doc, write_recipe

HOST = socket.gethostname()

HOLDER = textwrap.dedent("""
    import sys, time
    from mosaic._base.lock import OutputLock
    OutputLock(sys.argv[1], sys.argv[2]).acquire()
    print("held", flush=True)
    time.sleep(600)
""")


@contextmanager
def held_elsewhere(out: Path, command: str = "mosaic measure") -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock of ``out`` (killed, by SIGKILL, on leaving)."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), command], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == "held\n", "the holder did not take the lock"
        yield p
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def dead_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    r = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    pid = int(r.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def record(path: Path) -> dict:
    return json.loads(path.read_text())


def write_record(path: Path, pid: int, host: str = HOST, command: str = "mosaic build") -> bytes:
    data = json.dumps({"pid": pid, "host": host, "command": command, "started": "2025-01-01T00:00:00+00:00"}).encode()
    path.write_bytes(data)
    return data


def assert_names_holder(message: str, out: Path, pid: int, host: str = HOST, command: str = "mosaic measure") -> None:
    assert "\n" not in message.strip()
    assert message.startswith(f"{out}: another mosaic (pid {pid} on host {host}, {command} since ")
    assert message.endswith("wait for it or stop it") or "remove " in message


# --- the lock itself ----------------------------------------------------------------------------------


def test_lock_path_is_a_sibling_of_the_output(tmp_path: Path) -> None:
    assert lock_path(tmp_path / "measurement.json") == tmp_path / "measurement.json.lock"
    assert lock_path(f"{tmp_path}/out/") == lock_path(tmp_path / "out") == tmp_path / "out.lock"
    assert lock_path(tmp_path / "a" / ".." / "out") == tmp_path / "out.lock"
    with pytest.raises(OutputError, match="not a file or folder name"):
        lock_path("/")


def test_acquire_records_the_holder_and_release_removes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    lk = OutputLock(out, "mosaic measure")
    with lk as same:
        assert same is lk and lk.held and lk.took_over is None
        doc = record(tmp_path / "m.json.lock")
        assert doc["pid"] == os.getpid() and doc["host"] == HOST and doc["command"] == "mosaic measure"
        assert datetime.fromisoformat(doc["started"]).tzinfo is not None
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json.lock"]  # nothing else: not even the output
    assert not lk.held and list(tmp_path.iterdir()) == []
    lk.release()  # twice is harmless
    with output_lock(out, "mosaic measure"):  # and it can be taken again
        assert (tmp_path / "m.json.lock").is_file()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt, OutputError])
def test_the_lock_goes_on_an_error_and_on_ctrl_c(tmp_path: Path, exc: type[BaseException]) -> None:
    with pytest.raises(exc), output_lock(tmp_path / "out", "mosaic build"):
        assert (tmp_path / "out.lock").is_file()
        raise exc("stop")
    assert list(tmp_path.iterdir()) == []


def test_another_process_holding_it_is_named_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "measurement.json"
    with held_elsewhere(out) as holder:
        before = (tmp_path / "measurement.json.lock").read_bytes()
        with pytest.raises(OutputError) as e:
            OutputLock(out, "mosaic measure").acquire()
        assert_names_holder(str(e.value), out, holder.pid)
        assert str(e.value).endswith("is writing it; wait for it or stop it")
        assert e.value.exit_code == 2
        # the refusal leaves the holder's lock as it was
        assert (tmp_path / "measurement.json.lock").read_bytes() == before
        assert record(tmp_path / "measurement.json.lock")["pid"] == holder.pid


def test_a_holder_killed_by_sigkill_is_taken_over_and_its_file_then_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with held_elsewhere(out, "mosaic build") as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert record(tmp_path / "out.lock")["pid"] == holder.pid  # left behind by the kill
        with output_lock(out, "mosaic build") as lk:
            assert lk.took_over is not None and lk.took_over.pid == holder.pid
            assert record(tmp_path / "out.lock")["pid"] == os.getpid()
    assert not (tmp_path / "out.lock").exists()


def test_a_stale_record_of_this_host_is_taken_over(tmp_path: Path) -> None:
    pid = dead_pid()
    write_record(tmp_path / "out.lock", pid)
    with output_lock(tmp_path / "out", "mosaic build") as lk:
        assert lk.took_over is not None and lk.took_over.pid == pid and lk.took_over.host == HOST
        assert record(tmp_path / "out.lock")["pid"] == os.getpid()
    assert not (tmp_path / "out.lock").exists()


def test_on_this_host_the_kernel_lock_decides_not_a_reused_pid(tmp_path: Path) -> None:
    """A record naming a live pid whose process holds no lock (the holder died, its pid was reused) is stale."""
    write_record(tmp_path / "out.lock", os.getppid())
    with output_lock(tmp_path / "out", "mosaic build") as lk:
        assert lk.took_over is not None and lk.took_over.pid == os.getppid()


@pytest.mark.parametrize("junk", [b"", b"{not json", b'{"pid": "1"}', b'{"pid": 0, "host": "h", "command": "c", "started": "s"}'])
def test_an_empty_or_torn_record_without_a_holder_is_taken_over(tmp_path: Path, junk: bytes) -> None:
    (tmp_path / "out.lock").write_bytes(junk)
    with output_lock(tmp_path / "out", "mosaic build") as lk:
        assert lk.took_over is None and record(tmp_path / "out.lock")["pid"] == os.getpid()
    assert not (tmp_path / "out.lock").exists()


def test_a_lock_of_another_host_is_never_taken_over(tmp_path: Path) -> None:
    pid = dead_pid()  # even one whose pid is not alive here: it is another machine's process
    data = write_record(tmp_path / "out.lock", pid, host="other-machine", command="mosaic rebuild")
    with pytest.raises(OutputError) as e:
        OutputLock(tmp_path / "out", "mosaic build").acquire()
    msg = str(e.value)
    assert_names_holder(msg, tmp_path / "out", pid, host="other-machine", command="mosaic rebuild")
    assert f"remove {tmp_path / 'out.lock'} once it is gone" in msg
    assert (tmp_path / "out.lock").read_bytes() == data  # untouched


def test_one_process_cannot_hold_one_output_twice(tmp_path: Path) -> None:
    """Two threads (or two API calls) of one program on one output: the second is refused, naming this pid."""
    with output_lock(tmp_path / "out", "mosaic build"):
        with pytest.raises(OutputError) as e:
            OutputLock(tmp_path / "out", "mosaic build").acquire()
        assert_names_holder(str(e.value), tmp_path / "out", os.getpid(), command="mosaic build")
        assert (tmp_path / "out.lock").is_file()
    assert not (tmp_path / "out.lock").exists()


def test_without_kernel_locks_the_record_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses flock (NFS without a lock daemon): a live pid of this host refuses, a dead one
    is taken over."""
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        write_record(tmp_path / "out.lock", sleeper.pid, command="mosaic measure")
        with pytest.raises(OutputError) as e:
            OutputLock(tmp_path / "out", "mosaic measure").acquire()
        assert_names_holder(str(e.value), tmp_path / "out", sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    with output_lock(tmp_path / "out", "mosaic measure") as lk:
        assert lk.took_over is not None and lk.took_over.pid == sleeper.pid
    assert not (tmp_path / "out.lock").exists()


def test_a_lock_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(OutputError) as e:
        OutputLock(tmp_path / "no-such-folder" / "m.json", "mosaic measure").acquire()
    assert str(e.value) == (f"{tmp_path / 'no-such-folder' / 'm.json'}: cannot create its lock file "
                            f"{tmp_path / 'no-such-folder' / 'm.json.lock'}: No such file or directory")


def test_a_lock_path_that_is_not_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "out.lock").mkdir()
    with pytest.raises(OutputError) as e:
        OutputLock(tmp_path / "out", "mosaic build").acquire()
    assert str(e.value) == f"{tmp_path / 'out'}: cannot create its lock file {tmp_path / 'out.lock'}: Is a directory"


def test_release_leaves_a_file_someone_else_put_in_its_place(tmp_path: Path) -> None:
    lk = OutputLock(tmp_path / "out", "mosaic build").acquire()
    (tmp_path / "out.lock").unlink()  # removed by hand, and another mosaic took the name
    with output_lock(tmp_path / "out", "mosaic build"):
        lk.release()
        assert record(tmp_path / "out.lock")["pid"] == os.getpid()
    assert not (tmp_path / "out.lock").exists()


WORKER = textwrap.dedent("""
    import os, random, sys, time
    from mosaic._base.errors import OutputError
    from mosaic._base.lock import OutputLock
    out, inside, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    done = overlaps = 0
    while done < rounds:
        try:
            lk = OutputLock(out, "worker").acquire()
        except OutputError:
            time.sleep(random.random() / 1000)
            continue
        try:
            try:
                os.close(os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                overlaps += 1
            time.sleep(0.001)
            os.unlink(inside)
        finally:
            lk.release()
        done += 1
    print(done, overlaps)
""")


def test_many_processes_taking_and_releasing_never_overlap(tmp_path: Path) -> None:
    """Release removes the file before letting go of it: a newcomer that locked the removed file starts over,
    so no two processes are ever inside at once."""
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "out"), str(tmp_path / "inside"), "40"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, results
    assert [r[0].split() for r in results] == [["40", "0"]] * 4
    assert list(tmp_path.iterdir()) == []


# --- mosaic build -------------------------------------------------------------------------------------


@pytest.fixture
def built(ckpt_factory, tmp_path: Path) -> tuple[Path, Path]:
    """A recipe and its built output (something a --force build would replace)."""
    base, donor = ckpt_factory(BASE), ckpt_factory(DONOR)
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    out = build(recipe, out=tmp_path / "out").out_dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]
    return recipe, out


def test_build_force_is_refused_while_another_holds_the_output_then_takes_over(built: tuple[Path, Path], tmp_path: Path) -> None:
    recipe, out = built
    before = tree_digest(out)
    with held_elsewhere(out, "mosaic build") as holder:
        r = run_cli(["build", str(recipe), "--out", str(out), "--force"])
        assert r.returncode == 2, r.stderr
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("mosaic: error: ")
        assert_names_holder(lines[0].removeprefix("mosaic: error: "), out, holder.pid, command="mosaic build")
        assert r.stdout == ""
        # nothing deleted, nothing written: the output, no temporary folder, the holder's lock as it was
        assert tree_digest(out) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.lock", "recipe.yaml"]
        assert record(tmp_path / "out.lock")["pid"] == holder.pid
        # the API goes through the same lock
        with pytest.raises(mosaic.MosaicError) as e:
            mosaic.build(recipe, out=out, force=True)
        assert_names_holder(str(e.value), out, holder.pid, command="mosaic build")
        # and a build into a new output beside it is not concerned
        assert mosaic.build(recipe, out=tmp_path / "other").out == tmp_path / "other"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / "out.lock").is_file()  # a killed holder leaves its file; the next build takes it over
    r = run_cli(["build", str(recipe), "--out", str(out), "--force"])
    assert r.returncode == 0, r.stderr
    assert tree_digest(out) == before  # the same recipe gives the same bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out", "recipe.yaml"]


def test_build_without_force_on_a_held_new_output_is_refused_by_the_lock(ckpt_factory, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, recipe_doc(ckpt_factory(BASE), ckpt_factory(DONOR), at=tmp_path))
    out = tmp_path / "deep" / "out"
    out.parent.mkdir()
    with held_elsewhere(out, "mosaic build") as holder:
        r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(out)])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and f"pid {holder.pid} on host {HOST}" in r.stderr
        assert sorted(p.name for p in out.parent.iterdir()) == ["out.lock"]


@pytest.mark.parametrize(("fault", "code"), [("plan:1:int", 130), ("rename:1:enospc", 2), ("plan:1:kill", -signal.SIGKILL)])
def test_an_interrupted_or_failed_build_leaves_no_lock_or_one_the_next_takes_over(
        built: tuple[Path, Path], tmp_path: Path, fault: str, code: int) -> None:
    recipe, _ = built
    r = run_cli(["build", str(recipe), "--out", str(tmp_path / "new")], fault=fault)
    assert r.returncode == code, r.stderr
    left = sorted(p.name for p in tmp_path.iterdir() if PARTIAL_TAG not in p.name)
    if code == -signal.SIGKILL:  # the kernel released the lock; only its file is left
        assert left == ["new.lock", "out", "recipe.yaml"]
    else:
        assert left == ["out", "recipe.yaml"]
    r = run_cli(["build", str(recipe), "--out", str(tmp_path / "new")])
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out", "recipe.yaml"]


# --- mosaic measure -----------------------------------------------------------------------------------


def test_measure_force_and_resume_never_touch_a_held_measurements_journal(tmp_path: Path) -> None:
    """The lock is taken before --out, the journal or any input is looked at: inputs that do not even exist
    give the lock's refusal, and --force cannot delete the running measurement's journal."""
    out = tmp_path / "measurement.json"
    files = {out: b'{"an": "earlier measurement"}', tmp_path / "measurement.json.partial": b"journal line\n",
             tmp_path / "measurement.json.partial.teacher.npz": b"teacher"}
    for p, data in files.items():
        p.write_bytes(data)
    missing = tmp_path / "missing"
    args = ["measure", "--base", str(missing), "--donor", f"q={missing}", "--reference", str(missing),
            "--text", str(missing), "--out", str(out)]
    with held_elsewhere(out) as holder:
        for extra in (["--force"], ["--resume"], []):
            r = run_cli([*args, *extra])
            assert r.returncode == 2, (extra, r.stderr)
            lines = r.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("mosaic: error: "), extra
            assert_names_holder(lines[0].removeprefix("mosaic: error: "), out, holder.pid)
            assert {p: p.read_bytes() for p in files} == files
        with pytest.raises(mosaic.MosaicError) as e:
            mosaic.measure(base=missing, donors={"q": missing}, reference=missing, text=missing, out=out, force=True)
        assert_names_holder(str(e.value), out, holder.pid)
    assert {p: p.read_bytes() for p in files} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(p.name for p in files), "measurement.json.lock"])


def test_a_merge_is_refused_while_another_writes_its_out(tmp_path: Path) -> None:
    """``--merge --force`` on an output another measurement holds: refused before a part is read."""
    out = tmp_path / "measurement.json"
    out.write_bytes(b"earlier")
    missing = tmp_path / "missing-part.json"
    with held_elsewhere(out) as holder:
        r = run_cli(["measure", "--merge", "--out", str(out), "--force", str(missing)])
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert_names_holder(r.stderr.strip().removeprefix("mosaic: error: "), out, holder.pid)
    assert out.read_bytes() == b"earlier"
    r = run_cli(["measure", "--merge", "--out", str(out), "--force", str(missing)])  # the lock gone: the part's own error
    assert r.returncode == 2 and str(missing) in r.stderr and "another mosaic" not in r.stderr, r.stderr
    assert not (tmp_path / "measurement.json.lock").exists()


def test_measure_refused_while_held_then_runs_and_leaves_no_lock(tmp_path: Path) -> None:
    """``--method weights`` on synthetic GGUF models (nothing runs): refused while another holds --out, then
    measured once the holder is gone, with its lock file taken over and removed."""
    g = Geometry(n_layer=2)
    base = write_llama_gguf(tmp_path / "Q4_0.gguf", qtype="Q4_0", seed=1, geometry=g)[0]
    q8 = write_llama_gguf(tmp_path / "Q8_0.gguf", qtype="Q8_0", seed=1, geometry=g)[0]
    out = tmp_path / "m.json"
    args = ["measure", "--method", "weights", "--base", str(base), "--donor", f"q8={q8}", "--unit", "module-group",
            "--out", str(out), "--force"]
    with held_elsewhere(out) as holder:
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
        assert f"pid {holder.pid} on host {HOST}, mosaic measure since" in r.stderr
        assert not out.exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["settings"]["method"] == "weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Q4_0.gguf", "Q8_0.gguf", "m.json"]


# --- mosaic rebuild -----------------------------------------------------------------------------------


def test_rebuild_is_refused_before_it_reads_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mosaic._release.rebuilding as rebuilding

    def no_hub(*a: object, **k: object) -> None:
        raise AssertionError("the hub was read before the lock")

    monkeypatch.setattr(rebuilding, "PartialSnapshot", no_hub)
    out = tmp_path / "r"
    ref = "test-org/some-mosaic@" + "0" * 40
    with held_elsewhere(out, "mosaic rebuild") as holder:
        r = CliRunner().invoke(main, ["rebuild", ref, "--out", str(out)])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
        assert_names_holder(r.stderr.removeprefix("mosaic: error: ").strip(), out, holder.pid, command="mosaic rebuild")
        with pytest.raises(mosaic.MosaicError, match=f"pid {holder.pid} on host"):
            mosaic.rebuild(ref, out=out)
    with pytest.raises(AssertionError, match="the hub was read"):  # free: it gets as far as the hub
        mosaic.rebuild(ref, out=out)
    assert list(tmp_path.iterdir()) == []  # and lets go of the lock on the way out


# --- mosaic export gguf -------------------------------------------------------------------------------

EXPORT_SRC = Exl3Geometry(arch="llama", layers=2, experts=0, bits=3, codebook="mcg")


def one_error_line(r, out: Path, pid: int, command: str) -> None:  # type: ignore[no-untyped-def]
    """A CliRunner result refused by the lock: exit 2, one ``mosaic: error:`` line naming the holder, no stdout."""
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mosaic: error: "), r.stderr
    assert_names_holder(lines[0].removeprefix("mosaic: error: "), out, pid, command=command)
    assert r.stdout == ""


def test_export_gguf_is_refused_while_another_holds_the_output_then_takes_over(ckpt_factory, tmp_path: Path) -> None:
    src = ckpt_factory(EXPORT_SRC)
    out = tmp_path / "gguf"
    args = ["export", "gguf", str(src), "--out", str(out)]
    with held_elsewhere(out, "mosaic export gguf") as holder:
        one_error_line(CliRunner().invoke(main, args), out, holder.pid, "mosaic export gguf")
        with pytest.raises(mosaic.MosaicError) as e:  # the API goes through the same lock
            mosaic.export_gguf(src, out)
        assert_names_holder(str(e.value), out, holder.pid, command="mosaic export gguf")
        # no output, no temporary folder; the holder's lock as it was
        assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf.lock"]
        assert record(tmp_path / "gguf.lock")["pid"] == holder.pid
    assert record(tmp_path / "gguf.lock")["pid"] == holder.pid  # left by the kill: taken over by the next export
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]
    assert not list(out.rglob("*.lock"))
    r = CliRunner().invoke(main, ["audit", str(out), "--sources", str(src)])
    assert r.exit_code == 0, r.output
    before = tree_digest(out)
    # an existing output another command holds (a build replacing it): the lock refuses first, touching nothing
    with held_elsewhere(out, "mosaic build") as holder:
        one_error_line(CliRunner().invoke(main, args), out, holder.pid, "mosaic build")
        assert tree_digest(out) == before
    # free again: the existing output is refused as such, and the lock goes with the refusal
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "already exists" in r.stderr and "another mosaic" not in r.stderr, r.output
    assert tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]


def test_export_gguf_leaves_no_lock_on_failure_and_none_inside_its_source(ckpt_factory, copy_of, tmp_path: Path) -> None:
    src = copy_of(ckpt_factory(EXPORT_SRC), "src")
    before = tree_digest(src)
    r = CliRunner().invoke(main, ["export", "gguf", str(src), "--out", str(src / "gguf")])
    assert r.exit_code == 2 and "inside the source folder" in r.stderr, r.output
    assert tree_digest(src) == before  # not even the lock was written into the source
    r = CliRunner().invoke(main, ["export", "gguf", str(src), "--out", str(tmp_path / "g"), "--name", "not a name"])
    assert r.exit_code == 2 and "use letters, digits" in r.stderr, r.output
    r = CliRunner().invoke(main, ["export", "gguf", str(tmp_path / "missing"), "--out", str(tmp_path / "g")])
    assert r.exit_code == 2 and "not a folder" in r.stderr, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# --- mosaic plan --out --------------------------------------------------------------------------------


def test_plan_out_is_refused_while_another_holds_the_recipe_then_takes_over(ckpt_factory, tmp_path: Path) -> None:
    from .test_plan import BASE as PLAN_BASE
    from .test_plan import DONOR3, per_layer

    base, d3 = ckpt_factory(PLAN_BASE), ckpt_factory(DONOR3)
    scores = per_layer(tmp_path, {1: 1.0, 2: 3.0, 4: 2.0})
    out = tmp_path / "planned.yaml"
    out.write_text("earlier\n")
    args = ["plan", "--base", str(base), "--donor", f"q3={d3}", "--scores", str(scores), "--layers", "1"]
    with held_elsewhere(out, "mosaic plan") as holder:
        one_error_line(CliRunner().invoke(main, [*args, "--out", str(out)]), out, holder.pid, "mosaic plan")
        with pytest.raises(mosaic.MosaicError) as e:
            mosaic.plan(base=base, donors={"q3": d3}, scores=scores, layers=1, out=out)
        assert_names_holder(str(e.value), out, holder.pid, command="mosaic plan")
        assert out.read_text() == "earlier\n"
        # without --out nothing is written, so nothing is locked
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        assert sorted(p.name for p in tmp_path.iterdir()) == ["planned.yaml", "planned.yaml.lock", "scores.json"]
    r = CliRunner().invoke(main, [*args, "--out", str(out)])  # the killed holder's file is taken over
    assert r.exit_code == 0, r.output
    assert "replace:" in out.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planned.yaml", "scores.json"]


def test_gguf_plan_out_takes_over_a_dead_holders_lock_and_leaves_none(tmp_path: Path) -> None:
    g = Geometry(n_layer=2)
    base = write_llama_gguf(tmp_path / "Q4_0.gguf", qtype="Q4_0", seed=1, geometry=g)[0]
    q8 = write_llama_gguf(tmp_path / "Q8_0.gguf", qtype="Q8_0", seed=1, geometry=g)[0]
    scores = tmp_path / "scores.csv"
    scores.write_text("layer,score\n0,1\n1,4\n")
    out = tmp_path / "plans" / "planned.yaml"
    out.parent.mkdir()
    args = ["plan", "--base", str(base), "--donor", f"q8={q8}", "--scores", str(scores), "--unit", "layer",
            "--out", str(out)]
    with held_elsewhere(out, "mosaic plan") as holder:
        one_error_line(CliRunner().invoke(main, [*args, "--layers", "1"]), out, holder.pid, "mosaic plan")
        assert sorted(p.name for p in out.parent.iterdir()) == ["planned.yaml.lock"]
    pid = dead_pid()
    write_record(out.parent / "planned.yaml.lock", pid, command="mosaic plan")
    r = CliRunner().invoke(main, [*args, "--layers", "1"])
    assert r.exit_code == 0, r.output
    assert "layers: [1]" in out.read_text()
    assert sorted(p.name for p in out.parent.iterdir()) == ["planned.yaml"]
    written = out.read_bytes()
    r = CliRunner().invoke(main, [*args, "--max-size", "1000"])  # a plan that fails lets go of the lock too
    assert r.exit_code == 2 and "no plan is that small" in r.stderr, r.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["planned.yaml"] and out.read_bytes() == written


# --- mosaic sign --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_signing_key(tmp_path_factory.mktemp("keys"))


@pytest.mark.parametrize("command", ["mosaic sign", "mosaic build"])
def test_sign_is_refused_while_another_holds_the_folder_then_takes_over(
        built: tuple[Path, Path], tmp_path: Path, signing_key: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        command: str) -> None:
    """Another ``sign`` of the folder, or a build replacing it, holds ``DIR.lock``: refused before the folder is
    read; once that holder is dead its file is taken over, and the lock lies beside the folder, never inside."""
    import mosaic._release.signing as signing

    _, out = built
    private, public = signing_key
    before = tree_digest(out)
    args = ["sign", str(out), "--key", str(private)]
    with held_elsewhere(out, command) as holder:
        for extra in ([], ["--force"]):
            one_error_line(CliRunner().invoke(main, [*args, *extra]), out, holder.pid, command)
        with pytest.raises(mosaic.MosaicError) as e:
            mosaic.sign(out, key=private, force=True)
        assert_names_holder(str(e.value), out, holder.pid, command=command)
        assert tree_digest(out) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.lock", "recipe.yaml"]
    seen: list[tuple[list[str], list[Path], dict]] = []
    real = signing.audit

    def audit(root: Path, **kw: object):  # type: ignore[no-untyped-def]
        seen.append((sorted(p.name for p in tmp_path.iterdir()), list(out.rglob("*.lock")), record(tmp_path / "out.lock")))
        return real(root, **kw)

    monkeypatch.setattr(signing, "audit", audit)
    r = CliRunner().invoke(main, ["sign", f"{out}/", "--key", str(private)])  # out/ and out share one lock
    assert r.exit_code == 0, r.output
    (listing, inside, rec), = seen
    assert listing == ["out", "out.lock", "recipe.yaml"] and inside == []  # held while it ran, beside the folder
    assert rec["pid"] == os.getpid() and rec["command"] == "mosaic sign"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]
    assert not list(out.rglob("*.lock"))
    monkeypatch.undo()
    r = CliRunner().invoke(main, ["audit", str(out), "--key", str(public), "--require-signature"])
    assert r.exit_code == 0, r.output


def test_sign_leaves_no_lock_when_it_fails(built: tuple[Path, Path], tmp_path: Path, signing_key: tuple[Path, Path]) -> None:
    _, out = built
    private, _ = signing_key
    (out / "stray.bin").write_bytes(b"x")  # the audit fails: exit 1
    r = CliRunner().invoke(main, ["sign", str(out), "--key", str(private)])
    assert r.exit_code == 1 and "refusing to sign" in r.stderr, r.output
    for missing in (tmp_path / "nope", tmp_path / "no" / "such"):  # not a folder: exit 2
        r = CliRunner().invoke(main, ["sign", str(missing), "--key", str(private)])
        assert r.exit_code == 2 and r.stderr.strip() == f"mosaic: error: {missing}: not a folder", r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]
    assert not list(out.rglob("*.lock")) and not (out / "model.sig").exists()
