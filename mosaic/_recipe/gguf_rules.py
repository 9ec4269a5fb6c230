"""Which tensors of a GGUF model each recipe rule takes: the rule semantics over llama.cpp's names.

Pure and shared: the build uses it to plan, the audit to re-derive where each tensor must have come
from, the planner to price units. Layer rules look at ``blk.N.<module>...`` tensors; ``modules``
patterns match whole dotted components of the name inside the layer (``attn_q``, ``ffn_*_exps``,
``attn_q.weight``), and a few group names read the way llama.cpp users speak of a layer:

========== ==================================== ==========================================
group      tensors of the layer                 for example
========== ==================================== ==========================================
attn       ``attn_*`` (its norm included)       attn_q, attn_k, attn_v, attn_output, attn_norm
ffn        ``ffn_*`` and ``exp_probs_b``        everything of the feed-forward block
ffn_exps   ``ffn_*_exps``                        ffn_gate_exps, ffn_up_exps, ffn_down_exps
ffn_shexp  ``ffn_*_shexp``                       the shared experts
ffn_dense  ``ffn_gate``, ``ffn_up``, ``ffn_down``   a dense layer's MLP
ssm        ``ssm_*``                             recurrent (Mamba/KDA) tensors
norms      ``*_norm``                            every norm of the layer
========== ==================================== ==========================================

``keys`` rules are globs over whole tensor names (``output.weight``, ``token_embd.weight``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from mosaic._checkpoint.gguf_model import parse_name
from mosaic._recipe.document import Recipe, Rule, component_match

GROUPS: dict[str, tuple[str, ...]] = {
    "attn": ("attn_*",),
    "ffn": ("ffn_*", "exp_probs_b"),
    "ffn_exps": ("ffn_*_exps",),
    "ffn_shexp": ("ffn_*_shexp",),
    "ffn_dense": ("ffn_gate", "ffn_up", "ffn_down"),
    "ssm": ("ssm_*",),
    "norms": ("*_norm",),
}


def module_patterns(modules: Iterable[str]) -> tuple[str, ...]:
    """A rule's ``modules`` with group names replaced by their patterns."""
    out: list[str] = []
    for m in modules:
        out.extend(GROUPS.get(m, (m,)))
    return tuple(out)


def rule_takes(rule: Rule, name: str) -> bool:
    """Does ``rule`` take the tensor ``name``?"""
    if rule.keys is not None:
        return any(fnmatch.fnmatchcase(name, g) for g in rule.keys)
    layer, rest = parse_name(name)
    if rule.layers is None or layer is None or layer not in rule.layers:
        return False
    if rule.modules is None:
        return True
    return any(component_match(rest, p) for p in module_patterns(rule.modules))


class SelectionProblem(Exception):
    """A rule that selects nothing, a layer the model lacks, a pattern that matches nothing, or a
    tensor two rules select; ``field`` names the recipe field."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        super().__init__(f"{field}: {detail}")


def assign(recipe: Recipe, names: list[str]) -> dict[str, tuple[str, int]]:
    """Tensor name -> (donor id, rule index) for every tensor a rule takes; the rest stay the base's.

    Raises :class:`SelectionProblem` (naming the rule) for a layer the model lacks, a ``modules``
    pattern or ``keys`` glob that matches nothing, an empty rule, or a tensor two rules select."""
    layers = {parse_name(n)[0] for n in names} - {None}
    out: dict[str, tuple[str, int]] = {}
    for rule in recipe.rules:
        if rule.layers is not None:
            missing = [x for x in rule.layers if x not in layers]
            if missing:
                top = max(layers) if layers else -1
                raise SelectionProblem(f"{rule.field}.layers", f"layer(s) {', '.join(map(str, missing))} not in the base (blk.0–blk.{top})")
        if rule.modules is not None:
            in_layers = [parse_name(n)[1] for n in names if parse_name(n)[0] in (rule.layers or ())]
            for i, m in enumerate(rule.modules):
                pats = GROUPS.get(m, (m,))
                if not any(component_match(r, p) for r in in_layers for p in pats):
                    raise SelectionProblem(f"{rule.field}.modules[{i}]", f"{m!r} matches no tensor of the selected layers")
        if rule.keys is not None:
            for i, g in enumerate(rule.keys):
                if not any(fnmatch.fnmatchcase(n, g) for n in names):
                    raise SelectionProblem(f"{rule.field}.keys[{i}]", f"{g!r} matches no tensor of the base")
        taken = [n for n in names if rule_takes(rule, n)]
        if not taken:
            raise SelectionProblem(rule.field, "selects no tensor")
        for n in taken:
            if n in out:
                raise SelectionProblem(rule.field, f"tensor {n!r} is also selected by replace[{out[n][1]}]")
            out[n] = (rule.donor, rule.index)
    return out
