"""Hostile input: every reader of data that comes from a file, fuzzed through the path a user hits.

Each input ends in a correct result or a clean :class:`~mosaic._base.errors.MosaicError`: on the command
line exit 0/1 (a report) or 2 with one ``mosaic: error:`` line, never a traceback, a hang or a memory
blow-up; and no name taken from a file makes mosaic read outside the folder. Example counts come
from ``MOSAIC_FUZZ_EXAMPLES`` (default 200; ``make fuzz`` runs 20000).

Fault table (trials at the default count; "bytes lost" is what a hostile file destroys: the fuzzed
folders are working copies, the sources they were copied from are checked unchanged afterwards):

| input class                                                                  | trials | outcome                                     | bytes lost |
|------------------------------------------------------------------------------|-------:|---------------------------------------------|-----------:|
| index / config.json / quantization_config.json via `mosaic census`: random   |    600 | exit 0/1 report or exit 2 with one line;    |          0 |
|   bytes, non-UTF-8, NUL, byte flips, values replaced at any depth (wrong      |        | never a traceback; nothing read outside     |            |
|   types at every level, NaN/Infinity, 5000-digit integers, duplicate keys,    |        |                                             |            |
|   100,000 `[`, lone surrogates), tensor_storage entries of wrong shapes       |    +23 |                                             |            |
| weight_map names `..`, absolute, `\\`, `C:`, `.`, `./a`, `a//b`, NUL          |    200 | exit 2, "refused"                           |          0 |
| safetensors header: 2^63-byte length, 2^60-element shape, offsets past EOF    |    204 | exit 2 naming the rule, < 2 s, < 20 MB      |          0 |
| recipe: random bytes / text, non-UTF-8, NUL                                   |    200 | RecipeError, one line                       |          0 |
| recipe: documents mutated at any depth, YAML tags (`!!python/...`), huge      |    200 | Recipe or RecipeError; nothing executed     |          0 |
|   integers, bad dates, duplicate keys, self-referencing anchors               |    +14 |                                             |            |
| recipe: alias bomb 9 levels x 9 refs (plain and `<<` merge), 5 positions      |      5 | RecipeError < 2 s, < 20 MB allocated        |          0 |
| recipe: 100,000 nested `[` / `{`, 400 block levels, 60,000-item layer lists   |      5 | RecipeError < 2 s (refused at 64 levels)    |          0 |
| PROVENANCE.json via `mosaic audit`: bytes, values at any depth, `..`/absolute |  16+13 | exit 1, nothing read outside the folder     |          0 |
|   names in files/tensors, no size, 10**400 rate                               |        |                                             |            |
| sha256-manifest.txt: bytes, lines, `..`/absolute/NUL names                    |     16 | exit 1 (0 only when equivalent)             |          0 |
| mosaic-recipe.yaml in a mosaic: bytes, mutated documents, tags, alias bombs   |     16 | exit 1                                      |          0 |

Crashes these fuzzers found, fixed in the reader that owns the input (regression tests below):
PyYAML's safe constructors raise bare ValueError for a 5000-digit integer or a 13th month and
AttributeError for ``!!timestamp x``; an alias
bomb hung the recipe loader in the repr of its error message; a long layer list took quadratic time;
deep nesting cost a second of RecursionError unwinding; ``from: []`` raised TypeError; a key holding a
newline split a recipe error over two lines; ``./a`` and ``a//b`` passed the safe-name check; a
schema-valid PROVENANCE.json without ``size``, with a 10**400 rate or without the card's fields
crashed the audit; a quantization_config.json ``dtype`` that is a list crashed the census.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import shutil
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import mosaic
from mosaic._base.errors import MosaicError, RecipeError
from mosaic._build.run import build
from mosaic._checkpoint.census_exl3 import analyze
from mosaic._checkpoint.folder import INDEX_NAME, open_checkpoint
from mosaic._provenance.records import MANIFEST_NAME, PROVENANCE_NAME, RECIPE_NAME, parse_manifest
from mosaic._recipe.document import parse_recipe
from mosaic.cli.commands import main
from mosaic.testing.exl3 import Geometry, write_checkpoint

from .conftest import tree_digest

FUZZ_EXAMPLES = int(os.environ.get("MOSAIC_FUZZ_EXAMPLES", "200"))
#: An audit costs ~20x a census: its three fuzzers run a twelfth of the count each.
AUDIT_EXAMPLES = max(10, FUZZ_EXAMPLES // 12)

SMALL = Geometry(
    layers=2, dense_layers=1, experts=2, hidden=128, kv_dim=128, intermediate=128,
    expert_intermediate=128, vocab=384, shard_size=64 << 10,
)
_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
SECRET = "@SECRET@"  # replaced by the absolute path of a file outside the folder under test


# --- the command line, checked the same way everywhere -----------------------------------------

_RUNNER = CliRunner()


def cli(*args: object) -> tuple[int, str, str]:
    """Run mosaic; fail on anything but exit 0/1 or a clean one-line exit 2."""
    r = _RUNNER.invoke(main, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"mosaic {args[0]}: uncaught {type(r.exception).__name__}: {r.exception}") from r.exception
    assert "Traceback" not in r.output
    assert r.exit_code in (0, 1, 2), r.output
    if r.exit_code == 2:
        assert r.stderr.startswith("mosaic: error: "), r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
    return r.exit_code, r.stdout, r.stderr


# --- reads outside the folder: every file opened while a check runs is recorded ------------------

_OPENED: list[str] | None = None


def _audit_hook(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit_hook)


def opened_during(fn, *args: object):  # type: ignore[no-untyped-def]
    global _OPENED
    _OPENED = []
    try:
        return fn(*args), list(_OPENED)
    finally:
        _OPENED = None


def assert_reads_inside(opened: list[str], folder: Path, fence: Path) -> None:
    """Nothing below ``fence`` was opened unless it is below ``folder`` (``fence`` holds the secret)."""
    for p in opened:
        real = Path(os.path.realpath(p))
        if real.is_relative_to(fence):
            assert real.is_relative_to(folder.resolve()), f"read outside the folder: {p}"


# --- hostile JSON: a tiny serializer that can also write what json.dumps will not -----------------


class Raw(str):
    """Text inserted verbatim (a 5000-digit integer, 100,000 brackets, a YAML tag)."""


class Dup(list):
    """An object written with the given (key, value) pairs, duplicates included."""


def enc(x: object) -> str:
    if isinstance(x, Raw):
        return str(x)
    if isinstance(x, Dup):
        return "{" + ", ".join(f"{enc(k)}: {enc(v)}" for k, v in x) + "}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{enc(str(k))}: {enc(v)}" for k, v in x.items()) + "}"
    if isinstance(x, list):
        return "[" + ", ".join(enc(v) for v in x) + "]"
    if isinstance(x, float):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity") if math.isinf(x) else repr(x)
    return json.dumps(x)


UNSAFE_NAMES = [
    "..", "../x", "../outside/secret", "a/../../outside/secret", "/etc/passwd", SECRET, "C:x", "c:/x",
    "a\\b", "\\\\srv\\share", "\\x", "x\x00y", ".", "./a", "a/", "a/./b",
]
_names = st.one_of(
    st.sampled_from([*UNSAFE_NAMES, "", "\ud800", "model.safetensors", "nested/model.safetensors", "lm_head.weight"]),
    st.text(max_size=8),
)
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(),
    st.sampled_from([-1, 0, 2**63, 2**64 + 1, 10**400, 1e308]),
    st.just(Raw("9" * 5000)), st.just(Raw("-" + "1" * 5000)),
    _names, st.text(max_size=12),
)


def _hostile_values(depth: int) -> st.SearchStrategy[object]:
    return st.one_of(
        _scalars,
        st.lists(_scalars, max_size=4),
        st.dictionaries(_names, _scalars, max_size=3),
        st.lists(st.tuples(st.sampled_from(["a", "a", "b"]), _scalars), min_size=2, max_size=3).map(Dup),
        st.just(Raw("[" * depth)), st.just(Raw("{\"a\": " * (depth // 2))),
        st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(_names, c, max_size=3)), max_leaves=8),
    )


_hostile = _hostile_values(100_000)
#: PyYAML scans in pure Python: 100,000 brackets cost a second, so documents fuzzed by the thousand
#: nest 5,000 deep (still far past the recursion limit); the explicit cases below keep 100,000.
_hostile_yaml = _hostile_values(5_000)


def mutate(data: st.DataObject, node: object, values: st.SearchStrategy[object] = _hostile) -> object:
    """The document with one value (at any depth) deleted, replaced or joined by a hostile one."""
    choice = data.draw(st.integers(0, 9))
    if isinstance(node, dict) and node and choice < 8:
        k = data.draw(st.sampled_from(list(node)))
        new = dict(node)
        if choice == 0:
            del new[k]
        elif choice == 1:
            new[data.draw(_names)] = data.draw(values)
        elif choice == 2:
            return Dup([*new.items(), (k, data.draw(values))])
        else:
            new[k] = mutate(data, node[k], values)
        return new
    if isinstance(node, list) and node and choice < 8:
        i = data.draw(st.integers(0, len(node) - 1))
        new_l = list(node)
        if choice == 0:
            del new_l[i]
        elif choice == 1:
            new_l.append(data.draw(values))
        else:
            new_l[i] = mutate(data, node[i], values)
        return new_l
    return data.draw(values)


def flip_bytes(data: st.DataObject, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op, i = data.draw(st.integers(0, 2)), data.draw(st.integers(0, max(0, len(b) - 1)))
        if op == 0 and b:
            b[i] = data.draw(st.integers(0, 255))
        elif op == 1:
            b[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del b[i : i + data.draw(st.integers(1, 8))]
    return bytes(b)


SPECIAL_TEXTS = [
    b"", b"\xff\xfe{}", b'{"a\x00": 1}', "[" * 100_000, "{\"a\": " * 50_000, "1" + "0" * 5000, "NaN",
    b"\xef\xbb\xbf{}", "{}", "[]", "null", '"x"', '{"a": 1, "a": 2}', '{"weight_map": Infinity}',
]


def hostile_document(data: st.DataObject, original: bytes, secret: Path) -> bytes:
    """Hostile bytes for a JSON file whose valid content is ``original``."""
    kind = data.draw(st.sampled_from(["structure", "structure", "structure", "bytes", "flip", "special"]))
    if kind == "structure":
        text = enc(mutate(data, json.loads(original)))
    elif kind == "bytes":
        return data.draw(st.binary(max_size=300))
    elif kind == "flip":
        return flip_bytes(data, original)
    else:
        s = data.draw(st.sampled_from(SPECIAL_TEXTS))
        return s if isinstance(s, bytes) else s.encode()
    return text.replace(json.dumps(SECRET), json.dumps(str(secret))).encode("utf-8", "surrogatepass")


# --- fixtures: one small checkpoint and one small mosaic per module, fuzzed in working copies ---


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``outside/secret`` next to whatever is fuzzed (nothing may read it)."""
    root = tmp_path_factory.mktemp("arena")
    (root / "outside").mkdir()
    (root / "outside" / "secret").write_bytes(b"not yours\n")
    return root


