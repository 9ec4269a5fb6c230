"""Which tensors each recipe rule takes from which donor, and whether the sources allow it.

This is the build's preflight: every rule must select something that exists; no tensor may be
selected twice; a selection takes whole EXL3 modules; the donor must have each selected module with
the same structure (in/out features, tensor group); and the resulting model must still load in
exllamav3 (routed experts of one layer and projection share bits and codebook, opportunistic fusion
pairs share a codebook). Every refusal names the rule, the layer or module, and both values.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from mosaic._base.errors import RecipeError, SourceError
from mosaic._checkpoint.census_exl3 import Analysis
from mosaic._checkpoint.exl3 import Module, expert_groups, fusion_problems
from mosaic._checkpoint.folder import text_config
from mosaic._recipe.document import Recipe, Rule

#: config.json fields that must agree between base and donor (when both have them).
ARCH_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "n_routed_experts",
    "num_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "n_shared_experts",
    "num_nextn_predict_layers",
)



@dataclass
class Selection:
    """The outcome of the recipe's rules: tensor name -> donor id, and what each rule took."""

    donor_of: dict[str, str] = field(default_factory=dict)
    rule_of: dict[str, int] = field(default_factory=dict)
    modules_of_rule: dict[int, list[str]] = field(default_factory=dict)
    result: dict[str, Module] = field(default_factory=dict)  # module key -> module as it will be written

    def layers_of_rule(self, idx: int) -> list[int]:
        return sorted({m.info.layer for k in self.modules_of_rule.get(idx, []) if (m := self.result[k]).info.layer is not None})


def _rule_modules(rule: Rule, base: Analysis, recipe: Recipe) -> dict[str, set[str]]:
    """Module key -> tensor suffixes a rule selects in the base, or a RecipeError naming the field.

    Layer rules take whole modules; key globs may take part of an unquantized module but never part
    of an EXL3 linear (its trellis, signs and marker belong together)."""
    mods = base.modules
    where = f"{recipe.file}: {rule.field}"
    chosen: dict[str, set[str]] = {}
    if rule.layers is not None:
        by_layer: dict[int, list[Module]] = {}
        for m in mods.values():
            if m.info.layer is not None:
                by_layer.setdefault(m.info.layer, []).append(m)
        have = sorted(by_layer)
        for layer in rule.layers:
            if layer not in by_layer:
                span = f"{have[0]}-{have[-1]}" if have else "none"
                raise RecipeError(f"{where}.layers: layer {layer} is not in the base (its layers: {span})")
            hits = [m.key for m in by_layer[layer] if rule.selects_module(m.info.layer, m.info.path)]
            if not hits:
                raise RecipeError(f"{where}.modules: {list(rule.modules or [])} match nothing in layer {layer}")
            for k in hits:
                chosen[k] = set(mods[k].tensors)
        return chosen
    assert rule.keys is not None
    names = base.ckpt.tensor_names()
    picked: dict[str, set[str]] = {}
    for i, glob in enumerate(rule.keys):
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]  # per glob, to name the one that misses
        if not hits:
            raise RecipeError(f"{where}.keys[{i}]: {glob!r} matches no tensor of the base")
        for n in hits:
            key, suffix = n.rpartition(".")[0], n.rpartition(".")[2]
            picked.setdefault(key, set()).add(suffix)
    for key, suffixes in picked.items():
        m = mods[key]
        if m.is_exl3 and suffixes != set(m.tensors):
            missing = sorted(set(m.tensors) - suffixes)
            raise RecipeError(
                f"{where}.keys: selects part of EXL3 module {key} (not {', '.join(missing)}); "
                "an EXL3 linear is replaced whole or not at all"
            )
        chosen[key] = suffixes
    return chosen


def check_architecture(base: Analysis, donor: Analysis, donor_id: str) -> None:
    bc, dc = base.ckpt.config, donor.ckpt.config
    if not bc or not dc:
        return
    bt, dt = text_config(bc), text_config(dc)
    for f in ARCH_FIELDS:
        src_b = bt if f in bt else bc
        src_d = dt if f in dt else dc
        if f in src_b and f in src_d and src_b[f] != src_d[f]:
            raise SourceError(
                f"donor {donor_id!r} is a different model: config.json {f} is {src_d[f]!r}, the base has {src_b[f]!r}"
            )


