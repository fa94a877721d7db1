"""Contract mutants: bare functions a user would pass, resolved through recognition and
probing, whose one bug a behaviour-driven probe used to turn into a declaration.

Each mutant is built the way ``--impl=file.py:fn`` builds it: :func:`recognise` reads the
signature (scaled_dot_product_attention's or flash_attn_func's) and probes the callable.
Semantics come from the signature's contract, so each bug stays inside the claims and
its expected property fails:

* ``contract_causal_no_effect`` -- ``is_causal=True`` is ignored (once declared "no
  causal flag", every causal test skipped);
* ``contract_causal_lower_right`` -- an SDPA-signature ``is_causal`` aligned bottom-right
  (once declared ``lower_right``);
* ``contract_causal_blocks_diagonal`` -- the ``triu(ones, 0)`` slip: the causal triangle
  also blocks the diagonal (matched neither alignment: once "no causal flag");
* ``contract_value_ignored`` -- the output attends over the keys as values (once
  declared ``shared_kv``);
* ``contract_flash_causal_upper_left`` -- flash_attn_func's ``causal`` aligned top-left
  (once "no causal flag");
* ``contract_flash_window_no_effect`` -- ``window_size`` accepted and ignored (once
  declared unsupported);
* ``contract_causal_rows_uniform`` -- masks give zero rows but rows the (declared
  lower-right) causal flag empties come out uniform (once adopted per kind);
* ``contract_uniform_rows`` -- a finite fill: every fully-masked row is uniform (once
  adopted as ``uniform``).

:data:`CONTRACT_CONTROLS` are the correct counterparts with a *declared* non-default
convention (``--impl-option``), which must pass: a lower-right SDPA function declared
``causal=lower_right``, finite-fill uniform rows declared ``fully_masked=uniform``. Each
is a zero-argument builder (``--impl=implementations.mutants.sdpa.contract_mutants:NAME``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from implementations.base import Implementation
from implementations.mutants._base import LowerRightSDPA, NaiveSDPA
from implementations.mutants.flash.flash_mutants import CausalTopLeft, FlashBase
from implementations.mutants.sdpa.real_code_mutants import FlagEmptiedRowsUniform
from implementations.mutants.record import Mutant

__all__ = ["CONTRACT_CONTROLS", "CONTRACT_MUTANTS", "lower_right_declared", "recognised", "uniform_declared"]


def recognised(name: str, fn: Callable[..., Any], options: dict[str, str] | None = None,
               description: str = "") -> Implementation:
    """``fn`` as ``--impl`` resolves a bare callable: recognised by its signature, probed,
    then ``options`` applied as ``--impl-option`` would (the user's declarations)."""
    from implementations.registry.options import apply_options
    from implementations.registry.recognition import recognise

    impl = recognise(fn, name=name, origin=name, timeout=60.0)
    if options:
        impl = apply_options(impl, options)
    return dataclasses.replace(impl, listed=False, description=description or impl.description)


# --------------------------------------------------------------------------- the bugs


class CausalIgnored(NaiveSDPA):
    """``is_causal`` is accepted and dropped (as with a fused path that never passes it on)."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        return super().attend(q, k, v, mask, False, scale, dropout_p, in_dtype)


class CausalBlocksDiagonal(NaiveSDPA):
    """The blocked set is ``triu(ones(L, S), 0)``, diagonal included: query i sees keys
    j < i, so row 0 sees nothing (its output is 0, the safe softmax's)."""

    def causal_attend(self, L: int, S: int, device):
        return ~torch.ones(L, S, dtype=torch.bool, device=device).triu(0)


class ValueIgnored(NaiveSDPA):
    """Attends over the keys with the keys as values: ``value`` is never read."""

    def attend(self, q, k, v, mask, is_causal, scale, dropout_p, in_dtype):
        return super().attend(q, k, k, mask, is_causal, scale, dropout_p, in_dtype)


class UniformRows(NaiveSDPA):
    """Blocked logits get a large finite negative (a bool mask, the causal flag, and -inf
    entries of a float mask alike), so a row with every key blocked gets uniform weights."""

    def attention_weights(self, scores, mask, is_causal, dropout_p):
        if mask is not None and mask.dtype != torch.bool:
            scores = scores + mask
        blocked = self.blocked_positions(mask, is_causal, scores.shape[-2], scores.shape[-1], scores.device)
        fill = -0.7 * torch.finfo(scores.dtype).max
        if blocked is not None:
            scores = scores.masked_fill(blocked, fill)
        scores = torch.where(torch.isneginf(scores), torch.full_like(scores, fill), scores)
        return self.dropout(torch.softmax(scores, dim=-1), dropout_p)


class WindowIgnored(FlashBase):
    """``window_size`` is accepted and dropped: every key inside the causal rule is attended."""

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        return super().__call__(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                return_attn_probs=return_attn_probs)


# --------------------------------------------------------------------------- records

_ONE = {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1}


def _case(**changes: Any) -> dict[str, Any]:
    return {**_ONE, **changes}


def _mutant(name: str, make: Callable[[], Any], *, bug: str, origin: str, smallest_case: dict,
            expected_property: str, safe_case: dict | None, level: str = "sdpa",
            options: dict[str, str] | None = None, expected_cause: str | None = None) -> Mutant:
    def build() -> Implementation:
        return recognised(f"mutant:{name}", make(), options, bug)

    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest_case,
                  expected_property=expected_property, build=build, level=level, safe_case=safe_case,
                  expected_cause=expected_cause)


_PROBE = "hand-written pitfall, passed as a bare function: "

CONTRACT_MUTANTS = [
    _mutant("contract_causal_no_effect", CausalIgnored,
            bug="is_causal=True is accepted and has no effect (the output is the non-causal one)",
            origin=_PROBE + "a probe that read the behaviour declared it 'no causal flag', so every "
                   "causal test skipped",
            smallest_case=_case(L=2, S=2, causal=True), expected_property="causal_flag_equivalence",
            safe_case=_case(L=2, S=2)),
    _mutant("contract_causal_lower_right", LowerRightSDPA,
            bug="an SDPA-signature is_causal aligns the triangle bottom-right; "
                "scaled_dot_product_attention's is top-left",
            origin=_PROBE + "a probe that read the behaviour declared causal=lower_right, so it certified",
            smallest_case=_case(L=1, S=2, causal=True), expected_property="causal_flag_equivalence",
            safe_case=_case(L=2, S=2, causal=True)),
    _mutant("contract_causal_blocks_diagonal", CausalBlocksDiagonal,
            bug="the causal mask is triu(ones(L, S), 0), which blocks the diagonal too: query i sees keys j < i",
            origin=_PROBE + "the triu(ones, 0) slip (triu(ones, 1) was meant); a probe that found it "
                   "matched neither alignment declared 'no causal flag'",
            smallest_case=_case(L=2, S=2, causal=True), expected_property="causal_flag_equivalence",
            safe_case=_case(L=2, S=2)),
    _mutant("contract_value_ignored", ValueIgnored,
            bug="the output attends over the keys with the keys as values; value is never read",
            origin=_PROBE + "a probe that read the behaviour declared shared_kv (key is value), so the "
                   "suite passed one tensor as both and it certified",
            smallest_case=_case(S=1), expected_property="forward_agreement", safe_case=None),
    _mutant("contract_flash_causal_upper_left", CausalTopLeft, level="flash",
            bug="a bare flash_attn_func whose causal=True aligns the triangle top-left instead of bottom-right",
            origin="real code: flash-attn < 2.1 aligned causal top-left; passed as a bare function, a "
                   "probe that read the behaviour declared it 'no causal flag'",
            smallest_case=_case(L=1, S=2, causal=True), expected_property="flash_agreement",
            safe_case=_case(L=2, S=2, causal=True), expected_cause="flash_causal_upper_left"),
    _mutant("contract_flash_window_no_effect", WindowIgnored, level="flash",
            bug="a bare flash_attn_func accepts window_size and ignores it",
            origin=_PROBE + "a probe that saw no effect declared the window unsupported, so window "
                   "tests skipped",
            smallest_case=_case(L=2, S=2, window=[0, 0]), expected_property="window_equivalence",
            safe_case=_case(L=2, S=2), expected_cause="flash_window_ignored"),
    _mutant("contract_causal_rows_uniform", FlagEmptiedRowsUniform, options={"causal": "lower_right"},
            bug="rows the declared lower-right causal flag empties (L > S) give mean(V) while fully "
                "masked rows give 0",
            origin="real code: x-transformers' non-flash Attend (lower-right causal mask filled with a "
                   "finite value; masked rows zeroed): a probe that read each kind adopted "
                   "bool:zero,additive:zero,causal:uniform, so it certified",
            smallest_case=_case(L=2, S=1, causal="lower_right"), expected_property="fully_masked_rows",
            safe_case=_case(L=2, S=2, causal="lower_right")),
    _mutant("contract_uniform_rows", UniformRows,
            bug="blocked logits are filled with a finite value, so every fully-masked row is uniform "
                "(mean of V)",
            origin=_PROBE + "a finite mask fill; a probe that read it adopted fully_masked=uniform, "
                   "which attends the blocked keys, so it certified",
            smallest_case=_case(S=2, mask="all_blocked"), expected_property="fully_masked_rows",
            safe_case=_case(S=2)),
]


# --------------------------------------------------------------------------- controls


def lower_right_declared() -> Implementation:
    """A correct SDPA function whose is_causal is lower-right, declared so (passes)."""
    return recognised("control:lower_right_declared", LowerRightSDPA(), {"causal": "lower_right"},
                      "correct lower-right SDPA, --impl-option causal=lower_right")


def uniform_declared() -> Implementation:
    """Finite-fill SDPA whose fully-masked rows are uniform, declared so (passes)."""
    return recognised("control:uniform_declared", UniformRows(), {"fully_masked": "uniform"},
                      "finite-fill SDPA, --impl-option fully_masked=uniform")


CONTRACT_CONTROLS = {"lower_right_declared": lower_right_declared, "uniform_declared": uniform_declared}