@pytest.fixture(scope="module")
def checkpoint(arena: Path) -> tuple[Path, Path]:
    src = write_checkpoint(arena / "src", SMALL)
    work = arena / "ckpt"
    shutil.copytree(src, work)
    return src, work


@pytest.fixture(scope="module")
def mosaic_folder(arena: Path) -> tuple[Path, Path]:
    write_checkpoint(arena / "base", SMALL)
    write_checkpoint(arena / "donor", SMALL.with_(bits=3, seed=2))
    recipe = arena / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "fuzz-mosaic",
        "base": {"path": "base"},
        "donors": {"q3": {"path": "donor"}},
        "replace": [{"from": "q3", "layers": [1], "modules": ["mlp.experts"]}, {"from": "q3", "keys": ["lm_head.*"]}],
    }, sort_keys=False))
    built = build(recipe, out=arena / "built", jobs=1).out_dir
    work = arena / "mosaic"
    shutil.copytree(built, work)
    assert cli("audit", work)[0] == 0
    return built, work


def replaced(work: Path, name: str, content: bytes, original: Path):  # type: ignore[no-untyped-def]
    """Context: ``work/name`` holds ``content``; restored from ``original`` afterwards."""

    class _Ctx:
        def __enter__(self) -> Path:
            (work / name).write_bytes(content)
            return work

        def __exit__(self, *exc: object) -> None:
            shutil.copyfile(original / name, work / name)

    return _Ctx()


