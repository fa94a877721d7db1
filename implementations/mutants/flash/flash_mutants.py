"""Flash-level mutants: ``flash_attn_func`` with one step wrong, one per flash property.

:class:`FlashBase` is a correct ``flash_attn_func`` in plain PyTorch whose steps
(logits, soft-cap, ALiBi bias, window, LSE, dropout, FP8 dequantisation) are methods; each
mutant overrides one. Its FP8 path computes as FlashAttention-3's forward does: q·k of the
FP8 values in float32 with ``softmax_scale · q_descale · k_descale`` folded into the
scale, ``P = exp(s - m)`` scaled by 2^8 and rounded to the inputs' FP8 format for the
P·V product, the row sum over the float32 P, ``v_descale`` applied to the output, the
output in bfloat16 (the FP8 mutants are in :mod:`.flash_extra_mutants`).
:class:`ManualBackwardFlash` is the same forward with FlashAttention's backward written
out (recompute P, ``D = rowsum(dO ⊙ O)``, ``dS = P ⊙ (dP − D)``) instead of autograd. Both
declare :data:`FLASH_CAPABILITIES`, honest about everything but their bug; the records
are at the bottom (``level="flash"``; ``smallest_case`` adds ``causal``, ``window``,
``softcap``, ``alibi`` (slopes list), ``sinks`` (one logit per head), ``lse`` (compare the LSE)
and ``grad``).
"""

from __future__ import annotations

import math

import torch

from implementations.base import Capabilities, Implementation
from implementations.mutants.record import Mutant

__all__ = ["FLASH_CAPABILITIES", "FLASH_MUTANTS", "FlashBase", "ManualBackwardFlash", "flash_implementation"]

