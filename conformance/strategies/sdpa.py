"""SDPA cases: one scaled-dot-product-attention call inside an implementation's claims.

``sdpa_cases`` checks its arguments into a :class:`_SDPAPlan` once; each example
then draws, in this order: layout, regime, scale, causal alignment, (only when
``causal_dead_rows`` or ``length_relations`` ask for it) where dead rows come from
or how L relates to S, sizes, the seed, the mask, the stride-0 dims, and the q/k/v
values from the seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from conformance.core.cases import NOTE_STRIDE0_BATCH, NOTE_STRIDE0_HEADS, SDPACase
from conformance.strategies._drawing import draw_seed, named_strategy
from conformance.strategies._validation import (
    check_bool_or_none,
    check_device,
    check_dtype,
    choices,
    fail,
)
from conformance.strategies.sdpa_masks import (
    MASK_PATTERNS,
    draw_mask,
    mask_kind_choices,
)
from conformance.strategies.compile_budget import Branch, ConfigPool, config_pool
from conformance.strategies.shape_budget import check_shape_budget
from conformance.strategies.sizes import (
    LENGTH_RELATIONS,
    SizeBounds,
    draw_sizes,
    relation_possible,
    size_bounds,
)
from conformance.strategies.values import _scale_kind_choices, layout_choices, sdpa_values, value_regimes
from conformance.strategies.values import layouts as layout_strategies
from conformance.strategies.values import scales as scale_strategies
from implementations.base import CAUSAL_ALIGNMENTS, Capabilities

__all__ = ["sdpa_cases"]


@dataclass(frozen=True)
class _SDPAPlan:
    """Checked arguments of ``sdpa_cases``: what each example may draw."""

    dtype: str
    device: str
    mask_kinds: list[str]
    mask_patterns: list[str]
    causal: list[str | None]
    regimes: st.SearchStrategy[str]
    layouts: st.SearchStrategy[str]
    scales: st.SearchStrategy[float | None]
    bounds: SizeBounds
    fully_masked: bool | None
    #: Relations of L to S drawn per example (None: L and S drawn independently).
    length_relations: list[str] | None = None
    #: Whether half the lower-right causal cases get their dead rows from the flag alone.
    causal_dead_rows: bool = False
    #: With a compile budget, the configurations every example comes from.
    pool: ConfigPool | None = None
    #: Value is key (``caps.shared_kv``): one memory tensor.
    shared_kv: bool = False


def _causal_choices(causal: Any, caps: Capabilities | None) -> list[str | None]:
    """The checked ``causal`` argument (None: no flag or the alignment ``caps`` declares);
    with ``caps.causal_only`` only the declared alignment (a property asking for
    non-causal cases only skips: ``helpers.needs_non_causal``)."""
    chosen = _causal_choices_of(causal, caps)
    if caps is not None and caps.causal_only:
        return [c for c in chosen if c is not None] or [caps.causal]
    return chosen


def _causal_choices_of(causal: Any, caps: Capabilities | None) -> list[str | None]:
    if caps is None:
        allowed: list[str | None] = [None, *CAUSAL_ALIGNMENTS]
    else:
        allowed = [None] + ([caps.causal] if caps.causal else [])
    if causal is None:
        return allowed
    if isinstance(causal, str) or not isinstance(causal, Collection) or not causal:
        raise fail("causal", causal, "must be None or a non-empty collection of None / "
                   f"alignments {CAUSAL_ALIGNMENTS}", "pass e.g. causal=('upper_left',)")
    known = [None, *CAUSAL_ALIGNMENTS]
    unknown = [c for c in causal if c not in known]
    if unknown:
        raise fail("causal", causal, f"contains unknown {unknown!r}", f"choose from {known}")
    outside = [c for c in causal if c not in allowed]
    if outside:
        raise fail("causal", causal, f"asks for {outside} but caps.causal="
                   f"{caps.causal!r} (the alignment is_causal=True means)",
                   f"pass causal=(None, {caps.causal!r})" if caps.causal else "pass causal=(None,)")
    return [c for c in known if c in causal]


def _meet_fully_masked(fully_masked: bool | None, kinds: list[str], causal: list[str | None],
                       bounds: SizeBounds) -> tuple[list[str], list[str | None]]:
    """Mask kinds and causal options narrowed so that ``fully_masked`` can be met."""
    l_gt_s_possible = relation_possible("L>S", bounds)
    l_le_s_possible = relation_possible("L<=S", bounds)
    if fully_masked:
        if "none" in kinds and len(kinds) > 1:
            kinds = [k for k in kinds if k != "none"]
        elif kinds == ["none"]:
            if "lower_right" not in causal or not l_gt_s_possible:
                raise fail("fully_masked", fully_masked, f"cannot be met with mask_kinds={kinds} "
                           f"and causal options {causal} (and L > S possible: "
                           f"{l_gt_s_possible})", "allow a 'bool' or 'additive' mask, "
                           "or causal=('lower_right',) with max_L > min_S")
            causal = ["lower_right"]
    if fully_masked is False and not l_le_s_possible:
        causal = [c for c in causal if c != "lower_right"]
        if not causal:
            raise fail("fully_masked", fully_masked, "is impossible: causal='lower_right' with "
                       "every L > S blocks rows", "pass max_S>=min_L or fully_masked=None")
    return kinds, causal


def _length_relation(plan: _SDPAPlan, causal: str | None) -> str | None:
    """"L<=S" / "L>S" when a lower-right causal flag must not / must block whole rows."""
    if causal != "lower_right":
        return None
    if plan.fully_masked is False:
        return "L<=S"
    if plan.fully_masked and plan.mask_kinds == ["none"]:
        return "L>S"
    return None


def _branches(plan: _SDPAPlan) -> list[Branch]:
    """Every way an example of ``plan`` may be drawn: per causal option, the mask kinds
    and the relation of L to S (as ``_draw_sdpa_case`` draws them without a budget)."""
    out = []
    for causal in plan.causal:
        relations = plan.length_relations or [_length_relation(plan, causal)]
        out += [Branch(causal, tuple(plan.mask_kinds), r) for r in relations]
        if plan.causal_dead_rows and causal == "lower_right":
            out.append(Branch(causal, ("none",), "L>S", flag_dead_rows=True))
    return out


def _budget_pool(plan: _SDPAPlan, budget: int, layouts: list[str], scale_kinds: list[str]) -> ConfigPool:
    """The plan's configurations under a compile budget (``strategies.compile_budget``)."""
    return config_pool(plan.bounds, budget, layouts=layouts, branches=_branches(plan),
                       scale_kinds=scale_kinds, dtype=plan.dtype)