# --- index, config.json, quantization_config.json through `mosaic census` ------------------------


@pytest.mark.parametrize("name", [INDEX_NAME, "config.json", "quantization_config.json"])
def test_fuzz_checkpoint_json(checkpoint: tuple[Path, Path], arena: Path, name: str) -> None:
    src, work = checkpoint
    before = tree_digest(src)
    original = (src / name).read_bytes()

    @settings(max_examples=FUZZ_EXAMPLES, **_SETTINGS)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        content = hostile_document(data, original, arena / "outside" / "secret")
        with replaced(work, name, content, src):
            t = time.monotonic()
            (code, _, _), opened = opened_during(cli, "census", work)
            assert time.monotonic() - t < 5
            assert_reads_inside(opened, work, arena)
            if content == original:
                assert code == 0
            if name == INDEX_NAME and code != 2:
                # whatever the index says, a census that did not refuse it used only safe names
                idx = json.loads(content)
                assert all(isinstance(v, str) and ".." not in v.split("/") for v in idx["weight_map"].values())

    run()
    assert tree_digest(src) == before


@settings(max_examples=FUZZ_EXAMPLES, **_SETTINGS)
@given(data=st.data(), unsafe=st.sampled_from(UNSAFE_NAMES))
def test_fuzz_unsafe_weight_map_names_are_refused(checkpoint: tuple[Path, Path], arena: Path, data: st.DataObject, unsafe: str) -> None:
    src, work = checkpoint
    idx = json.loads((src / INDEX_NAME).read_bytes())
    key = data.draw(st.sampled_from(sorted(idx["weight_map"])))
    idx["weight_map"][key] = unsafe.replace(SECRET, str(arena / "outside" / "secret"))
    with replaced(work, INDEX_NAME, json.dumps(idx).encode(), src):
        (code, _, err), opened = opened_during(cli, "census", work)
    assert code == 2 and ("refused" in err or "not a file name" in err), err
    assert_reads_inside(opened, work, arena)


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000,
        '{"weight_map": ' + "[" * 100_000,
        '{"weight_map": {}, "metadata": {"total_size": ' + "9" * 5000 + "}}",
        '{"weight_map": {"a": NaN}}',
        '{"weight_map": {}, "weight_map": {}}',
        '{"weight_map": [1, 2]}',
        '{"weight_map": {"a": 1}}',
        '{"weight_map": {"a": null}}',
        '{"weight_map": {"a": ["model.safetensors"]}}',
        '{"weight_map": {}, "metadata": {"total_size": "12"}}',
        '{"weight_map": {}, "metadata": [1]}',
    ],
)
def test_index_cases_through_the_api(checkpoint: tuple[Path, Path], content: str) -> None:
    src, work = checkpoint
    with replaced(work, INDEX_NAME, content.encode(), src):
        t = time.monotonic()
        with contextlib.suppress(MosaicError):
            analyze(open_checkpoint(work))
        assert time.monotonic() - t < 2


