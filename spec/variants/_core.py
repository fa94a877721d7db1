"""The records the variants work on: a problem, a variant, and what a variant computes.

Dimension letters: B batch, N query heads, K kv heads, L query length, S key length,
E q/k head dim, Ev value head dim, D model dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NamedTuple, Union

import numpy as np

from .. import _checks, sharding
from ..emulate import EMULATED_DTYPES
from ..errors import fail
from ..mha import MHAParams

__all__ = ["LEVELS", "FLASH_FAMILY", "POLICIES", "UNIT_ROUNDOFF", "SDPAProblem", "MHAProblem", "ShardedProblem", "Problem",
           "Variant", "VariantResult"]

LEVELS = ("sdpa", "mha", "sharded", "flash", "varlen", "kvcache")
#: The FlashAttention levels (``spec.variants._family``): their results may carry an LSE,
#: the caches after the call, and the sizes their allowed error is made from.
FLASH_FAMILY = ("flash", "varlen", "kvcache")
#: Unit roundoff (half the machine epsilon) of each dtype a problem may be computed in.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: Fully-masked-row policies an implementation may declare ("unspecified": any output).
POLICIES = ("zero", "nan", "uniform", "unspecified")


class VariantResult(NamedTuple):
    """What one convention outputs on one problem, in float64.

    SDPA: ``output`` (B, N, L, Ev), ``weights`` (B, N, L, S). MHA: ``output`` and
    ``weights`` as :func:`spec.mha_forward` returns them (weights None without
    ``need_weights``). ``slack``: extra allowed error, elementwise or scalar, for a
    convention that rounds in a lower precision than the case's dtype (a real
    implementation of it rounds differently from this model); 0 for exact math.

    The FlashAttention levels (flash, varlen, kvcache) return the call's other outputs
    too, in the call's layouts: ``lse`` (B, N, L) or packed (N, T), the caches after the
    call ``k_cache``/``v_cache`` (kvcache, in the logical layout the runner reads them
    back in), and what each output element's rounding scales with: ``magnitude``
    (weights · |V|, the output's shape) and ``score_size`` (the largest |score| a row
    attends, the LSE's shape). None where the level has no such part.
    """

    output: np.ndarray
    weights: np.ndarray | None = None
    slack: np.ndarray | float = 0.0
    lse: np.ndarray | None = None
    k_cache: np.ndarray | None = None
    v_cache: np.ndarray | None = None
    magnitude: np.ndarray | None = None
    score_size: np.ndarray | None = None


def _from_case(cls: type, case: Any, changes: dict[str, Any]) -> Any:
    values = {f.name: getattr(case, f.name) for f in fields(cls) if hasattr(case, f.name)}
    values.update(changes)
    return cls(**values)


def _check_common(dtype: Any, fully_masked: Any) -> None:
    _checks.check_choice("dtype", dtype, tuple(EMULATED_DTYPES))
    _checks.check_choice("fully_masked", fully_masked, POLICIES,
                         "pass the policy the implementation declares: " + ", ".join(POLICIES))


@dataclass(frozen=True, eq=False)
class SDPAProblem:
    """One SDPA call, described as the implementation received it.

    ``query`` (B, N, L, E), ``key`` (B, K, S, E), ``value`` (B, K, S, Ev);
    ``attend_mask`` bool **True = may attend** and/or ``additive_mask`` float (added to
    the scaled scores), each broadcastable to (B, N, L, S); ``causal`` None,
    ``"upper_left"`` or ``"lower_right"``: the alignment the implementation's causal
    flag was asked for (a causal constraint folded into the mask belongs in the mask);
    ``scale`` None = 1/sqrt(E). ``dtype``: the precision the implementation computed in
    (the arrays hold values representable in it). ``dropout_p``: the call's dropout
    probability; the observed output is then the mean over dropout samples and the
    correct convention is the no-dropout output. ``fully_masked``: the policy the
    implementation declares for rows with no attendable key.

    Field names are those of the runner's SDPA case, so ``SDPAProblem.from_case(case,
    fully_masked=...)`` converts one.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attend_mask: np.ndarray | None = None
    additive_mask: np.ndarray | None = None
    causal: str | None = None
    scale: float | None = None
    dtype: str = "float64"
    dropout_p: float = 0.0
    fully_masked: str = "zero"

    level = "sdpa"

    def __post_init__(self) -> None:
        for name, letters in (("query", "(B, N, L, E)"), ("key", "(B, K, S, E)"), ("value", "(B, K, S, Ev)")):
            array = _checks.as_float64(name, getattr(self, name))
            if array.ndim != 4:
                fail(name, array, f"must have rank 4, shape {letters}", "add the batch and head dims")
            object.__setattr__(self, name, array)
        if self.attend_mask is not None:
            object.__setattr__(self, "attend_mask", np.asarray(self.attend_mask))
        if self.additive_mask is not None:
            object.__setattr__(self, "additive_mask", np.asarray(self.additive_mask, dtype=np.float64))
        _checks.check_causal(self.causal)
        _check_common(self.dtype, self.fully_masked)
        if not 0.0 <= self.dropout_p < 1.0:
            fail("dropout_p", self.dropout_p, "must lie in [0, 1)", "pass the call's dropout probability")

    @classmethod
    def from_case(cls, case: Any, **changes: Any) -> "SDPAProblem":
        """Copy the fields ``case`` has under the same names; ``changes`` override."""
        return _from_case(cls, case, changes)

    @property
    def sizes(self) -> dict[str, int]:
        B, N, L, E = self.query.shape
        K, S, Ev = self.key.shape[1], self.key.shape[2], self.value.shape[3]
        return dict(B=B, N=N, K=K, L=L, S=S, E=E, Ev=Ev)

    @property
    def resolved_scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1]) if self.scale is None else float(self.scale)