def _length_relation_choices(length_relations: Any, fully_masked: bool | None,
                             bounds: SizeBounds) -> list[str] | None:
    """The checked ``length_relations`` argument, narrowed to what the size bounds allow."""
    if length_relations is None:
        return None
    chosen = choices("length_relations", length_relations, LENGTH_RELATIONS, LENGTH_RELATIONS)
    if fully_masked is not None:
        raise fail("length_relations", length_relations, f"cannot be combined with "
                   f"fully_masked={fully_masked} (which fixes L against S for lower-right "
                   "cases)", "pass fully_masked=None")
    possible = [r for r in chosen if relation_possible(r, bounds)]
    if not possible:
        raise fail("length_relations", length_relations, f"leaves no (L, S): L in "
                   f"[{bounds.min_L}, {bounds.max_L}], S in [{bounds.min_S}, {bounds.max_S}]",
                   "widen the length bounds or allow another relation")
    return possible


def _causal_dead_rows_possible(causal_dead_rows: Any, fully_masked: bool | None,
                               kinds: list[str], causal: list[str | None],
                               bounds: SizeBounds) -> bool:
    """The checked ``causal_dead_rows`` argument: can a flag alone empty rows here?"""
    check_bool_or_none("causal_dead_rows", causal_dead_rows)
    if not causal_dead_rows:
        return False
    if fully_masked is not True:
        raise fail("causal_dead_rows", causal_dead_rows, f"only means something with "
                   f"fully_masked=True (got fully_masked={fully_masked})",
                   "pass fully_masked=True or drop causal_dead_rows")
    return "none" in kinds and "lower_right" in causal and relation_possible("L>S", bounds)


def _draw_stride0_axes(draw: st.DrawFn, layout: str, sizes: dict[str, int]) -> tuple[list[int], list[str]]:
    """Dims key/value are expanded along (batch always, kv heads sometimes), and their notes."""
    if layout != "stride0":
        return [], []
    axes, notes = [0], [NOTE_STRIDE0_BATCH]
    if sizes["K"] > 1 and draw(st.booleans()):
        axes.append(1)
        notes.append(NOTE_STRIDE0_HEADS)
    return axes, notes


def _draw_configured_case(draw: st.DrawFn, plan: _SDPAPlan, pool: ConfigPool) -> SDPACase:
    """A case whose layout, sizes, causal flag, mask kind and scale are one of ``pool``'s
    configurations (a compile budget); the rest is drawn as without one."""
    config = pool.draw(draw)
    regime = draw(plan.regimes)
    sizes = config.size_dict()
    return _finish_case(draw, plan, config.layout, regime, config.scale, config.causal,
                        [config.mask_kind], sizes)


