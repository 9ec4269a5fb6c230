"""What `mosaic measure` does with no method flag: the default chosen on two models (bench/RESULTS.md), each
default yielding to an explicit flag it cannot go with, and the document saying which method ran."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import mosaic
from mosaic._measure import defaults
from mosaic._measure.run import MeasureRequest
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from mosaic.testing.quantize_tool import write_tool
from tests.conftest import needs_runtime, run_cli
from tests.test_ladder import WIDE

#: The defaults as chosen: over a ladder by the rules of bench/RESULTS.md ("Choosing the ladder's default on two
#: models"; its calibration by "`--calibrate pooled` on Qwen2.5-Coder-1.5B, decided on rows no choice saw"), over
#: published quantizations by the README's table of them. A change of default is a change of these lines, with the
#: evidence that made it.
CHOSEN = {"ladder": {"imatrix_cap": True, "calibrate": "pooled", "curve": "versions", "unit": "module-group"},
          "donors": {"imatrix_cap": False, "calibrate": "units", "curve": "line", "unit": None}}


def _req(where: str = "ladder", **kw: object) -> MeasureRequest:
    return MeasureRequest(**{"base": "b.gguf", "donors": [("q8", "d.gguf")], "reference": "t.gguf", "text": Path("t.txt"),
                             "imatrix": "m.gguf", "ladder": where == "ladder", **kw})  # type: ignore[arg-type]


def _method(req: MeasureRequest) -> dict[str, object]:
    r = defaults.resolved(req)
    return {"imatrix_cap": r.imatrix_cap, "calibrate": r.calibrate, "curve": r.curve, "unit": r.unit}


@pytest.mark.parametrize("where", ["ladder", "donors"])
def test_no_method_flag_is_the_chosen_default(where: str) -> None:
    assert dataclasses.asdict(defaults.LADDER if where == "ladder" else defaults.DONORS) == CHOSEN[where]
    assert _method(_req(where)) == CHOSEN[where]
    assert _method(_req(where, imatrix=None))["imatrix_cap"] is False  # no matrix, nothing to cap


def test_the_help_says_the_defaults() -> None:
    from click.testing import CliRunner

    from mosaic.cli.commands import main

    text = " ".join(CliRunner().invoke(main, ["measure", "--help"]).output.split())
    on = {True: "on", False: "off"}
    assert (f"[default: {CHOSEN['ladder']['calibrate']} over --ladder (kinds with --curve line), "
            f"{CHOSEN['donors']['calibrate']} otherwise]") in text
    assert f"[default: {CHOSEN['ladder']['curve']} over --ladder, {CHOSEN['donors']['curve']} otherwise]" in text
    assert (f"[default with --imatrix: {on[CHOSEN['ladder']['imatrix_cap']]} over --ladder, "
            f"{on[CHOSEN['donors']['imatrix_cap']]} otherwise]") in text
    assert f"[default: {CHOSEN['ladder']['unit']} over --ladder;" in text
    # the default path comes first: the ladder and the teacher, before the published quantizations' --base
    assert text.index("--ladder DIR") < text.index("--reference REF") < text.index("--base SRC") < text.index("--calibrate")


@pytest.mark.parametrize("where", ["ladder", "donors"])
@pytest.mark.parametrize("given", [{"imatrix_cap": True}, {"imatrix_cap": False}, {"calibrate": "kinds"},
                                   {"calibrate": "units"}, {"curve": "versions"}, {"curve": "line"},
                                   {"calibrate": "kinds", "curve": "versions", "imatrix_cap": True}])
def test_a_flag_given_is_kept_and_the_others_default(where: str, given: dict[str, object]) -> None:
    want = {**CHOSEN[where], **given}
    if "calibrate" not in given and want["calibrate"] == "pooled" and want["curve"] != "versions":
        want["calibrate"] = "kinds"  # the pooled alpha is read from the versions curve's passes
    assert _method(_req(where, **given)) == want


@pytest.mark.parametrize("where", ["ladder", "donors"])
def test_defaults_yield_to_what_they_cannot_go_with(where: str) -> None:
    assert _method(_req(where, refine=2, max_size=10))["curve"] == "line"  # --refine is its own correction of the line
    weights = _method(_req(where, method="weights", reference=None, text=None))
    assert (weights["calibrate"], weights["curve"]) == ("units", "line")  # nothing is calibrated by passes
    swaps = _method(_req(where, method="swaps"))
    assert (swaps["calibrate"], swaps["curve"]) == ("units", "line")
    assert _method(_req(where, unit="layer"))["unit"] == "layer"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("defaults")
    geo = Geometry(n_layer=2)
    paths = {q: write_llama_gguf(tmp / f"{q}.gguf", qtype=q, seed=7, geometry=geo)[0] for q in ("Q4_0", "Q8_0")}
    paths["imatrix"] = write_imatrix(tmp / "imatrix.gguf", imatrix_values(imatrix_targets(geo), seed=4))
    paths["text"] = tmp / "rows.txt"
    paths["text"].write_text("the model of a mosaic\nbytes and the bytes of a model\n")
    needs_runtime()  # the ladder: llama.cpp's quantizer behind llama-quantize's command line
    paths["wide"] = write_llama_gguf(tmp / "wide-F16.gguf", qtype="F16", seed=11, geometry=WIDE)[0]
    paths["wide_imatrix"] = write_imatrix(tmp / "wide-imatrix.gguf", imatrix_values(imatrix_targets(WIDE), seed=4))
    mosaic.ladder(paths["wide"], out=tmp / "rungs", types="Q4_0,Q5_0,Q8_0", imatrix=paths["wide_imatrix"],
                  llama_quantize=write_tool(tmp / "llama-quantize"))
    paths["rungs"] = tmp / "rungs"
    return paths


def _measure_cli(tiny: dict[str, Path], where: str, out: Path, *flags: str) -> dict:
    sources = (["--ladder", str(tiny["rungs"]), "--reference", str(tiny["wide"]), "--imatrix", str(tiny["wide_imatrix"])]
               if where == "ladder" else ["--base", str(tiny["Q4_0"]), "--donor", f"q8={tiny['Q8_0']}", "--reference",
                                          str(tiny["Q8_0"]), "--imatrix", str(tiny["imatrix"])])
    r = run_cli(["measure", *sources, "--text", str(tiny["text"]), "--ctx", "16", "--unit", "module-group", *flags,
                 "--out", str(out), "--json"], timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("where", ["ladder", "donors"])
def test_the_document_names_the_default_that_ran_and_the_flags_that_turn_it_off(tiny: dict[str, Path], tmp_path: Path,
                                                                              where: str) -> None:
    want = CHOSEN[where]
    plain = _measure_cli(tiny, where, tmp_path / "plain.json")["settings"]
    assert (plain["calibrate"], plain["curve"], "cap" in plain["imatrix"]) == (want["calibrate"], want["curve"],
                                                                              want["imatrix_cap"])
    flip = ["--calibrate", "kinds" if want["calibrate"] == "units" else "units",
            "--curve", "versions" if want["curve"] == "line" else "line",
            "--no-imatrix-cap" if want["imatrix_cap"] else "--imatrix-cap"]
    other = _measure_cli(tiny, where, tmp_path / "other.json", *flip)["settings"]
    assert (other["calibrate"], other["curve"], "cap" in other["imatrix"]) == (flip[1], flip[3], not want["imatrix_cap"])


@pytest.mark.parametrize("curve", [[], ["--curve", "versions"]])
def test_a_shard_of_the_versions_curve_is_refused_with_the_flag_that_shards(tiny: dict[str, Path], tmp_path: Path,
                                                                            curve: list[str]) -> None:
    r = run_cli(["measure", "--base", str(tiny["Q4_0"]), "--donor", f"q8={tiny['Q8_0']}", "--reference", str(tiny["Q8_0"]),
                 "--text", str(tiny["text"]), "--ctx", "16", *curve, "--shard", "1/2", "--out", str(tmp_path / "s.json")])
    if not curve and CHOSEN["donors"]["curve"] != "versions":
        assert r.returncode == 0, r.stderr  # the default curve shards
    else:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not with --shard" in r.stderr, r.stderr
        assert ("--curve line shards" in r.stderr) == (not curve)
        assert not (tmp_path / "s.json").exists()
