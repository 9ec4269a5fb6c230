"""GLM-5.3-Flash as it really is (``Glm5NextForConditionalGeneration``): geometry, census, rates, build, audit."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mosaic._audit.run import audit
from mosaic._build.run import build
from mosaic._checkpoint.census_exl3 import analyze, census_report
from mosaic._checkpoint.folder import open_checkpoint
from mosaic.testing.exl3 import glm53_geometry, write_checkpoint

from .test_build import recipe_doc, write_recipe

#: the Spark layers (3, 32, 33, 36-44) on the full 45-layer trunk, with few experts to stay small
SMALL = glm53_geometry(experts=8, vision_blocks=1, shard_size=2 << 20)
SPARK = [3, 32, 33, "36-44"]


def _kind_counts(names: list[str]) -> Counter[str]:
    """How many tensors of each kind a layer-45 / trunk split gives, from the names alone."""
    c: Counter[str] = Counter()
    for n in names:
        if n.startswith("model.visual."):
            c["vision"] += 1
        elif ".layers.45." in n:
            c["mtp"] += 1
        elif ".layers." in n:
            c["trunk"] += 1
        else:
            c["top"] += 1
    return c


def test_full_size_tensor_count_and_composition() -> None:
    """The text part has the real model's tensor count, computed here from the model's description
    (shared/reference/glm53-spark.md), not from the generator."""
    from mosaic.testing.exl3 import _units

    g = glm53_geometry(vision_blocks=0)
    names = [t.name for u in _units(g) for t in u]
    assert len(names) == len(set(names))
    kda, mla, moe, dense = 34, 11, 42, 3
    common = 2 + 6  # two norms + six mHC tensors
    kda_t = 4 + 1 + 5 + 3 + 4  # qkv_proj, conv1d, five F16 gates, dt_bias/A_log/o_norm, o_proj
    mla_t = 4 * 4 + 3 + 4 + 6  # q_a, q_b, kv_a, o_proj; two norms + kv_b; indexer wq_b; six plain indexer tensors
    moe_t = 2 + 3 * 4 + 288 * 3 * 4
    trunk = 45 * common + kda * kda_t + mla * mla_t + dense * 12 + moe * moe_t
    mtp = 2 + mla_t + moe_t + 4 + 3
    c = _kind_counts(names)
    assert c == {"trunk": trunk, "mtp": mtp, "top": 3 + 3}
    assert trunk + mtp + 6 == len(names) == 150_547
    # layer 45 as the Spark card counts it: 873 EXL3 modules
    assert sum(1 for n in names if ".layers.45." in n and n.endswith(".trellis")) == 873


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("glm53")
    return write_checkpoint(tmp / "base", SMALL.with_(seed=1)), write_checkpoint(tmp / "q305", SMALL.with_(seed=2, bits=3))


def test_config_nests_text_config_and_layer_types(sources) -> None:
    cfg = json.loads((sources[0] / "config.json").read_text())
    assert cfg["architectures"] == ["Glm5NextForConditionalGeneration"]
    tc = cfg["text_config"]
    assert "num_hidden_layers" not in cfg and tc["num_hidden_layers"] == 45
    mla = [i for i, t in enumerate(tc["layer_types"]) if t == "deepseek_sparse_attention"]
    assert mla == list(range(3, 45, 4)) and len(tc["layer_types"]) - len(mla) == 34
    assert {"mtp_bits", "vision_bits"} <= set(cfg["quantization_config"])


def test_census_groups_and_rate_lines(sources) -> None:
    rep = census_report(analyze(open_checkpoint(sources[0])))
    assert rep["problems"] == []
    by = {row["layer"]: row for row in rep["layers"]}
    assert by[0]["kind"] == "linear_attention" and set(by[0]["groups"]) == {"attention", "dense_mlp"}
    assert by[3]["kind"] == "deepseek_sparse_attention" and "indexer" in by[3]["groups"]
    assert by[3]["groups"]["attention"]["modules"] == 4 and by[3]["groups"]["indexer"]["modules"] == 1
    assert by[45]["mtp"] and by[45]["groups"]["mtp"]["modules"] == 1
    r = rep["rate"]
    # the exact rate is the trunk's (2 bits everywhere); MTP (mtp_bits 4), vision (4) and head (5) on their own
    assert (r["exact"], r["mtp"], r["vision"], r["head"]) == (2.0, 4.0, 4.0, 5.0)
    assert "0 .. num_hidden_layers-1" in r["definition"]


def test_spark_style_mosaic_builds_and_audits(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": SPARK, "modules": ["mlp.experts"]}],
                                               at=tmp_path))
    res = build(recipe, out=tmp_path / "spark")
    out = res.out_dir
    prov = json.loads((out / "PROVENANCE.json").read_text())
    moved = {t["name"] for t in prov["tensors"] if t["source"] == "q3"}
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in moved}
    assert layers == {3, 32, 33, *range(36, 45)}
    assert all(".mlp.experts." in n for n in moved)
    # exact rate: 12 of 42 MoE layers' experts at 3 bits; by layer mass (33 × 2 + 12 × 3) / 45
    assert prov["rate"]["by_layer_mass"] == pytest.approx((33 * 2 + 12 * 3) / 45)
    assert 2 < prov["rate"]["exact"] < 3
    # what the exact rate leaves out stands on its own lines, in PROVENANCE.json and in the card
    assert prov["rate"]["outside"] == {"head": 5.0, "mtp": 4.0, "vision": 4.0}
    card = (out / "README.md").read_text()
    assert "num_hidden_layers − 1" in card and "- Multi-token-prediction layers: 4.0000 bpw" in card
    rep = audit(out, sources=recipe)
    assert rep.ok, [f.as_dict() for f in rep.failures]


def test_mtp_and_vision_selections_keep_loadability(sources, tmp_path: Path) -> None:
    """Taking the MTP layer's experts or the vision tower from the donor is a whole fusion group each:
    allowed, and the result loads (audit passes)."""
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [
        {"from": "q3", "layers": [45], "modules": ["mlp.experts"]},
        {"from": "q3", "keys": ["model.visual.*"]},
    ], at=tmp_path))
    out = build(recipe, out=tmp_path / "o").out_dir
    assert audit(out, sources=recipe).ok


def test_plan_on_glm53_predicts_the_built_size(sources, tmp_path: Path) -> None:
    """mosaic plan over GLM-5.3's MoE layers (the MTP layer is a unit too): the chosen 12 layers' size,
    predicted before building, is what the build writes."""
    from mosaic._plan.planner import PlanRequest, plan_mosaic

    base, donor = sources
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"higher_is_better": True, "scores": {str(la): float(la % 7) for la in range(3, 46)}}))
    out = tmp_path / "recipes" / "plan.yaml"
    res = plan_mosaic(PlanRequest(base=str(base), donors=[("q3", str(donor))], scores=scores, layers=12, out=out))  # type: ignore[arg-type]
    chosen = sorted(c["layer"] for c in res.report["chosen"])
    assert len(chosen) == 12 and all(3 <= la <= 45 for la in chosen)
    built = build(out, out=tmp_path / "built", jobs=1)
    size = sum(p.stat().st_size for p in built.out_dir.glob("*.safetensors"))
    assert size == res.report["predicted_size"]
    assert audit(built.out_dir).ok