def _draw_sdpa_case(draw: st.DrawFn, plan: _SDPAPlan) -> SDPACase:
    if plan.pool is not None:
        return _draw_configured_case(draw, plan, plan.pool)
    layout = draw(plan.layouts)
    regime = draw(plan.regimes)
    scale = draw(plan.scales)
    causal = draw(st.sampled_from(plan.causal))
    mask_kinds, relation = plan.mask_kinds, _length_relation(plan, causal)
    if plan.causal_dead_rows and causal == "lower_right" and draw(st.booleans()):
        # Rows emptied by the flag alone: no mask to fold it into, L > S.
        mask_kinds, relation = ["none"], "L>S"
    elif plan.length_relations is not None:
        relation = draw(st.sampled_from(plan.length_relations))
    # Kernel bugs live at block boundaries: every case sees block-size neighbours
    # (15..17, 31..33, 63..65) about one time in seven, non-contiguous and
    # "ascending" cases about a quarter of the time.
    boundary_heavy = layout != "contiguous" or regime == "ascending"
    min_batch = 2 if layout == "stride0" else None
    sizes = draw_sizes(draw, plan.bounds, relation=relation, min_batch=min_batch,
                       block_weight=8 if boundary_heavy else 4)
    return _finish_case(draw, plan, layout, regime, scale, causal, mask_kinds, sizes)


def _finish_case(draw: st.DrawFn, plan: _SDPAPlan, layout: str, regime: str, scale: float | None,
                 causal: str | None, mask_kinds: list[str], sizes: dict[str, int]) -> SDPACase:
    """The seed, the mask, the stride-0 dims and the values of a case whose layout,
    regime, scale, causal flag, mask kinds and sizes are drawn."""
    rng = draw_seed(draw)
    mask = draw_mask(draw, rng, sizes, mask_kinds=mask_kinds,
                     mask_patterns=plan.mask_patterns,
                     dtype=plan.dtype, causal=causal, fully_masked=plan.fully_masked)
    stride0_axes, stride0_notes = _draw_stride0_axes(draw, layout, sizes)
    query, key, value = sdpa_values(rng, sizes, regime, plan.dtype, scale, stride0_axes)
    if plan.shared_kv:
        value = key
    return SDPACase(query=query, key=key, value=value, attend_mask=mask.attend_mask,
                    additive_mask=mask.additive_mask, causal=causal, scale=scale,
                    dtype=plan.dtype, device=plan.device, layout=layout, regime=regime,
                    notes=mask.notes + tuple(stride0_notes))