def test_qconfig_entries_of_wrong_shapes_are_reported(checkpoint: tuple[Path, Path]) -> None:
    src, work = checkpoint
    q = json.loads((src / "quantization_config.json").read_bytes())
    key = next(iter(q["tensor_storage"]))
    stored = next(iter(q["tensor_storage"][key]["stored_tensors"]))
    for bad in ([1], {"a": 1}, None, 10**400):
        for field in ("dtype", "shape", "n_bytes"):
            q2 = json.loads(json.dumps(q))
            q2["tensor_storage"][key]["stored_tensors"][stored][field] = bad
            with replaced(work, "quantization_config.json", json.dumps(q2).encode(), src):
                code, out, _ = cli("census", work, "--json")
            assert code == 1 and stored in out


# --- safetensors headers through `mosaic census` on a folder -------------------------------------


def _shard(header: dict | bytes, data_len: int, length: int | None = None) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(hb) if length is None else length).to_bytes(8, "little") + hb + bytes(data_len)


@settings(max_examples=FUZZ_EXAMPLES, **_SETTINGS)
@given(
    length=st.one_of(st.none(), st.sampled_from([2**63, 2**64 - 1, 100_000_001, 0, 7])),
    shape=st.lists(st.one_of(st.sampled_from([2**60, 2**63, 2**64, 0, 1, 4]), st.integers(-2, 10)), max_size=3),
    begin=st.one_of(st.sampled_from([0, 2**60, 2**63]), st.integers(0, 64)),
    span=st.one_of(st.sampled_from([2**60, 2**63, 10**30]), st.integers(0, 64)),
    data_len=st.integers(0, 64),
    dtype=st.sampled_from(["F16", "U8", "F4", "I64"]),
)
@example(length=2**63, shape=[1], begin=0, span=1, data_len=1, dtype="U8")
@example(length=None, shape=[2**60], begin=0, span=2**61, data_len=8, dtype="F16")
@example(length=None, shape=[4], begin=0, span=8, data_len=4, dtype="F16")
@example(length=None, shape=[4], begin=2**60, span=8, data_len=8, dtype="F16")
def test_fuzz_hostile_safetensors_headers(tmp_path_factory: pytest.TempPathFactory, length: int | None, shape: list, begin: int, span: int, data_len: int, dtype: str) -> None:
    folder = tmp_path_factory.mktemp("st")
    (folder / "model.safetensors").write_bytes(
        _shard({"t": {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + span]}}, data_len, length)
    )
    tracemalloc.start()
    try:
        t = time.monotonic()
        code, _, err = cli("census", folder)
        elapsed = time.monotonic() - t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 2 and peak < 20 << 20
    if length is not None and length > 100_000_000:
        assert code == 2 and "HeaderTooLarge" in err
    shutil.rmtree(folder)


