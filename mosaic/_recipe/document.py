"""The recipe: a YAML file turned into typed, validated objects before anything else runs.

Read with a safe loader that also refuses duplicate keys (PyYAML silently keeps the last one) and
any tag or alias trickery; every error names the recipe field (``replace[1].layers[2]``). Which
tensors a rule selects is decided later, against the sources (see :mod:`mosaic._build.layout`); this module
only knows the recipe's own rules (CONTRACT.md, "Recipe").
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from mosaic._base.errors import RecipeError

MAX_RECIPE_BYTES = 1 << 20
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_ID_RE = re.compile(r"^[a-z0-9_-]+$")
_REV_RE = re.compile(r"^[0-9a-f]{40}$")
#: ORG/NAME as the hub spells repository names (the one definition; the hub client uses it too).
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_RANGE_RE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_*?\[\]!-]+$")

_TOP_FIELDS = {"name", "base", "donors", "replace", "output"}
_SOURCE_FIELDS = {"path", "repo", "revision", "file"}
_RULE_FIELDS = {"from", "layers", "modules", "keys"}
_OUTPUT_FIELDS = {"dir", "exclude", "split_max_size"}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)\s*$")


@dataclass(frozen=True)
class SourceSpec:
    """Where a checkpoint comes from: a folder (absolute, or relative to the recipe file) or a pinned hub commit."""

    id: str
    path: str | None = None
    repo: str | None = None
    revision: str | None = None
    #: GGUF only: the file (or glob over the files) inside the folder or repo that makes the model.
    file: str | None = None

    def as_record(self) -> dict[str, str]:
        """How PROVENANCE.json names this source: exactly as the recipe wrote it (so an absolute path
        appears only where the recipe itself names one)."""
        extra = {"file": self.file} if self.file is not None else {}
        if self.repo is not None:
            return {"repo": self.repo, "revision": self.revision or "", **extra}
        return {"path": self.path or "", **extra}

    @property
    def is_folder(self) -> bool:
        """A folder of this machine (relative or absolute), as opposed to a pinned hub commit."""
        return self.repo is None

    def describe(self) -> str:
        where = f"{self.repo}@{self.revision}" if self.repo else str(self.path)
        return f"{where} file {self.file}" if self.file is not None else where


@dataclass(frozen=True)
class Rule:
    """One ``replace`` entry: take these tensors from donor ``donor``."""

    index: int
    donor: str
    layers: tuple[int, ...] | None = None
    modules: tuple[str, ...] | None = None
    keys: tuple[str, ...] | None = None

    @property
    def field(self) -> str:
        return f"replace[{self.index}]"

    def selects_module(self, layer: int | None, path: str) -> bool:
        """Does this layer rule take the module at ``path`` (inside layer ``layer``)?"""
        if self.layers is None or layer is None or layer not in self.layers:
            return False
        return self.modules is None or any(component_match(path, p) for p in self.modules)

    def selects_key(self, name: str) -> bool:
        """Does this key rule take the tensor ``name``?"""
        return self.keys is not None and any(fnmatch.fnmatchcase(name, g) for g in self.keys)


def layer_runs(layers: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Sorted layers as runs of consecutive numbers: [3, 32, 33, 36, 37] -> [(3, 3), (32, 33), (36, 37)]."""
    out: list[tuple[int, int]] = []
    for n in sorted(layers):
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        elif not out or n != out[-1][1]:
            out.append((n, n))
    return out


def component_match(path: str, pattern: str) -> bool:
    """Module patterns match whole dotted components of the path's start; ``*`` stays in one component."""
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) >= len(pats) and all(fnmatch.fnmatchcase(c, p) for c, p in zip(parts, pats))