def sdpa_cases(
    *,
    dtype: str,
    device: str = "cpu",
    caps: Capabilities | None = None,
    mask_kinds: Sequence[str] | None = None,
    mask_patterns: Sequence[str] | None = None,
    causal: Sequence[str | None] | None = None,
    gqa: bool | None = None,
    different_v_dim: bool | None = None,
    regimes: Sequence[str] | None = None,
    layouts: Sequence[str] | None = ("contiguous",),
    scale_kinds: Sequence[str] | bool = True,
    fully_masked: bool | None = None,
    causal_dead_rows: bool = False,
    length_relations: Sequence[str] | None = None,
    min_batch: int = 1,
    max_batch: int = 3,
    min_heads: int = 1,
    max_heads: int = 8,
    min_L: int = 1,
    max_L: int | None = None,
    min_S: int = 1,
    max_S: int | None = None,
    min_head_dim: int | None = None,
    max_head_dim: int | None = None,
    shape_budget: int | None = None,
) -> st.SearchStrategy[SDPACase]:
    """:class:`~conformance.core.cases.SDPACase` problems inside ``caps``.

    Forcing arguments (each a collection allows exactly its members; None allows
    everything ``caps`` declares):

    * ``mask_kinds`` ⊆ :data:`MASK_KINDS`; ``mask_patterns`` ⊆
      :data:`MASK_PATTERNS` (see :func:`masks` for shapes and forms);
    * ``causal``: alignments the case's ``causal`` field may hold, e.g.
      ``("upper_left",)`` forces a causal case, ``(None,)`` forbids one; a mask may
      come with it (both then apply); an alignment other than ``caps.causal`` raises;
    * ``gqa`` / ``different_v_dim``: True forces K < N / Ev != E, False forbids;
    * ``regimes`` ⊆ :data:`REGIMES` (see :func:`value_regimes`); ``layouts`` ⊆
      :data:`~conformance.core.cases.LAYOUTS` (default contiguous only; "stride0" draws
      B >= 2 and K/V equal along the expanded batch (and sometimes kv-head) dim;
      non-contiguous cases get block-size-neighbour lengths more often);
      ``scale_kinds`` True / False / subset of :data:`SCALE_KINDS` (see :func:`scales`);
    * ``fully_masked``: True forces at least one query row with every key blocked
      (by the mask, or by a lower-right causal flag with L > S when no mask is
      allowed), False forbids such rows (a lower-right causal case then has
      L <= S), None allows them (and sometimes builds one);
    * ``causal_dead_rows`` (with ``fully_masked=True``): half the lower-right causal
      cases get their blocked rows from the flag alone (no mask, L > S, so the first
      L - S rows see no key) even when masks are allowed; without it the runner
      folds causality into the forced mask and such rows never reach ``is_causal``.
      Ignored where ``causal`` holds no ``"lower_right"``, mask kind ``"none"`` is
      not allowed, or L > S is impossible;
    * ``length_relations`` ⊆ :data:`LENGTH_RELATIONS` (``"L=S"``, ``"L=1<S"``,
      ``"1<L<S"``, ``"L>S"``): each example first draws one relation, uniformly
      (shrinking toward the first), then L and S inside it, so a single query
      against several keys and more queries than keys each come a quarter of the
      time; relations the size bounds rule out are dropped. None (default): L and S
      are drawn independently. Needs ``fully_masked=None``;
    * size bounds ``min_/max_batch``, ``min_/max_heads``, ``min_/max_L``,
      ``min_/max_S``, ``min_/max_head_dim`` (defaults from ``caps``; tiny typical
      sizes, see :func:`sdpa_shapes`); ``caps.self_attention_lengths`` draws L == S
      only (relations other than ``"L=S"`` are then dropped, and dead rows from a
      lower-right flag alone are impossible); ``caps.shared_kv`` draws value = key
      (so Ev == E);
    * ``shape_budget`` (a compile budget): every example's layout, sizes, causal flag,
      mask kind and scale come from at most this many configurations fixed once per
      strategy, covering every option of each (for implementations that compile per
      configuration; see :mod:`conformance.strategies.compile_budget`). None: no budget.

    Values: a drawn seed feeds a NumPy Generator; arrays are drawn in float64 and
    rounded through ``dtype``. Shrinks toward B = N = K = L = S = 1, small E = Ev,
    no mask, no causal flag, regime "normal", layout "contiguous", default scale,
    seed 0; with a shape budget, toward the simplest of its shapes that fits.
    """
    arguments = dict(locals())
    check_dtype(dtype, caps)
    check_device(device, caps)
    check_bool_or_none("fully_masked", fully_masked)
    budget = check_shape_budget(shape_budget)
    kinds = mask_kind_choices(mask_kinds, caps)
    patterns = choices("mask_patterns", mask_patterns, MASK_PATTERNS, MASK_PATTERNS)
    causal_options = _causal_choices(causal, caps)
    regime_strategy = value_regimes(regimes=regimes)
    layout_options = layout_choices(layouts, caps)
    scale_strategy = scale_strategies(scale_kinds=scale_kinds, dtype=dtype, caps=caps)
    bounds = size_bounds(caps, min_batch=min_batch, max_batch=max_batch, min_heads=min_heads,
                         max_heads=max_heads, gqa=gqa, min_L=min_L, max_L=max_L, min_S=min_S,
                         max_S=max_S, min_head_dim=min_head_dim, max_head_dim=max_head_dim,
                         different_v_dim=different_v_dim)
    if "stride0" in layout_options and bounds.max_batch < 2:
        raise fail("max_batch", max_batch, "leaves no batch dim to expand for layout 'stride0'",
                   "pass max_batch>=2 or drop 'stride0' from layouts")
    relations = _length_relation_choices(length_relations, fully_masked, bounds)
    flag_dead_rows = _causal_dead_rows_possible(causal_dead_rows, fully_masked, kinds,
                                                causal_options, bounds)
    kinds, causal_options = _meet_fully_masked(fully_masked, kinds, causal_options, bounds)
    plan = _SDPAPlan(dtype=dtype, device=device, mask_kinds=kinds, mask_patterns=patterns,
                     causal=causal_options, regimes=regime_strategy,
                     layouts=layout_strategies(layouts=layout_options, caps=caps),
                     scales=scale_strategy, bounds=bounds, fully_masked=fully_masked,
                     length_relations=relations, causal_dead_rows=flag_dead_rows,
                     shared_kv=caps is not None and caps.shared_kv)
    if budget is not None:
        plan = dataclasses.replace(plan, pool=_budget_pool(
            plan, budget, layout_options, _scale_kind_choices(scale_kinds, caps)))
    strategy = named_strategy(sdpa_cases, arguments, lambda draw: _draw_sdpa_case(draw, plan))
    strategy.config_pool = plan.pool  # the compile budget's configurations (None: no budget)
    return strategy