FLASH_CAPABILITIES = Capabilities(
    devices=("cpu",),
    dtypes=("float64", "float32"),
    mask_kinds=frozenset({"none"}),
    causal="lower_right",
    fully_masked="zero",
    dropout=True,
    mask_grad=False,
    flash_features=frozenset({"window", "softcap", "alibi", "lse", "sinks", "dropout_pattern"}),
    fp8_dtypes=("float8_e4m3fn", "float8_e5m2"),
)
#: FlashAttention-3 scales P by 2^FP8_P_OFFSET before its FP8 cast (``Max_offset``: the
#: row max lands at 256, away from the format's subnormals) and divides it out again.
FP8_P_OFFSET = 8
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class FlashBase:
    """A correct ``flash_attn_func`` (float64/float32), one overridable method per step."""

    def logits(self, q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
        """Scaled logits (B, N, L, S), soft-capped when ``softcap > 0``."""
        s = scale * (q @ k.transpose(-1, -2))
        return softcap * torch.tanh(s / softcap) if softcap > 0 else s

    def positions(self, L: int, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Aligned query positions p_i = i + S - L (L, 1) and key indices (1, S)."""
        return torch.arange(L, device=device)[:, None] + (S - L), torch.arange(S, device=device)[None, :]

    def bias(self, slopes: torch.Tensor, L: int, S: int, device: torch.device) -> torch.Tensor:
        """ALiBi: -slope_h · |p_i - j|, (1 or B, N, L, S)."""
        position, keys = self.positions(L, S, device)
        return -slopes[..., None, None] * (position - keys).abs()

    def allowed(self, L: int, S: int, left: int, right: int, device: torch.device) -> torch.Tensor:
        """Window (L, S): p_i - left <= j <= p_i + right, -1 = unbounded."""
        position, keys = self.positions(L, S, device)
        allowed = torch.ones(L, S, dtype=torch.bool, device=device)
        if left >= 0:
            allowed &= keys >= position - left
        if right >= 0:
            allowed &= keys <= position + right
        return allowed

    def log_sum_exp(self, row_max: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return row_max + torch.log(total)

    def scores(self, q, k, softmax_scale, causal, window_size, softcap, alibi_slopes):
        """(B, N, L, S) scores (blocked = -inf) and the query/kv heads, heads first."""
        _, L, N, E = q.shape
        S, K = k.shape[1], k.shape[2]
        if N % K:
            raise ValueError(f"N={N} query heads must be a multiple of K={K} kv heads")
        scale = 1.0 / math.sqrt(E) if softmax_scale is None else softmax_scale
        query = q.transpose(1, 2)
        key = k.transpose(1, 2).repeat_interleave(N // K, dim=1)
        s = self.logits(query, key, scale, softcap)
        if alibi_slopes is not None:
            s = s + self.bias(alibi_slopes.to(s.dtype).reshape(-1, N), L, S, q.device)
        left, right = window_size
        allowed = self.allowed(L, S, left, 0 if causal else right, q.device)
        return s.masked_fill(~allowed, float("-inf")), scale

    def sink_weights(self, s: torch.Tensor, sink: torch.Tensor, key_max: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(key weights (B, N, L, S), the dropped sink weight (B, N, L, 1)): the sink (1, N, 1, 1)
        joins the row max (``key_max``, -inf in a row attending no key) and the denominator."""
        shift = torch.maximum(key_max, sink).detach()
        e = torch.exp(s - shift)
        total = e.sum(dim=-1, keepdim=True) + torch.exp(sink - shift)
        return e / total, torch.exp(sink - shift) / total

    def attend_sink(self, weights: torch.Tensor, sink_weight: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The output with sinks: the key weights times the values (the sink has no value)."""
        return self.attend(weights, value)

    # -- dropout (after the softmax, rescaled by 1 / (1 - p)) --

    def drop(self, s: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
        """The weights with dropout: each kept with the pattern ``keep``, rescaled by 1/(1 - p)."""
        return weights * keep / (1.0 - p)

    def dropout_lse(self, lse: torch.Tensor, e: torch.Tensor, keep: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        """The LSE of a dropout call: the softmax's, dropout plays no part in it."""
        return lse

    # -- FP8 inputs (FlashAttention-3's numerics) --

    def descale_q(self, q: torch.Tensor, q_descale: torch.Tensor, group: int) -> torch.Tensor:
        """q (B, L, N, E) in float32 times q_descale (B, K) of its kv head: h // group."""
        return q.float() * q_descale.repeat_interleave(group, dim=1)[:, None, :, None]

    def descale_k(self, k: torch.Tensor, k_descale: torch.Tensor) -> torch.Tensor:
        return k.float() * k_descale[:, None, :, None]

    def value_fp8(self, v: torch.Tensor, v_descale: torch.Tensor) -> torch.Tensor:
        """V for the P·V product: the stored FP8 values (v_descale is applied to the output)."""
        return v.float()

    def round_p(self, p: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, float]:
        """P = exp(s - m) in (0, 1] rounded to the FP8 format after a 2^8 offset, and the
        factor the P·V product is divided by to undo it."""
        offset = 2.0 ** FP8_P_OFFSET
        return (p * offset).to(fmt).float(), offset

    def fp8_lse(self, row_max: torch.Tensor, scaled_total: torch.Tensor, offset: float) -> torch.Tensor:
        """The LSE from the row sum of the offset P (2^8 · Σ exp(s - m)): the offset taken out."""
        return row_max + torch.log(scaled_total) - math.log(offset)

    def _fp8_call(self, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                  sinks, q_descale, k_descale, v_descale):
        B, _, N, _ = q.shape
        K = k.shape[2]

        def full(d):  # None / (1,) / (B, K) -> float32 (B, K)
            d = torch.ones(1) if d is None else d.float()
            return d.reshape(1, 1).expand(B, K) if d.numel() == 1 else d

        qd, kd, vd = full(q_descale), full(k_descale), full(v_descale)
        s, _ = self.scores(self.descale_q(q, qd, N // K), self.descale_k(k, kd), softmax_scale, causal,
                           window_size, softcap, alibi_slopes)
        value = self.value_fp8(v, vd).transpose(1, 2).repeat_interleave(N // K, dim=1)
        key_max = s.amax(dim=-1, keepdim=True)
        row_max = key_max if sinks is None else torch.maximum(key_max, sinks.float().reshape(1, N, 1, 1))
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(s - row_max)                                           # float32, <= 1
        keys_total = p.sum(dim=-1, keepdim=True)
        total = keys_total if sinks is None else keys_total + torch.exp(sinks.float().reshape(1, N, 1, 1) - row_max)
        p8, offset = self.round_p(p, q.dtype)
        safe = torch.where(total == 0, torch.ones_like(total), total)
        out = (p8 @ value) / (safe * offset)
        out = out * vd.repeat_interleave(N // K, dim=1)[:, :, None, None]
        out = out.transpose(1, 2).to(torch.bfloat16)
        if not return_attn_probs:
            return out
        # the LSE is the keys' own (a sink left out), from the keys' max
        key_row_max = torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max))
        key_total = torch.exp(s - key_row_max).sum(dim=-1, keepdim=True)
        empty = key_total == 0
        lse = self.fp8_lse(key_row_max, torch.where(empty, torch.ones_like(key_total), key_total) * offset, offset)
        return out, torch.where(empty, torch.full_like(lse, float("-inf")), lse)[..., 0], None

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None,
                 q_descale=None, k_descale=None, v_descale=None):
        if q.dtype in _FP8:
            if dropout_p:
                raise NotImplementedError("no dropout with FP8 inputs (FlashAttention-3 has none)")
            return self._fp8_call(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  return_attn_probs, sinks, q_descale, k_descale, v_descale)
        N, K = q.shape[2], k.shape[2]
        s, scale = self.scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes)
        value = v.transpose(1, 2).repeat_interleave(N // K, dim=1)
        key_max = s.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max))
        e = torch.exp(s - row_max)
        total = e.sum(dim=-1, keepdim=True)
        empty = total == 0
        safe_total = torch.where(empty, torch.ones_like(total), total)
        keep = None
        if sinks is None:
            weights = e / safe_total
        else:
            weights, sink_weight = self.sink_weights(s, sinks.to(s.dtype).reshape(1, N, 1, 1), key_max, scale)
        used = weights
        if dropout_p:  # after the softmax (the sink's dropped weight aside)
            keep = torch.rand(weights.shape, device=q.device) >= dropout_p
            used = self.drop(s, weights, keep, dropout_p)
        if sinks is None:
            out = self.attend(used, value).transpose(1, 2)
        else:
            out = self.attend_sink(used, sink_weight, value).transpose(1, 2)
        if not return_attn_probs:
            return out
        lse = torch.where(empty, torch.full_like(total, float("-inf")), self.log_sum_exp(row_max, safe_total))
        probs = None
        if keep is not None:
            lse = self.dropout_lse(lse, e, keep, row_max)
            probs = torch.where(keep, weights, -weights).detach()
        return out, lse[..., 0], probs

    def attend(self, weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return weights @ value


class _FlashBackward(torch.autograd.Function):
    """FlashAttention's backward by hand (``with_row_term=False``: the bug below)."""

    @staticmethod
    def forward(ctx, q, k, v, base, options, with_row_term):
        with torch.no_grad():
            out = FlashBase.__call__(base, q, k, v, **options)
        ctx.save_for_backward(q, k, v, out)
        ctx.base, ctx.options, ctx.with_row_term = base, options, with_row_term
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        o = ctx.options
        N, K = q.shape[2], k.shape[2]
        group = N // K
        with torch.no_grad():
            E = q.shape[3]
            scale = 1.0 / math.sqrt(E) if o["softmax_scale"] is None else o["softmax_scale"]
            query = q.transpose(1, 2)
            key = k.transpose(1, 2).repeat_interleave(group, dim=1)
            value = v.transpose(1, 2).repeat_interleave(group, dim=1)
            raw = scale * (query @ key.transpose(-1, -2))
            s, _ = ctx.base.scores(q, k, o["softmax_scale"], o["causal"], o["window_size"], o["softcap"],
                                   o["alibi_slopes"])
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)
            do = grad_out.transpose(1, 2)
            dv = p.transpose(-1, -2) @ do
            dp = do @ value.transpose(-1, -2)
            row = (do * out.transpose(1, 2)).sum(-1, keepdim=True) if ctx.with_row_term else 0.0
            ds = p * (dp - row)
            if o["softcap"] > 0:
                ds = ds * (1 - torch.tanh(raw / o["softcap"]) ** 2)
            dq = scale * ds @ key
            dk = scale * ds.transpose(-1, -2) @ query

            def fold(x):  # (B, N, S, X) -> (B, S, K, X), summed over each GQA group
                B, _, S, X = x.shape
                return x.reshape(B, K, group, S, X).sum(2).transpose(1, 2)

        return dq.transpose(1, 2), fold(dk), fold(dv), None, None, None


class ManualBackwardFlash(FlashBase):
    """:class:`FlashBase` forward with a hand-written backward."""

    with_row_term = True

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None,
                 q_descale=None, k_descale=None, v_descale=None):
        options = {"softmax_scale": softmax_scale, "causal": causal, "window_size": tuple(window_size),
                   "softcap": softcap, "alibi_slopes": alibi_slopes}
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        if sinks is not None or q.dtype in _FP8:  # the hand-written backward has neither: the forward alone
            return FlashBase.__call__(self, q, k, v, dropout_p, return_attn_probs=return_attn_probs,
                                      sinks=sinks, **options, **descales)
        if return_attn_probs or dropout_p:
            return FlashBase.__call__(self, q, k, v, dropout_p, return_attn_probs=return_attn_probs, **options)
        return _FlashBackward.apply(q, k, v, self, options, self.with_row_term)