@dataclass(frozen=True)
class Recipe:
    name: str
    base: SourceSpec
    donors: dict[str, SourceSpec]
    rules: tuple[Rule, ...]
    output_dir: str | None
    exclude: tuple[str, ...]
    file: Path
    raw: bytes
    #: GGUF only: the most tensor bytes per output part (``llama-gguf-split --split-max-size``); None: one file.
    split_max_size: int | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def folder(self) -> Path:
        return self.file.parent

    @property
    def sources(self) -> dict[str, SourceSpec]:
        """The base and every donor, by id (``base`` first)."""
        return {"base": self.base, **self.donors}

    def folder_sources(self) -> dict[str, str]:
        """Sources named by a folder of this machine, as written: a recipe with any is not portable."""
        return {sid: spec.path for sid, spec in self.sources.items() if spec.path is not None}

    def output_path(self, cwd: Path | None = None) -> Path:
        out = Path(self.output_dir) if self.output_dir else Path("out") / self.name
        return out if out.is_absolute() else (cwd or Path.cwd()) / out


def parse_hub_ref(text: str) -> tuple[str, str] | None:
    """``org/name@<40-hex commit>`` as (repo, revision); None for anything else (a folder, say)."""
    repo, sep, rev = text.partition("@")
    if sep and REPO_RE.match(repo) and _REV_RE.match(rev):
        return repo, rev
    return None


