"""The public Python API (``import mosaic``): its names, its failures, its silence, its results.

The contract's "The Python API" section, checked against the package as it is: every API name is the
function after every module has been imported (no module or folder shadows one), bad input raises
MosaicError with the command line's message, an OSError arrives wrapped and chained, a failed verification
raises VerificationError and keeps nothing, audit and census report failures in their results, nothing is
printed without a progress reporter, and results are frozen.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import mosaic
from mosaic.testing.exl3 import write_example

from .conftest import run_cli

#: The contract's fixed functions.
CONTRACT = ("build", "audit", "census", "plan", "measure", "evaluate", "export_gguf", "fetch", "publish", "rebuild",
            "sign")


def every_module() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(mosaic.__path__, "mosaic.") if not m.name.endswith("__main__"))


def test_every_api_name_is_still_the_function_after_every_module_is_imported() -> None:
    for name in every_module():
        importlib.import_module(name)
    for name in CONTRACT:
        fn = getattr(mosaic, name)
        assert inspect.isfunction(fn), f"mosaic.{name} is {fn!r}"
        assert fn.__module__ == "mosaic._api.functions", name
        assert fn.__doc__ and ">>>" in fn.__doc__, f"mosaic.{name} has no example"


def test_no_module_or_folder_has_an_api_name() -> None:
    parts = {p for name in every_module() for p in name.split(".")[1:]}
    folders = {p.name for p in Path(mosaic.__file__).parent.rglob("*") if p.is_dir()}
    assert not (parts | folders) & set(mosaic.__all__), (parts | folders) & set(mosaic.__all__)


def test_import_mosaic_loads_no_wing() -> None:
    code = ("import sys, mosaic; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('mosaic.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == ["_base"]  # the version alone


def test_all_names_every_public_name_and_each_resolves() -> None:
    assert sorted(mosaic.__all__) == sorted([*mosaic._HOME, "__version__"])
    for name in mosaic.__all__:
        assert getattr(mosaic, name) is not None
    assert set(mosaic.__all__) <= set(dir(mosaic))
    with pytest.raises(AttributeError):
        mosaic.no_such_name  # noqa: B018


def test_every_public_function_is_typed_and_its_annotations_resolve() -> None:
    import os
    import typing

    for name in (*CONTRACT, "load_recipe"):
        fn = getattr(mosaic, name)
        hints = typing.get_type_hints(fn)  # raises NameError for a name only a type checker sees
        sig = inspect.signature(fn)
        assert "return" in hints, name
        assert set(sig.parameters) <= set(hints), (name, set(sig.parameters) - set(hints))
        if "progress" in sig.parameters:
            assert sig.parameters["progress"].default is False, name
        first = next(iter(sig.parameters.values()))
        if first.kind is first.POSITIONAL_OR_KEYWORD and name not in ("publish", "rebuild", "evaluate"):
            assert os.PathLike in typing.get_args(hints[first.name]) or str in typing.get_args(hints[first.name]), name
    for name in mosaic.__all__:
        obj = getattr(mosaic, name)
        if dataclasses.is_dataclass(obj):
            typing.get_type_hints(obj)


# --- results -------------------------------------------------------------------------------------------


@pytest.fixture
def example(tmp_path: Path) -> Path:
    return write_example(tmp_path)


def test_build_returns_a_frozen_result_whose_as_dict_is_the_cli_json(example: Path, tmp_path: Path) -> None:
    res = mosaic.build(example)
    assert isinstance(res, mosaic.BuildResult)
    assert res.out == tmp_path / "out" / "example-mosaic" and res.out.is_dir()
    assert all(isinstance(c, mosaic.CheckOutcome) and c.ok for c in res.checks)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.out = tmp_path  # type: ignore[misc]
    # the tensor records stay columns, not one object per tensor
    assert type(res.provenance["tensors"]).__name__ == "TensorColumns"
    r = run_cli(["build", str(example), "--out", str(tmp_path / "cli"), "--json"])
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    # the summary says what the folder's own PROVENANCE.json says, read here independently
    prov = json.loads((tmp_path / "cli" / "PROVENANCE.json").read_text())
    assert cli["tensors"] == len(prov["tensors"]) and cli["files"] == len(prov["files"]) + 2
    assert cli["from_donors"] == sum(1 for t in prov["tensors"] if t["source"] != "base") > 0
    assert (cli["checks"], cli["size"], cli["rate"], cli["name"]) == (prov["checks"], prov["size"], prov["rate"], prov["name"])
    assert set(cli["shards"]) == {f["name"] for f in prov["files"] if f["name"].endswith(".safetensors")}
    api = json.loads(json.dumps(res.as_dict()))
    assert {k: v for k, v in cli.items() if k != "output"} == {k: v for k, v in api.items() if k != "output"}


def test_audit_reports_failures_in_its_result_and_sources_true_is_the_folders_own_recipe(
        example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = mosaic.build(example).out
    monkeypatch.chdir(tmp_path)  # the folder's own recipe names base and donor relative to here
    good = mosaic.audit(built, sources=True)
    assert good.ok and good.failures == () and len(good.folders) == 1
    assert "sources" in {c.name for c in good.folders[0].checks}
    shard = sorted(built.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    bad = mosaic.audit(built)
    assert not bad.ok
    f = bad.failures[0]
    assert isinstance(f, mosaic.AuditFailure) and f.file == shard.name and f.folder == built and f.detail
    assert any(x.tensor for x in bad.failures if x.check == "tensors")
    assert bad.as_dict()["ok"] is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        bad.folders = ()  # type: ignore[misc]


def test_census_ok_false_on_problems(tmp_path: Path) -> None:
    from mosaic.testing.exl3 import demo_geometry, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "m", demo_geometry(bits=2))
    assert mosaic.census(ckpt).ok
    qc = ckpt / "quantization_config.json"
    doc = json.loads(qc.read_text())
    first = next(iter(doc["tensor_storage"]))
    del doc["tensor_storage"][first]
    qc.write_text(json.dumps(doc))
    c = mosaic.census(ckpt)
    assert not c.ok and c.problems and c.format == "exl3"


# --- failures ------------------------------------------------------------------------------------------


def _cli_error(args: list[str]) -> str:
    r = run_cli(args)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert line.startswith("mosaic: error: ") and "\n" not in line
    return line.removeprefix("mosaic: error: ")


def test_bad_input_raises_mosaic_error_with_the_cli_message(tmp_path: Path) -> None:
    cases = [
        (lambda: mosaic.build(tmp_path / "missing.yaml"), ["build", str(tmp_path / "missing.yaml")]),
        (lambda: mosaic.audit(tmp_path), ["audit", str(tmp_path)]),
        (lambda: mosaic.census(tmp_path / "nothing"), ["census", str(tmp_path / "nothing")]),
        (lambda: mosaic.rebuild("not-a-ref"), ["rebuild", "not-a-ref"]),
        (lambda: mosaic.sign(tmp_path), ["sign", str(tmp_path)]),
        (lambda: mosaic.export_gguf(tmp_path, tmp_path / "o", split_max_size="big"),
         ["export", "gguf", str(tmp_path), "--out", str(tmp_path / "o"), "--split-max-size", "big"]),
        (lambda: mosaic.plan(base=tmp_path, donors={"Bad Id": tmp_path}, scores=tmp_path / "s.json", layers=1),
         ["plan", "--base", str(tmp_path), "--donor", f"Bad Id={tmp_path}", "--scores", str(tmp_path / "s.json"),
          "--layers", "1"]),
    ]
    for call, args in cases:
        with pytest.raises(mosaic.MosaicError) as e:
            call()
        assert not isinstance(e.value, mosaic.VerificationError)
        assert str(e.value) == _cli_error(args), args


def test_an_oserror_arrives_wrapped_and_chained(example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mosaic._base import faults

    monkeypatch.setattr(faults, "_SPEC", ("copy", 2, "enospc"))
    monkeypatch.setattr(faults, "_counts", {})
    with pytest.raises(mosaic.HostError) as e:
        mosaic.build(example)
    assert isinstance(e.value, mosaic.MosaicError) and isinstance(e.value.__cause__, OSError)
    assert str(e.value) == "No space left on device"
    assert not (tmp_path / "out" / "example-mosaic").exists()
    assert not list((tmp_path / "out").glob("*mosaic-partial*"))


def test_a_failed_verification_raises_verification_error_and_keeps_nothing(
        example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOSAIC_CACHE_DIR", str(tmp_path / "cache"))
    mosaic.build(example, out=tmp_path / "first")
    for entry in (tmp_path / "cache").glob("*.json"):  # cached digests that lie: the read-back must catch it
        doc = json.loads(entry.read_text())
        doc["tensors"] = {k: "0" * 64 for k in doc["tensors"]}
        doc["sha256"] = "0" * 64
        entry.write_text(json.dumps(doc))
    with pytest.raises(mosaic.VerificationError):
        mosaic.build(example, out=tmp_path / "second")
    assert not (tmp_path / "second").exists()
    assert not [p for p in tmp_path.iterdir() if ".mosaic-partial-" in p.name]


def test_sign_refuses_a_folder_whose_audit_fails(example: Path, tmp_path: Path) -> None:
    from mosaic.testing.keys import write_signing_key

    built = mosaic.build(example).out
    (built / "config.json").write_text("{}")
    private, _ = write_signing_key(tmp_path / "keys")
    with pytest.raises(mosaic.VerificationError, match="refusing to sign"):
        mosaic.sign(built, key=private)
    assert not (built / "model.sig").exists()


# --- silence and progress -------------------------------------------------------------------------------


def test_nothing_is_printed_without_a_reporter(example: Path, capfd: pytest.CaptureFixture[str]) -> None:
    built = mosaic.build(example).out
    mosaic.audit(built)
    mosaic.census(built)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_a_reporter_receives_the_counts(example: Path, capfd: pytest.CaptureFixture[str]) -> None:
    steps: dict[str, int] = {}

    class Counting(mosaic.Reporter):
        def step(self, description: str, total: int):  # type: ignore[no-untyped-def]
            steps[description] = 0

            def advance(n: int) -> None:
                steps[description] += n

            return advance

    mosaic.build(example, progress=Counting())
    assert steps and sum(steps.values()) > 0
    assert capfd.readouterr() == ("", "")


def test_progress_true_draws_on_stderr_only(example: Path, capfd: pytest.CaptureFixture[str]) -> None:
    mosaic.build(example, progress=True)
    out, err = capfd.readouterr()
    assert out == "" and err


# --- the command line is this API -------------------------------------------------------------------------


def test_the_cli_imports_only_the_api() -> None:
    from tests.test_layering import import_graph

    g = import_graph()
    for m in ("mosaic.cli.commands", "mosaic.cli.render"):
        wings = {d.split(".")[1] for d in g[m] if d.count(".")}
        assert wings <= {"_api", "_base", "cli"}, (m, wings)


def test_every_result_type_is_a_frozen_dataclass_with_read_only_mappings(example: Path) -> None:
    names = [n for n in mosaic.__all__ if n.endswith(("Result", "Failure", "Outcome", "Audit", "Source"))]
    assert len(names) >= 14
    for n in names:
        cls = getattr(mosaic, n)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, n  # type: ignore[attr-defined]
    res = mosaic.build(example)
    audit = mosaic.audit(res.out)
    census = mosaic.census(res.out)
    for mapping in (res.provenance, res.shards, audit.folders[0].counts, audit.folders[0].digests, census.report):
        with pytest.raises(TypeError):
            mapping["x"] = 1  # type: ignore[index]
    # what as_dict() hands out is the caller's to change: the result does not see it
    doc = census.as_dict()
    doc["tensors"] = -1
    assert census.as_dict()["tensors"] == census.report["tensors"] != -1
    assert isinstance(hash(res), int) and isinstance(hash(census), int) and isinstance(hash(audit), int)


def test_audit_walks_every_mosaic_below_a_folder(example: Path, tmp_path: Path) -> None:
    first = mosaic.build(example).out
    second = mosaic.build(example, out=tmp_path / "out" / "again").out
    res = mosaic.audit(tmp_path / "out")
    assert res.ok and sorted(f.path for f in res.folders) == sorted([first, second])
    r = run_cli(["audit", str(tmp_path / "out"), "--json"])
    assert r.returncode == 0 and json.loads(r.stdout) == json.loads(json.dumps(res.as_dict()))


def test_census_of_a_gguf_model(tmp_path: Path) -> None:
    from mosaic.testing.gguf import write_llama_gguf

    model = write_llama_gguf(tmp_path / "m.gguf", qtype="Q8_0")[0]
    c = mosaic.census(model)
    assert c.ok and c.format == "gguf" and c.hub_bytes_read is None
    r = run_cli(["census", str(model), "--json"])
    assert r.returncode == 0 and json.loads(r.stdout) == json.loads(json.dumps(c.as_dict()))


def test_plan_reads_the_donors_before_the_budget_as_the_cli_does(tmp_path: Path) -> None:
    args = ["plan", "--base", str(tmp_path), "--donor", "bad", "--scores", str(tmp_path / "s"), "--max-size", "bogus"]
    with pytest.raises(mosaic.MosaicError) as e:
        mosaic.plan(base=tmp_path, donors=["bad"], scores=tmp_path / "s", max_size="bogus")
    assert str(e.value) == _cli_error(args) == "--donor: 'bad' is not ID=SRC"


@pytest.mark.parametrize("call", [
    lambda p: mosaic.plan(base=p, donors={"a=b": p}, scores=p / "s", layers=1),  # an id is never split at its '='
    lambda p: mosaic.plan(base=p, donors=[("base", p)], scores=p / "s", layers=1),
    lambda p: mosaic.rebuild("org/name@" + "0" * 40, sources={"a=b": p}),
    lambda p: mosaic.export_gguf(p, p / "o", split_max_size=0),
    lambda p: mosaic.export_gguf(p, p / "o", split_max_size=-5),
    lambda p: mosaic.build(p / "r.yaml", jobs=0),
    lambda p: mosaic.evaluate([p], reference=p, text=p / "t", ctx=0),
    lambda p: mosaic.evaluate([p], reference=p, text=p / "t", top_k=0),
    lambda p: mosaic.measure(base=p, donors={"q": p}, reference=p, text=p / "t", only_layers=[]),
    lambda p: mosaic.measure(base=p, donors={"q": p}, reference=p, text=p / "t", threads=0),
])
def test_arguments_the_cli_would_refuse_are_refused(call, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(mosaic.MosaicError) as e:
        call(tmp_path)
    assert not isinstance(e.value, mosaic.VerificationError) and str(e.value)


def test_a_single_text_is_one_donor_not_its_characters(tmp_path: Path) -> None:
    with pytest.raises(mosaic.MosaicError, match=r"^--donor: 'q3' is not ID=SRC$"):
        mosaic.plan(base=tmp_path / "nothing", donors="q3", scores=tmp_path / "s", layers=1)


def test_sign_takes_an_encrypted_keys_passphrase_from_the_environment(
        example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "locked.pem"
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"s3cret")))
    built = mosaic.build(example).out
    monkeypatch.delenv("MOSAIC_KEY_PASSWORD", raising=False)
    with pytest.raises(mosaic.SigningError, match="passphrase"):
        mosaic.sign(built, key=pem)
    with pytest.raises(mosaic.SigningError):
        mosaic.sign(built, key=pem, password="wrong")
    monkeypatch.setenv("MOSAIC_KEY_PASSWORD", "s3cret")
    assert mosaic.sign(built, key=pem).signature == built / "model.sig"
    assert mosaic.sign(built, key=pem, password=lambda: "s3cret", force=True).files > 0
