"""What the learner level read and probed about one class (:class:`LearnerPlan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class LearnerPlan:
    """Everything read and probed about one learner class."""

    cls: type
    dim_arg: str                # constructor parameter name of the model dim
    heads_arg: str              # ... of the head count
    dropout_arg: str | None     # constructor parameter taking the dropout probability
    #: role -> Linear attribute path: "q", "k", "v", "o", or "qkv"/"kv" for a fused one.
    projections: tuple[tuple[str, str], ...]
    projections_how: str        # "by name", "in definition order", "--impl-option"
    fused: str = "qkv"          # head layout of a fused projection
    fused_how: str = ""
    inputs: str = "self"        # "self" forward(x), "kv" forward(q, kv), "qkv" forward(q, k, v)
    forward_names: tuple[str, ...] = ()
    mask_arg: str | None = None
    mask: str | None = None     # keep / blocked / additive, None: no mask
    mask_dtype: str = "bool"    # bool / long / float (keep and blocked masks)
    mask_how: str = ""
    #: accepted mask shapes, each a tuple of "B", "H", "L", "S", "1" (e.g. ("B", "1", "1", "S")).
    mask_shapes: tuple[tuple[str, ...], ...] = ()
    returns: str = "output"     # "output", "pair" (output, weights)
    weights: str | None = None  # None, "per_head" (B, H, L, S), "averaged" (B, L, S)
    notes: tuple[str, ...] = field(default=())
    origin: str = ""            # the --impl value that named the class (file.py:Class, module:Class)

    def role(self, name: str) -> str | None:
        return dict(self.projections).get(name)


def _shape_text(shape: tuple[str, ...]) -> str:
    return "(" + ", ".join(shape) + ")"


# --------------------------------------------------------------------------- the wrapper


class _Unsupported(NotImplementedError):
    pass