def flash_implementation(name: str, attention: FlashBase, description: str) -> Implementation:
    return Implementation(name=f"mutant:{name}", capabilities=FLASH_CAPABILITIES, flash=attention,
                          description=description, listed=False)


# --------------------------------------------------------------------------- the mutants


class CausalTopLeft(FlashBase):
    """A right side of 0 (causal=True) aligns top-left (key j <= i), not bottom-right (j <= i + S - L)."""

    def allowed(self, L, S, left, right, device):
        allowed = super().allowed(L, S, left, right, device)
        if right == 0:  # the causal side, read top-left
            allowed = super().allowed(L, S, left, -1, device) & (
                torch.arange(S, device=device)[None, :] <= torch.arange(L, device=device)[:, None])
        return allowed


class BackwardWithoutRowTerm(ManualBackwardFlash):
    """The backward computes dS = P ⊙ dP, dropping D = rowsum(dO ⊙ O) (dS = P ⊙ (dP − D))."""

    with_row_term = False


class WindowLeftOffByOne(FlashBase):
    """The window's left side keeps keys j > p_i - left: one key short of left (strict <)."""

    def allowed(self, L, S, left, right, device):
        allowed = super().allowed(L, S, left, right, device)
        if left >= 0:
            position, keys = self.positions(L, S, device)
            allowed &= keys > position - left
        return allowed


