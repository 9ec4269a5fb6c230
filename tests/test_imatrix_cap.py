"""``--imatrix-cap``: an importance matrix's values held under a robust ceiling before they weigh an error.

A channel of massive activations (millions of times the median channel's Σx², as in SmolLM2's layer 11
``ffn_down``) makes the weighted error see that channel alone: a version that quantizes it well and every other
channel badly scores as lossless. The ceiling is checked here against its formula computed independently, on
its why (the figure moves toward what every channel sees), and as part of a measurement's identity.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mosaic
from mosaic._measure.importance import CAP, capped
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from tests.test_imatrix import _floats, _in_sum2

GEO = Geometry(n_layer=2)
MASSIVE = "blk.0.attn_q.weight"


def _ceiling(row: np.ndarray, z: float) -> float:
    """The ceiling by its definition: e^(median + z × 1.4826 × MAD) of the row's positive values' logs."""
    logs = np.log(row[row > 0])
    med = np.median(logs)
    return float(np.exp(med + z * 1.4826 * np.median(np.abs(logs - med))))


def test_each_row_is_held_under_its_own_ceiling_and_kept_at_mean_one() -> None:
    rng = np.random.default_rng(5)
    s = rng.lognormal(0.0, 0.5, size=(3, 64))
    s[0, 7] = 1e7  # a massive channel in the first expert
    s[1, :] = 0.0
    s[1, :5] = [1, 2, 3, 4, 5]  # too few positive values for a ceiling
    s[2, :] = 2.0  # no spread: no ceiling
    s = s / s.mean()
    out = capped(s)
    assert out.mean() == pytest.approx(1.0)
    ceiling = _ceiling(s[0], CAP)
    assert s[0, 7] > ceiling
    expect0 = np.minimum(s[0], ceiling)
    scale = out[1, 0] / s[1, 0]  # rows without a ceiling keep their values, up to the common rescaling
    np.testing.assert_allclose(out[1], s[1] * scale)
    np.testing.assert_allclose(out[2], s[2] * scale)
    np.testing.assert_allclose(out[0], expect0 * scale)
    assert (out[0] < out[0, 7]).sum() == 63 and out[0, 7] == pytest.approx(ceiling * scale)
    # a row already inside its ceiling is only rescaled
    calm = rng.lognormal(0.0, 0.1, size=(1, 64))
    np.testing.assert_allclose(capped(calm), calm / calm.mean())


def test_a_massive_channel_no_longer_hides_every_other_channel_s_error() -> None:
    """Why the ceiling: a version exact on the massive channel and wrong everywhere else scores as lossless under
    the raw weights, and as about what every channel sees under the ceiling."""
    rng = np.random.default_rng(9)
    ref = rng.normal(size=(16, 64))
    err = rng.normal(scale=0.1, size=ref.shape)
    err[:, 3] = 0.0  # exact on the massive channel
    s = rng.lognormal(0.0, 0.5, size=(1, 64))
    s[0, 3] = s.max() * 1e6

    def eps(weights: np.ndarray) -> float:
        return float((weights * err**2).sum() / (weights * ref**2).sum())

    plain = eps(np.ones((1, 64)))
    assert eps(s / s.mean()) < plain * 1e-4  # the raw weighting: lossless
    assert plain / 2 < eps(capped(s / s.mean())) < plain * 2


@pytest.fixture(scope="module")
def ladder(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("imatrix-cap")
    paths = {q: write_llama_gguf(tmp / f"{q}.gguf", qtype=q, seed=7, geometry=GEO)[0] for q in ("Q4_0", "Q8_0", "F16")}
    values = imatrix_values(imatrix_targets(GEO), seed=4)
    sums, counts = values[MASSIVE]
    sums = sums.copy()
    sums[0, 3] = sums[0].max() * 1e6  # one channel carries (almost) all of the importance
    values[MASSIVE] = (sums, counts)
    paths["imatrix"] = write_imatrix(tmp / "imatrix.gguf", values)
    return paths


def _eps(model: Path, teacher: Path, s: np.ndarray | None) -> float:
    """The contract's NumPy reference for a dense tensor, with the weights ``s`` (None: unweighted)."""
    w, r = _floats(model, MASSIVE), _floats(teacher, MASSIVE)
    n_in = r.shape[-1]
    w, r = w.reshape(-1, n_in), r.reshape(-1, n_in)
    s = np.ones(n_in) if s is None else s.reshape(n_in)
    return float((s * (w - r) ** 2).sum() / (s * r**2).sum())


