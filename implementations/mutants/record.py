"""The bug-zoo record: one mutant, its single bug, and the case that exposes it.

``smallest_case`` (and ``safe_case``, a case where the bug does not show) use a small
vocabulary that ``tests/mutants/test_mutant_records.py`` turns into tensors:

* sizes ``B, N, K, L, S, E, Ev`` (MHA: ``D = N * E``, ``K = N``, ``Ev = E``);
* ``dtype`` (default ``"float64"``), ``layout`` (``"transposed"``: q/k/v stored as
  (B, L, N, E) and viewed as (B, N, L, E); ``"stride0"``: k/v of batch item 0
  ``expand``-ed over B ≥ 2 with stride 0), ``grad`` (compare dq/dk/dv too; MHA:
  the gradients of query, key and value), ``scale`` (explicit), ``causal``
  (``is_causal=True``; ``True`` or ``"upper_left"`` for PyTorch's triangle,
  ``"lower_right"`` for a mutant declaring FlashAttention's, whose reference is then
  the explicit ``tril(ones(L, S), S - L)`` mask), ``dropout_p``, ``repeat`` (call
  twice on the same input tensors and compare the second result: exposes inputs
  modified in place), ``sinks`` (SDPA: learned sink logits, one per query head, passed as
  ``sinks=``; the reference is then ``spec.sdpa(sinks=)``);
* ``mask`` (SDPA, True = may attend): ``"block_last"`` (every query row blocks the
  last key), ``"all_blocked"``, ``"additive"`` (randn, no zeros),
  ``"additive_all_blocked"`` (float, all -inf), ``"causal"`` (bool
  ``tril(ones(L, S))``: rows differ), ``"oversized"`` (bool (L, S + 1), all True: a
  shape that must raise);
* ``values``: ``"large"`` (q = k = 16: logits ≥ 256), ``"huge"`` (q = k = 300: q·k
  beyond float16's 65504), ``"wide_rows"`` (query row 0 = +10, row 1 = -10, keys
  = +10: rows 200 logits apart), ``"ascending_keys"`` (q = 1, key s = s / 4:
  the running max grows with every block);
* MHA: ``key_padding_mask`` / ``attn_mask`` (MHA convention, True = blocked):
  ``"bool_block_last"``, ``"float_block_last"`` (0 / -inf), ``"bool_all"``,
  ``"float"`` (randn), ``"causal_bool"``; ``is_causal``, ``need_weights``,
  ``average_attn_weights``, ``dropout`` (module p), ``training`` (default False;
  with ``dropout`` the mean over many calls is compared), ``unbatched`` (2-D
  (L, D) inputs, B = 1), ``self_attention`` (one input as query, key and value, L = S:
  modules that take one input);
* ``expect: "raise"``: the correct behaviour is an error (invalid input).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from implementations.base import Implementation

__all__ = ["Mutant"]


@dataclass(frozen=True)
class Mutant:
    """One implementation with exactly one documented bug.

    ``bug``: the bug in one sentence. ``origin``: ``"docs/KNOWN_BUGS.md #n"``, ``"hand-written
    pitfall"``, ``"kernel bug"`` or ``"real code: <library> ..."`` (what that library's
    code did) plus the story. ``smallest_case``: sizes and attributes of the smallest
    exposing case. ``expected_property``: the property id (docs/CONTRACTS.md)
    expected to catch it on its own (``benchmarks/mutation_score.py
    --expected-only``). ``build()`` returns the ``Implementation`` (name
    ``mutant:<name>``, ``listed=False``). ``expected_cause``:
    the id of the ``spec.variants`` variant that models the bug (None when none does:
    layout, gradient-only and should-raise bugs); the diagnosis of a failure is
    expected to name it first (``tests/diagnosis/``, ``benchmarks/diagnosis_accuracy.py``).
    """

    name: str
    bug: str
    origin: str
    smallest_case: dict[str, Any]
    expected_property: str
    build: Callable[[], Implementation]
    level: str = "sdpa"
    #: A case where the bug does not show (None where no such case exists).
    safe_case: dict[str, Any] | None = field(default=None)
    expected_cause: str | None = None