class SoftcapBeforeScale(FlashBase):
    """Soft-caps the raw q·k and scales afterwards: scale·c·tanh(q·k / c), not c·tanh(scale·q·k / c)."""

    def logits(self, q, k, scale, softcap):
        raw = q @ k.transpose(-1, -2)
        return scale * (softcap * torch.tanh(raw / softcap) if softcap > 0 else raw)


class AlibiTopLeft(FlashBase):
    """ALiBi distance |i - j| (top-left) instead of |i + S - L - j|: wrong whenever L != S."""

    def bias(self, slopes, L, S, device):
        distance = (torch.arange(L, device=device)[:, None] - torch.arange(S, device=device)[None, :]).abs()
        return -slopes[..., None, None] * distance


class LseUncapped(FlashBase):
    """The LSE is of the scores before soft-capping (written out before the cap is applied)."""

    def __call__(self, q, k, v, *args, softcap=0.0, return_attn_probs=False, **kwargs):
        result = super().__call__(q, k, v, *args, softcap=softcap, return_attn_probs=return_attn_probs, **kwargs)
        if not return_attn_probs or not softcap:
            return result
        _, lse, _ = super().__call__(q, k, v, *args, softcap=0.0, return_attn_probs=True, **kwargs)
        return result[0], lse, None