@dataclass(frozen=True, eq=False)
class MHAProblem:
    """One ``nn.MultiheadAttention`` call, in that module's conventions.

    ``params`` a :class:`spec.MHAParams`; ``query``, ``key``, ``value`` and the masks
    exactly as :func:`spec.mha_forward` takes them (bool masks **True = blocked**,
    float masks added). ``dtype``: the module's precision. ``dropout``: the module's
    dropout probability, ``training`` its mode (the correct convention is the eval
    output, which is also the training-mode expectation). ``fully_masked``: the
    declared policy. Field names are the runner's MHA case's (``from_case``).
    """

    params: MHAParams
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    key_padding_mask: np.ndarray | None = None
    attn_mask: np.ndarray | None = None
    is_causal: bool = False
    need_weights: bool = True
    average_attn_weights: bool = True
    batch_first: bool = False
    dtype: str = "float64"
    dropout: float = 0.0
    training: bool = False
    fully_masked: str = "zero"

    level = "mha"

    def __post_init__(self) -> None:
        if not isinstance(self.params, MHAParams):
            fail("params", self.params, "must be a spec.MHAParams", "build it with spec.MHAParams(...)")
        for name in ("query", "key", "value"):
            object.__setattr__(self, name, _checks.as_float64(name, getattr(self, name)))
        _check_common(self.dtype, self.fully_masked)

    @classmethod
    def from_case(cls, case: Any, **changes: Any) -> "MHAProblem":
        """Copy the fields ``case`` has under the same names; ``changes`` override."""
        return _from_case(cls, case, changes)

    @property
    def unbatched(self) -> bool:
        return self.query.ndim == 2