# --- the recipe loader --------------------------------------------------------------------------

VALID_RECIPE = {
    "name": "m",
    "base": {"path": "../base"},
    "donors": {"q3": {"path": "donor"}, "hub": {"repo": "org/name", "revision": "0" * 40}},
    "replace": [{"from": "q3", "layers": [1, "3-4"], "modules": ["mlp.experts"]}, {"from": "hub", "keys": ["lm_head.*"]}],
    "output": {"dir": "out/m", "exclude": ["*.md"]},
}
YAML_TAGS = [
    '!!python/object/apply:os.system ["touch PWNED"]',
    "!!python/name:os.system",
    "!!python/object/new:os.system [touch PWNED]",
    '!!python/module:os',
    "!!binary aGVsbG8=",
    "!!binary not-base64!",
    "!!timestamp 2020-13-45",
    "!!timestamp 2020-01-01",
    "!!int '0x'",
    "!!int " + "9" * 5000,
    "!!float 1e999",
    "!!set {a, b}",
    "!!omap [a, b]",
    "!!str",
    "!custom x",
    "&x [*x]",
    "*undefined",
]


def _recipe(raw: bytes, folder: Path) -> None:
    t = time.monotonic()
    try:
        r = parse_recipe(raw, folder / "recipe.yaml")
    except RecipeError as e:
        assert "\n" not in str(e)
    else:
        assert r.raw == raw and r.name and r.rules
    assert time.monotonic() - t < 5