class LseLog2(FlashBase):
    """The LSE is returned in base-2 units (log2 Σ 2^(s·log2 e), an exp2 kernel's bookkeeping)."""

    def log_sum_exp(self, row_max, total):
        return (row_max + torch.log(total)) / math.log(2.0)


class SinkKeyWithValue(FlashBase):
    """The sink is treated as a key with a value: its weight multiplies the first key's value
    (a BOS-token key) instead of being dropped."""

    def attend_sink(self, weights, sink_weight, value):
        return self.attend(weights, value) + sink_weight * value[..., :1, :]


class SinkAfterShift(FlashBase):
    """The sink logit is appended after the row max was subtracted from the scores: the
    denominator adds exp(sink) unshifted (read as sink + max; exp overflows at large sinks)."""

    def sink_weights(self, s, sink, key_max, scale):
        e = torch.exp(s - torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max)))
        total = e.sum(dim=-1, keepdim=True) + torch.exp(sink)
        return e / total, torch.exp(sink) / total


class SinkPerRow(FlashBase):
    """The sinks are read along the query rows instead of the heads: row i of every head uses
    sinks[i % N] (a (1, N, 1) view of (N,) broadcast against (B, L, N) scores)."""

    def sink_weights(self, s, sink, key_max, scale):
        N, L = sink.shape[1], s.shape[2]
        per_row = sink.reshape(-1)[torch.arange(L, device=s.device) % N].reshape(1, 1, L, 1)
        return super().sink_weights(s, per_row, key_max, scale)


class SinkWeightKept(FlashBase):
    """The sink column is kept in the output: its weight is added to every output feature
    (the sink given a value of ones instead of none)."""

    def attend_sink(self, weights, sink_weight, value):
        return self.attend(weights, value) + sink_weight


class SinkScaled(FlashBase):
    """The sink logit is multiplied by softmax_scale like a q·k logit (it is a final score)."""

    def sink_weights(self, s, sink, key_max, scale):
        return super().sink_weights(s, sink * scale, key_max, scale)


def _case(**changes):
    return {"B": 1, "N": 1, "K": 1, "L": 1, "S": 1, "E": 1, "Ev": 1, **changes}


#: The spec.variants variant that models each mutant's bug (the diagnosis names it).
_CAUSES = {"flash_causal_top_left": "flash_causal_upper_left",
           "flash_window_left_off_by_one": "flash_window_left_off_by_one",
           "flash_softcap_before_scale": "flash_softcap_before_scale", "flash_alibi_top_left": "flash_alibi_upper_left",
           "flash_lse_uncapped": "flash_lse_uncapped", "flash_lse_log2": "flash_lse_log2",
           "flash_sink_key_with_value": "flash_sink_with_value", "flash_sink_after_shift": "flash_sink_after_shift",
           "flash_sink_per_row": "flash_sink_per_row", "flash_sink_weight_kept": "flash_sink_weight_kept",
           "flash_sink_scaled": "flash_sink_scaled"}


def _mutant(name, cls, bug, origin, smallest, safe, prop):
    return Mutant(name=name, bug=bug, origin=origin, smallest_case=smallest, expected_property=prop,
                  build=lambda: flash_implementation(name, cls(), bug), level="flash", safe_case=safe,
                  expected_cause=_CAUSES.get(name))