def _measure(p: dict[str, Path], out: Path, **kw: object) -> dict:
    return mosaic.measure(base=p["Q4_0"], donors={"q8": p["Q8_0"]}, reference=p["F16"], method="weights",
                          unit="module-group", out=out, **kw).document


def test_the_ceiling_lets_every_channel_s_error_count_again(ladder: dict[str, Path], tmp_path: Path) -> None:
    raw_s = _in_sum2(ladder["imatrix"], MASSIVE)
    raw_s = raw_s / raw_s.mean()
    capped_s = np.minimum(raw_s, _ceiling(raw_s[0], CAP))
    raw = _measure(ladder, tmp_path / "raw.json", imatrix=ladder["imatrix"])
    cap = _measure(ladder, tmp_path / "cap.json", imatrix=ladder["imatrix"], imatrix_cap=True)
    assert "cap" not in raw["settings"]["imatrix"] and cap["settings"]["imatrix"]["cap"] == CAP
    by_raw = {(x["layer"], x["group"]): x["eps_base"] for x in raw["results"]}
    by_cap = {(x["layer"], x["group"]): x["eps_base"] for x in cap["results"]}
    key = (0, "attn_q")
    assert by_raw[key] == pytest.approx(_eps(ladder["Q4_0"], ladder["F16"], raw_s), rel=1e-9)
    assert by_cap[key] == pytest.approx(_eps(ladder["Q4_0"], ladder["F16"], capped_s), rel=1e-9)
    # a tensor without a massive channel weighs (almost) as before: its row is inside its ceiling
    for k in (k for k in by_raw if k[1] in ("attn_k", "ffn_up")):
        assert by_cap[k] == pytest.approx(by_raw[k], rel=0.2), k
    # the sums are cached apart: the raw figures again, from the cache, are the raw ones
    again = _measure(ladder, tmp_path / "again.json", imatrix=ladder["imatrix"])
    assert [x["eps"] for x in again["results"]] == [x["eps"] for x in raw["results"]]
    assert [x["eps"] for x in again["results"]] != [x["eps"] for x in cap["results"]]


def test_the_ceiling_is_part_of_a_measurement_s_identity(ladder: dict[str, Path], tmp_path: Path) -> None:
    from mosaic._measure.journal import Journal, journal_path

    raw = _measure(ladder, tmp_path / "raw.json", imatrix=ladder["imatrix"])["settings"]["imatrix"]
    cap = _measure(ladder, tmp_path / "cap.json", imatrix=ladder["imatrix"], imatrix_cap=True)["settings"]["imatrix"]
    out = tmp_path / "r.json"
    Journal.start(journal_path(out), {"settings": {"imatrix": raw}}).close()
    with pytest.raises(mosaic.MosaicError, match=r"another importance matrix .*under --imatrix-cap 3\.5"):
        Journal.resume(journal_path(out), {"settings": {"imatrix": cap}})


def test_a_ceiling_without_a_matrix_is_one_line_and_nothing_is_written(ladder: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    r = CliRunner().invoke(main, ["measure", "--base", str(ladder["Q4_0"]), "--donor", f"q8={ladder['Q8_0']}",
                                  "--method", "weights", "--imatrix-cap", "--out", str(out)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--imatrix-cap" in r.stderr and "--imatrix" in r.stderr, r.output
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(mosaic.MosaicError, match="imatrix_cap not used"):
        mosaic.measure(merge=[out], out=tmp_path / "j.json", imatrix_cap=True)


def test_the_command_line_says_the_values_were_held_under_the_ceiling(ladder: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    r = CliRunner().invoke(main, ["measure", "--base", str(ladder["Q4_0"]), "--donor", f"q8={ladder['Q8_0']}",
                                  "--reference", str(ladder["F16"]), "--method", "weights", "--unit", "module-group",
                                  "--imatrix", str(ladder["imatrix"]), "--imatrix-cap", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "held under its row's median × e^(3.5 robust SDs)" in " ".join(r.output.split())
    from mosaic._plan.measurement import load_measurement

    assert load_measurement(out)["settings"]["imatrix"]["cap"] == 3.5  # the schema knows the field
