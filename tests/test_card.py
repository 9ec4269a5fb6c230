"""The model card's front matter, as the hub reads it (parsed with huggingface_hub's own ModelCard)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from mosaic._audit.run import audit
from mosaic._build.run import build
from mosaic._provenance.card import render_card

from .test_build import BASE, DONOR, recipe_doc, write_recipe


def card_of(folder: Path) -> ModelCard:
    return ModelCard.load(folder / "README.md")


def base_with_card(ckpt_factory, tmp_path: Path, card: str | None) -> Path:
    base = tmp_path / "base"
    shutil.copytree(ckpt_factory(BASE), base)
    if card is not None:
        (base / "README.md").write_text(card)
    return base


def build_with(base: Path, donor: Path, tmp_path: Path) -> Path:
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    return build(recipe, out=tmp_path / "m").out_dir


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        ("---\nbase_model: zai-org/GLM-5.3-Flash\nbase_model_relation: quantized\nlicense: mit\n---\n# q\n",
         "zai-org/GLM-5.3-Flash"),
        ("---\nbase_model:\n- zai-org/GLM-5.3-Flash\n- zai-org/GLM-5.3-Flash\n---\n", "zai-org/GLM-5.3-Flash"),
        ("---\nbase_model: [org/a, org/b, org/a]\n---\n", ["org/a", "org/b"]),
    ],
)
def test_base_model_comes_from_the_base_cards_front_matter(ckpt_factory, tmp_path: Path, card: str, expected) -> None:
    out = build_with(base_with_card(ckpt_factory, tmp_path, card), ckpt_factory(DONOR), tmp_path)
    data = card_of(out).data
    assert data.base_model == expected
    assert data.base_model_relation == "quantized"
    assert data.library_name == "exllamav3"
    assert data.tags == ["exl3", "mosaic"]
    assert audit(out).ok


@pytest.mark.parametrize("card", [None, "no front matter\n", "---\n: [broken\n---\n", "---\nlicense: mit\n---\n"])
def test_a_folder_base_without_a_named_original_gets_no_relation(ckpt_factory, tmp_path: Path, card: str | None) -> None:
    out = build_with(base_with_card(ckpt_factory, tmp_path, card), ckpt_factory(DONOR), tmp_path)
    data = card_of(out).data
    assert data.base_model is None and data.to_dict().get("base_model_relation") is None
    assert data.library_name == "exllamav3" and data.tags == ["exl3", "mosaic"]
    assert audit(out).ok


def test_a_hub_base_without_a_card_names_its_repo_and_the_body_names_every_hub_source() -> None:
    rev_b, rev_d = "a" * 40, "b" * 40
    doc = {
        "name": "m", "tool": {"name": "mosaic", "version": "0"}, "recipe": {"file": "mosaic-recipe.yaml", "sha256": "0" * 64},
        "sources": {"base": {"repo": "org/base-exl3", "revision": rev_b, "files": []},
                    "q3": {"repo": "org/donor-exl3", "revision": rev_d, "files": []}},
        "size": {"shards": 1, "base_shards": 1}, "tensors": [], "checks": [],
        "rate": {"exact": None, "exact_fraction": None, "config_bits": None, "by_bytes": None, "by_layer_mass": None,
                 "base": None, "donors": {}},
    }
    card = ModelCard(render_card(doc).decode())
    assert card.data.base_model == "org/base-exl3"
    assert card.data.base_model_relation == "quantized"
    assert f"`org/base-exl3` @ `{rev_b}`" in card.text and f"`org/donor-exl3` @ `{rev_d}`" in card.text
    doc["sources"]["base"]["base_model"] = ["zai-org/GLM-5.3-Flash"]
    assert ModelCard(render_card(doc).decode()).data.base_model == "zai-org/GLM-5.3-Flash"
