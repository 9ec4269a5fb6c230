"""``mosaic plan --pin PATTERN=TYPE``: tensors a user holds at a type of their choosing, which the exact choice
then works around.

A pin reads as ``llama-quantize --tensor-type`` reads its entries (the manual pins an automatic mixer is asked to
honour): the pattern lower-cased and searched as a regular expression anywhere in a tensor's name, the first pin
that matches deciding. A unit with a pinned tensor keeps only the versions that hold every such tensor at its
pinned type; where no version does, or a pin matches no tensor, the plan is refused in one line, and over a ladder
the line names the ladder option that would make the type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mosaic._base.errors import MosaicError
from mosaic._formats.quantizable import quantizable


@dataclass(frozen=True)
class Pin:
    text: str  # as given
    pattern: re.Pattern[str]
    type: str  # a ggml type's name


def parse_pins(texts: Sequence[str]) -> list[Pin]:
    """``PATTERN=TYPE`` each, TYPE a ggml type (any case)."""
    from gguf.constants import GGMLQuantizationType

    out = []
    for text in texts:
        pattern, sep, t = text.partition("=")
        if not sep or not pattern or not t:
            raise MosaicError(f"--pin {text}: expected PATTERN=TYPE (e.g. 'output\\.weight=q6_k')")
        try:
            type_ = GGMLQuantizationType[t.strip().upper()].name
        except KeyError:
            raise MosaicError(f"--pin {text}: {t} is not a ggml type") from None
        try:
            compiled = re.compile(pattern.lower())
        except re.error as e:
            raise MosaicError(f"--pin {text}: the pattern is not a regular expression ({e})") from None
        out.append(Pin(text, compiled, type_))
    return out


def pin_of(pins: Sequence[Pin], name: str) -> Pin | None:
    """The first pin whose pattern is found in ``name``."""
    return next((p for p in pins if p.pattern.search(name)), None)


def held_options(pins: Sequence[Pin], units: Sequence[tuple[object, object, tuple[str, ...]]], options: list[list],
                 type_of: Callable[[str, str], str], shape_of: Callable[[str], tuple[int, ...]],
                 missing: Callable[[str, str], str]) -> tuple[list[list], dict[str, int]]:
    """``options`` (per unit, its versions: objects with a ``donor``) narrowed to the versions that hold each pinned
    tensor of the unit at its pin's type (``type_of(donor, tensor)``), and how many tensors each pin holds.
    Refused: a pin no tensor the plan can move matches, a unit with no version at a pinned type (``missing(type,
    tensor)`` says which ladder option makes it)."""
    held = {p.text: 0 for p in pins}
    out = []
    for (_, _, tensors), opts in zip(units, options):
        mine = [(n, p) for n in tensors if quantizable(n, shape_of(n)) and (p := pin_of(pins, n)) is not None]
        if not mine:
            out.append(opts)
            continue
        keep = [o for o in opts if all(type_of(o.donor, n) == p.type for n, p in mine)]
        if not keep:
            n, p = next((n, p) for n, p in mine if not any(type_of(o.donor, n) == p.type for o in opts))
            have = sorted({type_of(o.donor, n) for o in opts})
            raise MosaicError(f"--pin {p.text}: no version of {n} is {p.type} (these sources hold it at "
                              f"{', '.join(have)}); {missing(p.type, n)}")
        for _, p in mine:
            held[p.text] += 1
        out.append(keep)
    idle = [t for t, n in held.items() if n == 0]
    if idle:
        raise MosaicError(f"--pin {idle[0]}: matches no tensor the plan chooses a type for")
    return out, held