FLASH_MUTANTS = [
    _mutant("flash_causal_top_left", CausalTopLeft,
            "flash_attn_func's causal=True aligns the triangle top-left (key j <= i) instead of bottom-right",
            "real code: flash-attn < 2.1 aligned causal top-left; 2.1 moved it to the bottom-right corner",
            _case(L=1, S=2, causal=True), _case(L=2, S=2, causal=True), "flash_agreement"),
    _mutant("flash_backward_no_row_term", BackwardWithoutRowTerm,
            "the backward drops D = rowsum(dO * O): dS = P * dP instead of P * (dP - D)",
            "kernel bug: the preprocessing pass of FlashAttention's backward (D) left out",
            _case(S=2, grad=True), _case(S=2), "flash_gradients"),
    _mutant("flash_window_left_off_by_one", WindowLeftOffByOne,
            "the sliding window keeps keys j > p_i - left instead of j >= p_i - left",
            "hand-written pitfall: an off-by-one in the window's left edge",
            _case(L=2, S=2, window=[1, 0]), _case(L=2, S=2, window=[-1, 0]), "window_equivalence"),
    _mutant("flash_softcap_before_scale", SoftcapBeforeScale,
            "soft-capping is applied to the raw q·k and the scale after it: scale·c·tanh(q·k/c)",
            "hand-written pitfall: softcap and softmax_scale applied in the wrong order",
            _case(S=2, E=4, softcap=0.5), _case(S=2, E=1, softcap=0.5), "softcap_agreement"),
    _mutant("flash_alibi_top_left", AlibiTopLeft,
            "the ALiBi distance is |i - j| (top-left) instead of |i + S - L - j| (bottom-right)",
            "hand-written pitfall: ALiBi aligned to PyTorch's top-left convention",
            _case(L=1, S=2, alibi=[1.0]), _case(L=2, S=2, alibi=[1.0]), "alibi_equivalence"),
    _mutant("flash_lse_uncapped", LseUncapped,
            "the returned LSE is of the logits before soft-capping",
            "hand-written pitfall: the LSE buffer written from the uncapped scores",
            _case(S=2, E=2, softcap=0.1, lse=True), _case(S=2, E=2, lse=True), "lse_agreement"),
    _mutant("flash_lse_log2", LseLog2,
            "the returned LSE is in base-2 units (the exp2 kernel's log2 sum), not natural log",
            "kernel bug: Triton/FlashAttention-3 style kernels keep the LSE in log2 units internally",
            _case(S=2, lse=True), None, "split_merge"),
    _mutant("flash_sink_key_with_value", SinkKeyWithValue,
            "the sink is a key with a value: its weight multiplies the first key's value instead of being dropped",
            "hand-written pitfall: the sink appended as a BOS-like key (value kept) instead of a denominator term",
            _case(S=2, sinks=[0.5]), _case(S=2), "sink_agreement"),
    _mutant("flash_sink_after_shift", SinkAfterShift,
            "the sink is appended after the row max is subtracted: exp(sink) unshifted in the denominator",
            "hand-written pitfall: scores shifted by their max before the sink column is concatenated",
            _case(S=2, E=2, sinks=[0.5]), _case(S=2, E=2), "sink_agreement"),
    _mutant("flash_sink_per_row", SinkPerRow,
            "the sinks are read along the query rows (row i uses sinks[i % N]) instead of one per head",
            "hand-written pitfall: sinks (N,) broadcast against the (B, L, N) layout's wrong axis",
            _case(N=2, K=2, L=1, S=2, sinks=[0.5, -1.5]), _case(N=1, K=1, L=2, S=2, sinks=[0.5]),
            "sink_agreement"),
    _mutant("flash_sink_weight_kept", SinkWeightKept,
            "the sink's weight is kept in the output (added to every feature) instead of dropped",
            "hand-written pitfall: the sink column not sliced off after the softmax",
            _case(S=2, sinks=[0.5]), _case(S=2), "sink_agreement"),
    _mutant("flash_sink_scaled", SinkScaled,
            "the sink logit is multiplied by softmax_scale as if it were a q·k logit",
            "hand-written pitfall: the sink concatenated to the raw q·k before the scale is applied",
            _case(S=2, E=4, sinks=[1.5]), _case(S=2, E=1, sinks=[1.5]), "sink_equivalence"),
]