@dataclass(frozen=True, eq=False)
class ShardedProblem:
    """One context-parallel call (``spec.sharding``), described by its whole sequence.

    ``query`` (B, N, L, E), ``key`` (B, K, L, E), ``value`` (B, K, L, Ev): the unsharded
    arrays (L the real length: a sequence that does not divide is padded at the end
    with zeros to ``spec.sharding.padded_length`` before it is sharded);
    ``world_size``, ``layout`` (``spec.sharding.LAYOUTS``), ``causal`` (bool, over global
    positions), ``window`` ``(left, right)`` over global positions, ``scale`` (None =
    1/sqrt(E)), ``dtype`` the precision the ranks computed in. Rows never lack a key
    (L == S, the diagonal is always attended), so ``fully_masked`` is ``"zero"`` (a
    variant that empties a row outputs 0 there, as a ring's empty merge does). Field
    names are the runner's sharded case's (``from_case``).
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    world_size: int = 1
    layout: str = "contiguous"
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    scale: float | None = None
    dtype: str = "float64"
    fully_masked: str = "zero"

    level = "sharded"

    def __post_init__(self) -> None:
        for name, letters in (("query", "(B, N, L, E)"), ("key", "(B, K, L, E)"), ("value", "(B, K, L, Ev)")):
            array = _checks.as_float64(name, getattr(self, name))
            if array.ndim != 4:
                fail(name, array, f"must have rank 4, shape {letters}", "add the batch and head dims")
            object.__setattr__(self, name, array)
        if not self.key.shape[2] == self.value.shape[2] == self.query.shape[2]:
            fail("key", self.key.shape, "must have the query's length L (one sequence, L == S)",
                 "pass the unsharded query, key and value of one sequence")
        sharding.padded_length(self.query.shape[2], self.world_size, self.layout)  # checks both
        object.__setattr__(self, "window", tuple(int(x) for x in self.window))
        sharding.allowed([0], [0], window=self.window)                            # checks the window
        _check_common(self.dtype, self.fully_masked)

    @classmethod
    def from_case(cls, case: Any, **changes: Any) -> "ShardedProblem":
        """Copy the fields ``case`` has under the same names; ``changes`` override."""
        return _from_case(cls, case, changes)

    @property
    def length(self) -> int:
        return int(self.query.shape[2])

    @property
    def padded_length(self) -> int:
        return sharding.padded_length(self.length, self.world_size, self.layout)


Problem = Union[SDPAProblem, MHAProblem, ShardedProblem]


@dataclass(frozen=True)
class Variant:
    """One wrong convention of attention, as data.

    ``id``: stable name (the ids of every level but SDPA start with the level's name:
    ``mha_``, ``sharded_``, ``flash_``, ``varlen_``, ``kvcache_``). ``level``: one of
    :data:`LEVELS`, the problem type it takes. ``summary``: what the wrong implementation
    does, one sentence. ``models``: the real-world bug it stands for.
    ``applies(problem) -> bool``: whether the convention bears on this problem at all;
    False guarantees the variant's output equals the correct one (within the
    problem's rounding), True means it may differ (it does unless the values
    happen to hide it). ``compute(problem) -> VariantResult``: what the wrong
    implementation outputs, in float64, defined on every problem of the level (the
    correct output, to rounding, where ``applies`` is False); None for a variant that
    is not a function of the inputs (random), whose ``detect`` says how to see it.
    ``precision``: for a variant that computes in a lower precision than the problem's
    dtype (a float32 softmax of float64 inputs), that precision; ``rank`` then matches
    the observation against it with the allowed error scaled up to that precision
    (a real implementation of the mistake rounds in its own order, not the model's).
    ``declaration``: for a variant that is a valid convention a user may intend (the
    other causal alignment, keys used as values, another fully-masked-row policy), the
    ``--impl-option`` that declares it (``{kind}`` stands for the mask kind of the
    failing call: bool, additive or causal). ``undeclarable``: for a variant that looks
    like a convention but has no declaration (a causal flag with no effect, an SDPA bool
    mask read as True = blocked), why it is a bug. At most one of the two.
    ``row_policy``: for a variant that only changes what rows with no attendable key
    output, that output ("nan", "uniform", "zero"): its NaN prediction is the behaviour
    it names (those rows are NaN), not a mechanism inferred from NaN positions.
    """

    id: str
    level: str
    summary: str
    models: str
    applies: Callable[[Any], bool] = field(repr=False)
    compute: Callable[[Any], VariantResult] | None = field(repr=False)
    detect: str = ""
    precision: str | None = None
    declaration: str = ""
    undeclarable: str = ""
    row_policy: str | None = None

    def __post_init__(self) -> None:
        _checks.check_choice("level", self.level, LEVELS)
        if self.declaration and self.undeclarable:
            fail("undeclarable", self.undeclarable, "a variant with a declaration cannot also be undeclarable",
                 "keep the one that is true")
        if self.declaration and not self.declaration.startswith("--impl-option "):
            fail("declaration", self.declaration, "must be the --impl-option text that declares the convention",
                 "write it as '--impl-option name=value'")
        if self.precision is not None:
            _checks.check_choice("precision", self.precision, tuple(UNIT_ROUNDOFF))
        if self.compute is None and not self.detect:
            fail("detect", self.detect, "a variant without compute must say how it is detected",
                 "describe the observation that reveals it")

    def declaration_for(self, kind: str = "bool") -> str:
        """``declaration`` with ``{kind}`` filled in ("" when the variant has none)."""
        return self.declaration.replace("{kind}", kind)

    @property
    def deterministic(self) -> bool:
        """Whether ``compute`` exists (the output is a function of the inputs)."""
        return self.compute is not None