@settings(max_examples=FUZZ_EXAMPLES, **_SETTINGS)
@given(raw=st.one_of(st.binary(max_size=400), st.text(max_size=400).map(lambda s: s.encode("utf-8", "surrogatepass"))))
def test_fuzz_recipe_bytes(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    _recipe(raw, Path("/nonexistent"))


@settings(max_examples=FUZZ_EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_fuzz_recipe_documents(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    doc = mutate(data, VALID_RECIPE, _hostile_yaml)
    if data.draw(st.booleans()):
        # a YAML tag, alias or huge number in place of a value (flow JSON is YAML)
        doc = mutate_with(data, doc, lambda: Raw(data.draw(st.sampled_from(YAML_TAGS))))
    form = data.draw(st.sampled_from(["flow", "block"]))
    text = enc(doc) if form == "flow" or _has_raw(doc) else yaml.safe_dump(_plain(doc), sort_keys=False)
    if data.draw(st.integers(0, 9)) == 0:
        text = flip_bytes(data, text.encode("utf-8", "surrogatepass")).decode("utf-8", "replace")
    cwd = os.getcwd()
    folder = tmp_path_factory.mktemp("recipe")
    os.chdir(folder)
    try:
        _recipe(text.encode("utf-8", "surrogatepass"), folder)
    finally:
        os.chdir(cwd)
    assert not (folder / "PWNED").exists()


def mutate_with(data: st.DataObject, node: object, make) -> object:  # type: ignore[no-untyped-def]
    if isinstance(node, dict) and node and data.draw(st.booleans()):
        k = data.draw(st.sampled_from(list(node)))
        return {**node, k: mutate_with(data, node[k], make)}
    if isinstance(node, list) and node and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(node) - 1))
        return [*node[:i], mutate_with(data, node[i], make), *node[i + 1 :]]
    return make()


def _has_raw(x: object) -> bool:
    if isinstance(x, (Raw, Dup)):
        return True
    if isinstance(x, dict):
        return any(_has_raw(v) for v in x.values())
    if isinstance(x, list):
        return any(_has_raw(v) for v in x)
    return False


def _plain(x: object) -> object:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return x


def _bomb(merge: bool = False, where: str = "name") -> bytes:
    if merge:
        lines = ["    - &a0 {k: v}"] + [f"    - &a{i} {{<<: [{', '.join([f'*a{i - 1}'] * 9)}]}}" for i in range(1, 10)]
    else:
        lines = ['    - &a0 ["lol"]'] + [f"    - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    rest = {
        "name": "name: *a9\nbase: {path: x}\ndonors: {d: {path: y}}\nreplace: [{from: d, layers: [1]}]\n",
        "layers": "name: m\nbase: {path: x}\ndonors: {d: {path: y}}\nreplace: [{from: d, layers: *a9}]\n",
        "from": "name: m\nbase: {path: x}\ndonors: {d: {path: y}}\nreplace: [{from: *a9, layers: [1]}]\n",
        "revision": "name: m\nbase: {repo: a/b, revision: *a9}\ndonors: {d: {path: y}}\nreplace: [{from: d, layers: [1]}]\n",
    }[where]
    return ("output:\n  exclude:\n" + "\n".join(lines) + "\n" + rest).encode()


@pytest.mark.parametrize(("merge", "where"), [(False, "name"), (False, "layers"), (False, "from"), (False, "revision"), (True, "name")])
def test_alias_bomb_is_refused_quickly_and_small(merge: bool, where: str) -> None:
    raw = _bomb(merge, where)
    tracemalloc.start()
    t = time.monotonic()
    try:
        with pytest.raises(RecipeError, match="aliases expand"):
            parse_recipe(raw, Path("/r/recipe.yaml"))
        elapsed = time.monotonic() - t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 2 and peak < 20 << 20, (elapsed, peak)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        "{a: " * 50_000,
        "a:\n" + "".join(" " * i + "- \n" for i in range(400)),
        "name: " + "9" * 5000,
        "name: !!timestamp 2020-13-45",
        "name: !!timestamp not-a-date",
        "name: !!int '0x'",
        "name: &a [*a]",
        "name: x\nname: y",
        "? [a]\n: 1",
        "name: !!python/object/apply:os.system [\"echo hi\"]",
        "name: !!python/name:os.system",
        "name: m\nbase: {path: x}\ndonors: {d: {path: y}}\nreplace: [{from: [], layers: [1]}]",
        "name: m\nbase: {path: x}\ndonors: {d: {path: y}}\nreplace: [{from: {a: 1}, layers: [1]}]",
        "name: m\nbase: {path: x}\ndonors: {d: {path: y}}\nreplace: [{from: d, layers: [1]}]\n\"\\n\": 1",
    ],
)
def test_recipe_cases_are_refused(text: str) -> None:
    t = time.monotonic()
    with pytest.raises(RecipeError) as ei:
        parse_recipe(text.encode(), Path("/r/recipe.yaml"))
    assert time.monotonic() - t < 2
    assert "\n" not in str(ei.value)