#: The most a recipe may grow to once its aliases are expanded (nodes plus scalar characters); a
#: recipe without aliases stays below its own size. Bounds memory and time against alias bombs
#: ("billion laughs") and self-referencing anchors before anything is constructed or printed.
MAX_EXPANDED_SIZE = 2 * MAX_RECIPE_BYTES
#: The deepest a recipe may nest (it needs four levels).
MAX_DEPTH = 64
#: The most layer numbers one rule may list, ranges expanded.
MAX_RULE_LAYERS = 100_000


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Size of the document with every alias expanded; RecipeError past ``limit`` or on a cycle."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise RecipeError(f"line {node.start_mark.line + 1}: an alias refers to a node that contains it")
        active.add(key)
        n = 1
        if isinstance(node, yaml.ScalarNode):
            n += len(node.value)
        elif isinstance(node, yaml.SequenceNode):
            for child in node.value:
                n += size(child)
                if n > limit:
                    break
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                n += size(k) + size(v)
                if n > limit:
                    break
        active.discard(key)
        if n > limit:
            raise RecipeError(f"line {node.start_mark.line + 1}: aliases expand the recipe beyond {limit} bytes")
        memo[key] = n
        return n

    return size(root)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, non-string keys and documents whose aliases expand
    them beyond :data:`MAX_EXPANDED_SIZE`."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        # Refuse deep nesting before Python's recursion limit does: unwinding a RecursionError
        # through PyYAML's composer takes about a second.
        if self._depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise RecipeError(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep")
        self._depth += 1
        try:
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1

    def get_single_data(self) -> object:
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_size(node, MAX_EXPANDED_SIZE)
        return self.construct_document(node)


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise RecipeError(f"line {key_node.start_mark.line + 1}: mapping key {key!r} is not a string")
        if key in out:
            raise RecipeError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _key(k: object) -> str:
    """A key as an error message shows it: plain when printable, else quoted (errors stay one line)."""
    return k if isinstance(k, str) and k.isprintable() else repr(k)


def _fail(path: Path, field: str, msg: str) -> RecipeError:
    return RecipeError(f"{path}: {field}: {msg}")


def _mapping(path: Path, field: str, value: object, allowed: set[str], required: set[str] = frozenset()) -> dict:  # type: ignore[assignment]
    if not isinstance(value, dict):
        raise _fail(path, field, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(_key(k) for k in value if k not in allowed)
    if unknown:
        raise _fail(path, field, f"unknown field(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(value))
    if missing:
        raise _fail(path, field, f"missing required field(s) {', '.join(missing)}")
    return value


def _string(path: Path, field: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(path, field, f"must be a non-empty string, got {value!r}")
    if "\x00" in value:
        raise _fail(path, field, "contains a NUL character")
    return value


def _string_list(path: Path, field: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(path, field, "must be a non-empty list")
    return tuple(_string(path, f"{field}[{i}]", v) for i, v in enumerate(value))


def _file_pattern(path: Path, field: str, value: object) -> str:
    """A GGUF file name or glob inside a folder or repo: relative, no ``..``."""
    f = _string(path, field, value)
    if f.startswith("/") or "\\" in f or ".." in f.split("/"):
        raise _fail(path, field, f"{f!r} must be a relative name inside the source (no leading '/', no '..')")
    return f


def _source(path: Path, field: str, sid: str, value: object) -> SourceSpec:
    m = _mapping(path, field, value, _SOURCE_FIELDS)
    file = _file_pattern(path, f"{field}.file", m["file"]) if "file" in m else None
    if "path" in m:
        if "repo" in m or "revision" in m:
            raise _fail(path, field, "give either path, or repo + revision, not both")
        # A source location, not a name inside a folder: absolute, ``~`` and ``..`` are all accepted
        # (models live on other disks); relative ones are relative to the recipe file.
        return SourceSpec(sid, path=_string(path, f"{field}.path", m["path"]), file=file)
    if "repo" not in m:
        raise _fail(path, field, "needs path, or repo + revision")
    repo = _string(path, f"{field}.repo", m["repo"])
    if not REPO_RE.match(repo):
        raise _fail(path, f"{field}.repo", f"{repo!r} is not an org/name repository id")
    rev = m.get("revision")
    if not isinstance(rev, str) or not _REV_RE.match(rev):
        raise _fail(
            path,
            f"{field}.revision",
            f"must be a full 40-hex commit hash (branches and tags move), got {rev!r}; "
            f"pin it, e.g. with: huggingface-cli repo-info {repo}",
        )
    return SourceSpec(sid, repo=repo, revision=rev, file=file)


def _layers(path: Path, field: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(path, field, "must be a non-empty list of layer numbers and 'a-b' ranges")
    out: list[int] = []
    for i, v in enumerate(value):
        if len(out) > MAX_RULE_LAYERS:
            raise _fail(path, field, f"lists more than {MAX_RULE_LAYERS} layers")
        f = f"{field}[{i}]"
        if isinstance(v, int) and not isinstance(v, bool):
            if v < 0:
                raise _fail(path, f, f"layer {v} is negative")
            out.append(v)
        elif isinstance(v, str) and (m := _RANGE_RE.match(v)):
            a, b = int(m.group(1)), int(m.group(2))
            if a > b:
                raise _fail(path, f, f"range {v!r} runs backwards")
            if b - a > 100_000:
                raise _fail(path, f, f"range {v!r} is implausibly large")
            out.extend(range(a, b + 1))
        else:
            raise _fail(path, f, f"{v!r} is neither a layer number nor an 'a-b' range")
    dup = sorted(x for x, n in Counter(out).items() if n > 1)
    if dup:
        raise _fail(path, field, f"layer(s) {', '.join(map(str, dup))} listed more than once")
    return tuple(sorted(out))


def _modules(path: Path, field: str, value: object) -> tuple[str, ...]:
    mods = _string_list(path, field, value)
    for i, m in enumerate(mods):
        if not all(_COMPONENT_RE.match(c) for c in m.split(".")):
            raise _fail(path, f"{field}[{i}]", f"{m!r} is not a dotted module path (components, '*' within one)")
    return mods


def _rule(path: Path, index: int, value: object, donors: dict[str, SourceSpec]) -> Rule:
    field = f"replace[{index}]"
    m = _mapping(path, field, value, _RULE_FIELDS, {"from"})
    donor = m["from"]
    if not isinstance(donor, str) or donor not in donors:  # a list or mapping is not hashable
        raise _fail(path, f"{field}.from", f"unknown donor {donor!r} (donors: {', '.join(sorted(donors))})")
    has_layers, has_keys = "layers" in m, "keys" in m
    if has_layers == has_keys:
        raise _fail(path, field, "needs exactly one of layers or keys")
    if has_keys:
        if "modules" in m:
            raise _fail(path, f"{field}.modules", "modules goes with layers, not keys")
        return Rule(index, donor, keys=_string_list(path, f"{field}.keys", m["keys"]))
    layers = _layers(path, f"{field}.layers", m["layers"])
    modules = _modules(path, f"{field}.modules", m["modules"]) if "modules" in m else None
    return Rule(index, donor, layers=layers, modules=modules)


def parse_recipe(raw: bytes, file: Path) -> Recipe:
    """Validate recipe bytes; ``file`` locates relative paths and names the recipe in errors."""
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{file}: recipe is larger than {MAX_RECIPE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{file}: recipe is not UTF-8") from None
    try:
        doc = yaml.load(text, Loader=_StrictLoader)
    except RecipeError as e:
        raise RecipeError(f"{file}: {e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{file}: not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise RecipeError(f"{file}: YAML is nested too deeply") from None
    except (ValueError, TypeError, OverflowError, AttributeError) as e:
        # PyYAML's safe constructors call int(), date() and friends unguarded: a 5,000-digit integer
        # or a 13th month surfaces as a bare ValueError, '!!timestamp x' as an AttributeError.
        raise RecipeError(f"{file}: not valid YAML: a value cannot be read: {str(e)[:200]}") from None
    top = _mapping(file, "recipe", doc, _TOP_FIELDS, {"name", "base", "donors", "replace"})
    name = _string(file, "name", top["name"])
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise _fail(file, "name", f"{name!r} may hold only letters, digits, '.', '_' and '-'")
    base = _source(file, "base", "base", top["base"])
    dmap = top["donors"]
    if not isinstance(dmap, dict) or not dmap:
        raise _fail(file, "donors", "must be a non-empty mapping of donor id to source")
    donors: dict[str, SourceSpec] = {}
    for did, spec in dmap.items():
        if not isinstance(did, str) or not _ID_RE.match(did) or did == "base":
            raise _fail(file, f"donors.{_key(did)}", "donor ids are lowercase letters, digits, '_' and '-' (and not 'base')")
        donors[did] = _source(file, f"donors.{did}", did, spec)
    rules_raw = top["replace"]
    if not isinstance(rules_raw, list) or not rules_raw:
        raise _fail(file, "replace", "must be a non-empty list of rules")
    rules = tuple(_rule(file, i, r, donors) for i, r in enumerate(rules_raw))
    out_dir: str | None = None
    exclude: tuple[str, ...] = ()
    split_max_size: int | None = None
    if "output" in top:
        o = _mapping(file, "output", top["output"], _OUTPUT_FIELDS)
        if "dir" in o:
            out_dir = _string(file, "output.dir", o["dir"])
        if "exclude" in o:
            exclude = _string_list(file, "output.exclude", o["exclude"])
        if "split_max_size" in o:
            split_max_size = _split_size(file, "output.split_max_size", o["split_max_size"])
    return Recipe(name, base, donors, rules, out_dir, exclude, file, raw, split_max_size)


def _split_size(path: Path, field: str, value: object) -> int:
    """Bytes, or with K/M/G/T = 10^3/10^6/10^9/10^12, as ``llama-gguf-split --split-max-size`` counts."""
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif m:
        n = int(m.group(1)) * 1000 ** " KMGT".index(m.group(2) or " ")
    else:
        raise _fail(path, field, f"{value!r} is not a size (bytes, or a number with K, M, G or T)")
    if n <= 0:
        raise _fail(path, field, f"{value!r} must be positive")
    return n


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise RecipeError(f"{p}: cannot read recipe: {e.strerror or e}") from None
    return parse_recipe(raw, p.resolve())