def _check_donor_module(rule: Rule, bm: Module, donor: Analysis, recipe: Recipe) -> Module:
    where = f"{recipe.file}: {rule.field}"
    dm = donor.modules.get(bm.key)
    if dm is None:
        raise SourceError(f"{where}: donor {rule.donor!r} has no module {bm.key}")
    if bm.is_exl3 != dm.is_exl3:
        raise SourceError(f"{where}: {bm.key} is {'EXL3' if bm.is_exl3 else 'unquantized'} in the base but not in donor {rule.donor!r}")
    if bm.is_exl3:
        if (bm.in_features, bm.out_features) != (dm.in_features, dm.out_features):
            raise SourceError(
                f"{where}: {bm.key}: base has {bm.in_features}x{bm.out_features} features, "
                f"donor {rule.donor!r} has {dm.in_features}x{dm.out_features}"
            )
        if bm.codebook != dm.codebook:
            raise SourceError(
                f"{where}: {bm.key}: codebook {bm.codebook} in the base, {dm.codebook} in donor {rule.donor!r}; "
                "a mosaic keeps each module's tensor names, so base and donor must share the codebook"
            )
        if bm.structure() != dm.structure():
            bs = sorted(bm.tensors)
            ds = sorted(dm.tensors)
            raise SourceError(
                f"{where}: {bm.key}: tensor group differs: base {bs} {[(s, t.dtype, list(t.shape)) for s, t in sorted(bm.tensors.items()) if s != 'trellis']}, "
                f"donor {rule.donor!r} {ds} {[(s, t.dtype, list(t.shape)) for s, t in sorted(dm.tensors.items()) if s != 'trellis']}"
            )
    else:
        if set(bm.tensors) != set(dm.tensors):
            raise SourceError(f"{where}: {bm.key}: base has {sorted(bm.tensors)}, donor {rule.donor!r} has {sorted(dm.tensors)}")
        for s, t in bm.tensors.items():
            if dm.tensors[s].shape != t.shape:
                raise SourceError(
                    f"{where}: {bm.key}.{s}: shape {list(t.shape)} in the base, {list(dm.tensors[s].shape)} in donor {rule.donor!r}"
                )
    return dm


def _check_loadable(sel: Selection, rules: dict[str, int], recipe: Recipe) -> None:
    """The mosaic must load: fused expert groups uniform, fusion pairs on one codebook."""
    for (layer, proj), ms in sorted(expert_groups(sel.result.values()).items()):
        kinds = {(m.bits, m.codebook) for m in ms}
        if len(kinds) > 1:
            culprit = next((m for m in ms if m.key in rules), ms[0])
            idx = rules.get(culprit.key)
            who = f"{recipe.file}: replace[{idx}]" if idx is not None else str(recipe.file)
            desc = " vs ".join(f"{b:g} bits/{c}" for b, c in sorted(kinds, key=str))
            raise RecipeError(
                f"{who}: layer {layer} {proj}: routed experts would mix {desc}; exllamav3 fuses them, "
                "so replace all experts of this layer and projection together"
            )
    for m, other in fusion_problems(sel.result):
        idx = rules.get(m.key, rules.get(other.key))
        raise RecipeError(
            f"{recipe.file}: replace[{idx}]: {m.key} ({m.codebook}) and {other.key} ({other.codebook}) "
            "are fused by exllamav3 and must share a codebook"
        )


def pick(recipe: Recipe, base: Analysis) -> dict[int, dict[str, set[str]]]:
    """What each rule takes from the base: rule index -> module key -> tensor suffixes."""
    return {rule.index: _rule_modules(rule, base, recipe) for rule in recipe.rules}


def donor_modules(recipe: Recipe, picks: dict[int, dict[str, set[str]]]) -> dict[str, set[str]]:
    """Module keys each donor must supply: all a donor needs to be opened for."""
    out: dict[str, set[str]] = {d: set() for d in recipe.donors}
    for rule in recipe.rules:
        out[rule.donor].update(picks[rule.index])
    return out


def select(
    recipe: Recipe, base: Analysis, donors: dict[str, Analysis], picks: dict[int, dict[str, set[str]]] | None = None
) -> Selection:
    """Apply the recipe's rules to the base and donors; raise on anything that cannot be built."""
    picks = picks if picks is not None else pick(recipe, base)
    sel = Selection(result=dict(base.modules))
    rule_of_module: dict[str, int] = {}
    for did, d in donors.items():
        check_architecture(base, d, did)
    for rule in recipe.rules:
        picked = picks[rule.index]
        sel.modules_of_rule[rule.index] = list(picked)
        donor = donors[rule.donor]
        for key, suffixes in picked.items():
            bm = base.modules[key]
            dm = _check_donor_module(rule, bm, donor, recipe)
            for s in sorted(suffixes):
                name = f"{key}.{s}"
                if name in sel.rule_of:
                    raise RecipeError(
                        f"{recipe.file}: {rule.field}: selects {name}, already selected by replace[{sel.rule_of[name]}]"
                    )
                sel.donor_of[name] = rule.donor
                sel.rule_of[name] = rule.index
            rule_of_module[key] = rule.index
            if bm.is_exl3:
                sel.result[key] = dm
    _check_loadable(sel, rule_of_module, recipe)
    return sel