def test_long_layer_lists_stay_linear() -> None:
    head = "name: m\nbase: {path: x}\ndonors: {d: {path: y}}\nreplace: [{from: d, layers: ["
    t = time.monotonic()
    with pytest.raises(RecipeError, match="more than once"):
        parse_recipe((head + "1, " * 60_000 + "1]}]\n").encode(), Path("/r/recipe.yaml"))
    with pytest.raises(RecipeError, match="more than"):
        parse_recipe((head + ", ".join(['"0-99999"'] * 3000) + "]}]\n").encode(), Path("/r/recipe.yaml"))
    assert time.monotonic() - t < 10


# --- the audit's readers: PROVENANCE.json, sha256-manifest.txt, mosaic-recipe.yaml --------------


def _audit(mosaic_folder: tuple[Path, Path], arena: Path, name: str, content: bytes) -> int:
    built, work = mosaic_folder
    with replaced(work, name, content, built):
        t = time.monotonic()
        (code, _, _), opened = opened_during(cli, "audit", work, "--jobs", "1")
        assert time.monotonic() - t < 10
    assert_reads_inside(opened, work, arena)
    return code


@settings(max_examples=AUDIT_EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_fuzz_audit_provenance(mosaic_folder: tuple[Path, Path], arena: Path, data: st.DataObject) -> None:
    built, _ = mosaic_folder
    original = (built / PROVENANCE_NAME).read_bytes()
    content = hostile_document(data, original, arena / "outside" / "secret")
    code = _audit(mosaic_folder, arena, PROVENANCE_NAME, content)
    assert code == (0 if content == original else 1)


def _provenance_variants() -> list[tuple[str, object]]:
    return [
        ("size", None),
        ("rate.exact", 10**400),
        ("rate.exact", 1e308),
        ("size.shards", 10**400),
        ("files.0.name", "../outside/secret"),
        ("files.0.name", SECRET),
        ("tensors.0.file", "../outside/secret"),
        ("tensors.0.name", "../outside/secret"),
        ("sources.base.path", "/abs"),
        ("recipe.file", "../x"),
        ("checks", []),
        ("tensors", []),
        ("files", []),
    ]


@pytest.mark.parametrize(("path", "value"), _provenance_variants())
def test_audit_provenance_cases(mosaic_folder: tuple[Path, Path], arena: Path, path: str, value: object) -> None:
    built, _ = mosaic_folder
    doc = json.loads((built / PROVENANCE_NAME).read_bytes())
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is None:
        del node[last]
    else:
        value = str(arena / "outside" / "secret") if value == SECRET else value
        node[int(last) if isinstance(node, list) else last] = value
    assert _audit(mosaic_folder, arena, PROVENANCE_NAME, json.dumps(doc, indent=2).encode()) == 1


@settings(max_examples=AUDIT_EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_fuzz_audit_manifest(mosaic_folder: tuple[Path, Path], arena: Path, data: st.DataObject) -> None:
    built, _ = mosaic_folder
    original = (built / MANIFEST_NAME).read_bytes()
    lines = original.decode().splitlines(keepends=True)
    kind = data.draw(st.sampled_from(["name", "name", "line", "flip", "bytes"]))
    if kind == "name":
        i = data.draw(st.integers(0, len(lines) - 1))
        name = data.draw(st.sampled_from(UNSAFE_NAMES)).replace(SECRET, str(arena / "outside" / "secret"))
        digest = lines[i][:64] if data.draw(st.booleans()) else "0" * 64
        lines.insert(i, f"{digest}  {name}\n") if data.draw(st.booleans()) else lines.__setitem__(i, f"{digest}  {name}\n")
        content = "".join(lines).encode("utf-8", "surrogatepass")
    elif kind == "line":
        i = data.draw(st.integers(0, len(lines)))
        lines.insert(i, data.draw(st.text(max_size=80)) + data.draw(st.sampled_from(["\n", "\r\n", "\x00", ""])))
        content = "".join(lines).encode("utf-8", "surrogatepass")
    elif kind == "flip":
        content = flip_bytes(data, original)
    else:
        content = data.draw(st.binary(max_size=300))
    code = _audit(mosaic_folder, arena, MANIFEST_NAME, content)
    try:
        same = parse_manifest(content, "m") == parse_manifest(original, "m")
    except ValueError:
        same = False
    assert code == (0 if same else 1)


@settings(max_examples=AUDIT_EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_fuzz_audit_recipe(mosaic_folder: tuple[Path, Path], arena: Path, data: st.DataObject) -> None:
    built, _ = mosaic_folder
    original = (built / RECIPE_NAME).read_bytes()
    kind = data.draw(st.sampled_from(["doc", "flip", "bytes", "bomb", "tag"]))
    if kind == "doc":
        content = enc(mutate(data, yaml.safe_load(original), _hostile_yaml)).encode("utf-8", "surrogatepass")
    elif kind == "flip":
        content = flip_bytes(data, original)
    elif kind == "bytes":
        content = data.draw(st.binary(max_size=300))
    elif kind == "bomb":
        content = _bomb(data.draw(st.booleans()), data.draw(st.sampled_from(["name", "layers", "from"])))
    else:
        content = original + f"\nextra: {data.draw(st.sampled_from(YAML_TAGS))}\n".encode()
    assert _audit(mosaic_folder, arena, RECIPE_NAME, content) == (0 if content == original else 1)


def test_fuzzed_sources_were_not_modified(mosaic_folder: tuple[Path, Path], checkpoint: tuple[Path, Path], arena: Path) -> None:
    assert (arena / "outside" / "secret").read_bytes() == b"not yours\n"
    built, work = mosaic_folder
    assert tree_digest(built) == tree_digest(work)
    src, ckpt = checkpoint
    assert tree_digest(src) == tree_digest(ckpt)


# --- nothing from a checkpoint is ever executed or unpickled -------------------------------------

_FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
_FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "torch", "joblib"}
#: The one module that may import torch: the EXL3 evaluation backend runs exllamav3 on a GPU (the exl3
#: extra). It never loads a file with torch (torch.load is still refused there, as everywhere).
_TORCH_ALLOWED = {"_eval/backends.py"}


def test_package_never_executes_or_unpickles_file_content() -> None:
    """Scan mosaic's source: no pickle/marshal/torch imports, no eval/exec, yaml only through a safe loader."""
    pkg = Path(mosaic.__file__).parent
    problems = []
    for f in sorted(pkg.rglob("*.py")):
        tree = ast.parse(f.read_text("utf-8"), str(f))
        for node in ast.walk(tree):
            where = f"{f.relative_to(pkg)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                forbidden = _FORBIDDEN_MODULES - ({"torch"} if f.relative_to(pkg).as_posix() in _TORCH_ALLOWED else set())
                problems += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in forbidden]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _FORBIDDEN_MODULES:
                problems.append(f"{where}: from {node.module} import")
            elif isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                base = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
                if isinstance(fn, ast.Name) and name in _FORBIDDEN_CALLS:
                    problems.append(f"{where}: {name}()")
                if base == "torch" and name == "load":
                    problems.append(f"{where}: torch.load()")
                if base == "yaml" and name in {"load", "load_all", "full_load", "unsafe_load", "unsafe_load_all", "full_load_all"}:
                    loader = {kw.arg: kw.value for kw in node.keywords}.get("Loader")
                    if len(node.args) > 1:
                        loader = node.args[1]
                    ok = isinstance(loader, ast.Name) and ("Safe" in loader.id or loader.id == "_StrictLoader")
                    ok = ok or (isinstance(loader, ast.Attribute) and loader.attr in {"SafeLoader", "CSafeLoader"})
                    if name not in ("load", "load_all") or not ok:
                        problems.append(f"{where}: yaml.{name} without a safe loader")
            elif isinstance(node, ast.ClassDef) and node.name == "_StrictLoader":
                assert any(isinstance(b, ast.Attribute) and b.attr == "SafeLoader" for b in node.bases), where
    assert problems == []
