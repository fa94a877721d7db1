"""What the learner level read and probed about one class (:class:`LearnerPlan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class LearnerPlan:
    """Everything read and probed about one learner class."""

    cls: type
    construction: Any           # how it is built (.construct.Construction)
    #: role -> layer path: "q", "k", "v", "o", "qkv"/"kv" for a fused one, "q@i" for head i's
    #: own layer; no "o": the module has no output projection (the identity).
    projections: tuple[tuple[str, str], ...]
    projections_how: str        # "by dataflow ...", "by name", "--impl-option"
    fused: str = "qkv"          # head layout of a fused projection
    fused_how: str = ""
    inputs: str = "self"        # "self" forward(x), "kv" forward(q, kv), "qkv" forward(q, k, v)
    forward_names: tuple[str, ...] = ()  # the forward's parameters bound to q[, k, v | kv]
    keyword: bool = False       # inputs passed by keyword (their names bind them)
    bind_how: str = ""
    mask_arg: str | None = None
    mask: str | None = None     # keep / blocked / additive, None: no mask
    mask_dtype: str = "bool"    # bool / long / float (keep and blocked masks)
    mask_how: str = ""
    #: keep/blocked masks, and additive float ones too (a module handing its mask to SDPA):
    #: a call with a float mask gets it additive.
    also_additive: bool = False
    #: accepted mask shapes, each a tuple of "B", "H", "L", "S", "1" (e.g. ("B", "1", "1", "S")).
    mask_shapes: tuple[tuple[str, ...], ...] = ()
    returns: str = "output"     # "output", "pair" (output, weights)
    weights: str | None = None  # None, "per_head" (B, H, L, S), "averaged" (B, L, S)
    #: Every call causal, and why (the code's evidence or the declaration); None: not.
    causal: str | None = None
    seq_first: bool = False     # inputs (L, B, D)
    layout_how: str = ""
    notes: tuple[str, ...] = field(default=())
    origin: str = ""            # the --impl value that named the class (file.py:Class, module:Class)

    @property
    def dropout_arg(self) -> str | None:
        return self.construction.dropout

    @property
    def out_identity(self) -> bool:
        return "o" not in dict(self.projections)

    def role(self, name: str) -> str | None:
        return dict(self.projections).get(name)


def expanded(projections: tuple[tuple[str, str], ...], H: int) -> list[tuple[str, str]]:
    """The projections of a module of ``H`` heads: a per-head pair ``("q@*", "heads.*.query")``
    is one pair per head (``("q@0", "heads.0.query")``, ...)."""
    out = []
    for role, path in projections:
        if role.endswith("@*"):
            out += [(f"{role[:-1]}{h}", path.replace("*", str(h), 1)) for h in range(H)]
        else:
            out.append((role, path))
    return out


def _shape_text(shape: tuple[str, ...]) -> str:
    return "(" + ", ".join(shape) + ")"


#: A mask's named axes in the order the suite holds them (a shape may name them in another).
_AXES = ("B", "H", "L", "S")


def axis_order(shape: tuple[str, ...]) -> list[int]:
    """The permutation taking a mask's named axes from (B, H, L, S) order to ``shape``'s."""
    canonical = [d for d in _AXES if d in shape]
    return [canonical.index(d) for d in shape if d in _AXES]


# --------------------------------------------------------------------------- the wrapper


class _Unsupported(NotImplementedError):
    pass

