"""SDPA-level learned-sink mutants: :class:`SinkSDPA`, the zoo's straight-line SDPA
(:class:`~._sdpa_bases.NaiveSDPA`) taking ``sinks`` (N,), with one step of the sink wrong.
The flash level's sink mutants (``flash_mutants.py``) are the model; here the sink also
meets SDPA's masks. Records: ``smallest_case`` adds ``sinks`` (one logit per query head)
and, where the bug needs one, ``mask`` (the record vocabulary's); each is exposed on its
smallest case through the call alone (``tests/implementations/test_sdpa_sinks.py``).
"""

from __future__ import annotations

import torch

from implementations.base import Implementation
from implementations.mutants.sdpa._sdpa_bases import SDPA_CAPABILITIES, NaiveSDPA, _compute_dtype, safe_softmax
from implementations.mutants.record import Mutant

__all__ = ["SDPA_SINK_CAPABILITIES", "SDPA_SINK_MUTANTS", "SinkSDPA"]

#: The zoo's SDPA claims, learned sinks included.
SDPA_SINK_CAPABILITIES = SDPA_CAPABILITIES.replace(sdpa_sinks=True)


class SinkSDPA(NaiveSDPA):
    """Correct SDPA with learned sinks: the sink (one logit per query head) joins each
    row's max and softmax denominator, carries no value and is dropped after it."""

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, sinks=None):
        if sinks is None:
            return super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        self.check_inputs(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        in_dtype = query.dtype
        compute = _compute_dtype(in_dtype)
        q, k, v = query.to(compute), key.to(compute), value.to(compute)
        N = q.shape[-3]
        k, v = self.expand_kv_heads(k, v, num_heads=N)
        mask = self.prepare_mask(attn_mask, q, k, compute)
        scale = self.resolve_scale(scale, E=q.shape[-1], Ev=v.shape[-1])
        s = self.scores(q, k, scale, in_dtype)
        if mask is not None and mask.dtype != torch.bool:
            s = s + mask
        blocked = self.blocked_positions(mask, is_causal, s.shape[-2], s.shape[-1], s.device)
        if blocked is not None:
            s = s.masked_fill(blocked, float("-inf"))
        sink = sinks.to(device=s.device, dtype=compute).reshape(N, 1, 1)
        weights, sink_weight = self.sink_softmax(s, sink, mask)
        weights = self.dropout(weights, dropout_p)
        return self.attend_sink(weights, sink_weight, v).to(in_dtype)

    def sink_softmax(self, s, sink, mask=None):
        """(key weights (..., N, L, S), the dropped sink weight (..., N, L, 1)): the sink joins
        the row max (-inf in a row attending no key) and the denominator."""
        shift = torch.maximum(s.amax(dim=-1, keepdim=True), sink).detach()
        e = torch.exp(s - shift)
        total = e.sum(dim=-1, keepdim=True) + torch.exp(sink - shift)
        return e / total, torch.exp(sink - shift) / total

    def attend_sink(self, weights, sink_weight, v):
        return weights @ v


class SinkKeyWithValue(SinkSDPA):
    """The sink is a key with a value: its weight multiplies the first key's value."""

    def attend_sink(self, weights, sink_weight, v):
        return weights @ v + sink_weight * v[..., :1, :]


class SinkAfterShift(SinkSDPA):
    """The sink is appended after the row max was subtracted: exp(sink) unshifted in the denominator."""

    def sink_softmax(self, s, sink, mask=None):
        key_max = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max)))
        total = e.sum(dim=-1, keepdim=True) + torch.exp(sink)
        return e / total, torch.exp(sink) / total


class SinkColumnMasked(SinkSDPA):
    """With a bool mask, the sink column appended to the scores gets the mask padded with
    False (``F.pad(mask, (0, 1))``): the sink is blocked, as if absent, whenever a mask is given."""

    def sink_softmax(self, s, sink, mask=None):
        if mask is not None and mask.dtype == torch.bool:  # the padded column blocks the sink
            return safe_softmax(s), torch.zeros_like(s[..., :1])
        return super().sink_softmax(s, sink, mask)


class SinkScaled(SinkSDPA):
    """The sink logit is multiplied by the scale like a q·k logit (it is a final score)."""

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, sinks=None):
        if sinks is not None:
            used = self.resolve_scale(scale, E=query.shape[-1], Ev=value.shape[-1])
            sinks = sinks * used
        return super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)


def _implementation(name: str, sdpa: SinkSDPA, bug: str) -> Implementation:
    return Implementation(name=f"mutant:{name}", capabilities=SDPA_SINK_CAPABILITIES, sdpa=sdpa,
                          description=bug, listed=False)


def _case(**changes):
    return {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1, **changes}


def _mutant(name, cls, bug, origin, smallest, safe, prop):
    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest, expected_property=prop,
                  build=lambda: _implementation(name, cls(), bug), level="sdpa", safe_case=safe)


SDPA_SINK_MUTANTS = [
    _mutant("sdpa_sink_key_with_value", SinkKeyWithValue,
            "the sink is a key with a value: its weight multiplies the first key's value instead of being dropped",
            "hand-written pitfall: the sink appended as a BOS-like key (value kept) instead of a denominator term",
            _case(S=2, sinks=[0.5]), _case(S=2), "sdpa_sink_agreement"),
    _mutant("sdpa_sink_after_shift", SinkAfterShift,
            "the sink is appended after the row max is subtracted: exp(sink) unshifted in the denominator",
            "hand-written pitfall: scores shifted by their max before the sink column is concatenated",
            _case(S=2, E=2, sinks=[0.5]), _case(S=2, E=2), "sdpa_sink_agreement"),
    _mutant("sdpa_sink_masked_out", SinkColumnMasked,
            "with a bool mask the sink column gets the mask padded with False: the sink is blocked (absent)",
            "hand-written pitfall: the attention mask padded with F.pad(mask, (0, 1)) (value False) to cover "
            "the concatenated sink column",
            _case(S=2, sinks=[0.5], mask="block_last"), _case(S=2, sinks=[0.5]), "sdpa_sink_agreement"),
    _mutant("sdpa_sink_scaled", SinkScaled,
            "the sink logit is multiplied by the scale as if it were a q·k logit",
            "hand-written pitfall: the sink concatenated to the raw q·k before the scale is applied",
            _case(S=2, E=4, sinks=[1.5]), _case(S=2, E=1, sinks=[1.5]), "sdpa_sink_equivalence"),
]
