"""Learner-level mutants for the conventions of the attention modules people copy: a
per-head ``ModuleList`` of heads ("Let's build GPT"), a forward whose inputs are bound by
name (OpenNMT-py's ``forward(key, value, query, mask)``), a module that takes a mask and
so is read as non-causal. Each mistake is one the reading must not absorb:

* a module that takes a mask (so is certified as what it says: non-causal) but applies a
  causal rule anyway: the code's ``triu`` is no evidence where the signature says otherwise;
* the query projected from the key input and the key from the query (the dataflow binds
  each layer to the input it reads, so the scores come out transposed);
* the heads of a list of heads concatenated in reverse order;
* a (B, L, S) mask applied with its query and key axes swapped where the two agree
  (L = S), which only a mask with a query axis (a causal one) can show;
* a ``forward(x, memory)`` module (one key/value input, BART's ``key_value_states``) that
  projects the values from the query input: right on self-attention, where the two are
  one, wrong on every cross-attention call with key = value.

The correct modules are learner controls (``COPIED_CONTROLS``): each certifies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["COPIED_CONTROLS", "copied_mutants"]


class Head(nn.Module):
    """One head: its own bias-free key/query/value Linear layers of the head dim."""

    def __init__(self, d_model, head_size):
        super().__init__()
        self.key = nn.Linear(d_model, head_size, bias=False)
        self.query = nn.Linear(d_model, head_size, bias=False)
        self.value = nn.Linear(d_model, head_size, bias=False)

    def forward(self, x, mask=None):
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        return weights @ v


class HeadListAttention(nn.Module):
    """A ModuleList of per-head modules concatenated in order, then ``proj``;
    forward(x, mask=None) with mask (B, L, S) or (B, 1, S), 1 = keep."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.heads = nn.ModuleList([Head(d_model, d_model // n_heads) for _ in range(n_heads)])
        self.proj = nn.Linear(d_model, d_model)

    def ordered(self):
        return list(self.heads)

    def forward(self, x, mask=None):
        return self.proj(torch.cat([h(x, mask) for h in self.ordered()], dim=-1))


class KeyValueQueryAttention(nn.Module):
    """OpenNMT-py's order: forward(key, value, query, mask=None), mask True = blocked
    (B, 1, S) or (B, L, S); linear_keys/linear_values/linear_query/final_linear."""

    def __init__(self, head_count, model_dim, dropout=0.0):
        super().__init__()
        self.h, self.d = head_count, model_dim // head_count
        self.linear_keys = nn.Linear(model_dim, model_dim)
        self.linear_values = nn.Linear(model_dim, model_dim)
        self.linear_query = nn.Linear(model_dim, model_dim)
        self.final_linear = nn.Linear(model_dim, model_dim)
        self.p = dropout

    def split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.h, self.d).transpose(1, 2)

    def project(self, key, value, query):
        return self.split(self.linear_keys(key)), self.split(self.linear_values(value)), \
            self.split(self.linear_query(query))

    def forward(self, key, value, query, mask=None):
        B, L, D = query.shape
        k, v, q = self.project(key, value, query)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
        weights = torch.nan_to_num(torch.softmax(scores, dim=-1))
        weights = F.dropout(weights, self.p, training=self.training)
        return self.final_linear((weights @ v).transpose(1, 2).reshape(B, L, D))


class AccidentallyCausal(HeadListAttention):
    """Takes a mask (so it says non-causal) but also blocks every key after the query."""

    def forward(self, x, mask=None):
        L = x.shape[1]
        keep = ~torch.triu(torch.ones(L, L, dtype=torch.bool, device=x.device), diagonal=1)
        mask = keep if mask is None else (mask != 0) & keep
        return super().forward(x, mask)


class QueryFromKeyInput(KeyValueQueryAttention):
    """The query projected from the key input and the key from the query input."""

    def project(self, key, value, query):
        return self.split(self.linear_keys(query)), self.split(self.linear_values(value)), \
            self.split(self.linear_query(key))


class HeadsConcatenatedReversed(HeadListAttention):
    """The heads concatenated last first."""

    def ordered(self):
        return list(self.heads)[::-1]


class MemoryAttention(nn.Module):
    """Cross-attention with one key/value input: forward(x, memory=None), memory = x when
    None; q_proj, k_proj, v_proj, out_proj."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h = n_heads
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def heads(self, t):
        B, T, D = t.shape
        return t.view(B, T, self.h, D // self.h).transpose(1, 2)

    def values(self, x, memory):
        return self.v_proj(memory)

    def forward(self, x, memory=None):
        memory = x if memory is None else memory
        B, L, D = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(memory)), self.heads(self.values(x, memory))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, D))


class ValuesFromQueryInput(MemoryAttention):
    """The values projected from the query input instead of the memory (the slip
    ``v_proj(x)`` of a module copied from self-attention; written to run whatever L: its
    first S positions where L >= S)."""

    def values(self, x, memory):
        return self.v_proj(x[:, :memory.shape[1]] if x.shape[1] >= memory.shape[1] else memory)


class MaskAxesSwapped(KeyValueQueryAttention):
    """A square (B, L, S) mask read as (B, S, L): the query and key axes swapped."""

    def forward(self, key, value, query, mask=None):
        if mask is not None and mask.dim() == 3 and mask.shape[1] == mask.shape[2]:
            mask = mask.transpose(1, 2)
        return super().forward(key, value, query, mask)


#: The correct modules, by name (learner controls).
COPIED_CONTROLS = {cls.__name__: cls for cls in (HeadListAttention, KeyValueQueryAttention, MemoryAttention)}


def copied_mutants(mutant, case) -> list:
    """The records, built with learner_mutants' ``_mutant`` and ``_case`` helpers."""
    return [
        mutant(
            "learner_accidentally_causal", AccidentallyCausal,
            bug="a learner's module that takes a mask (so is certified non-causal) blocks the keys after each "
                "query anyway",
            origin="hand-written pitfall (a decoder's causal mask left in an encoder's self-attention)",
            smallest_case=case(L=2), expected_property="mha_agreement", safe_case=case(L=1, N=2),
        ),
        mutant(
            "learner_query_key_inputs_swapped", QueryFromKeyInput,
            bug="a learner's forward(key, value, query, mask) projects the query from the key input and the key "
                "from the query (the scores transposed)",
            origin="hand-written pitfall (OpenNMT-py's argument order read as (query, key, value))",
            smallest_case=case(L=2), expected_property="mha_agreement", safe_case=case(L=1, N=2),
        ),
        mutant(
            "learner_heads_concatenated_reversed", HeadsConcatenatedReversed,
            bug="a learner's list of per-head modules is concatenated last head first before the output "
                "projection",
            origin="hand-written pitfall (a ModuleList of heads gathered in the wrong order)",
            smallest_case=case(N=2), expected_property="mha_agreement", safe_case=case(N=1, L=2),
        ),
        mutant(
            "learner_values_from_query_input", ValuesFromQueryInput,
            bug="a learner's forward(x, memory) projects the values from the query input, not the memory",
            origin="hand-written pitfall (v_proj(x) left in a cross-attention module copied from self-attention)",
            smallest_case=case(self_attention=False, shared_kv=True), expected_property="mha_agreement",
            safe_case=case(L=2, N=2),
        ),
        mutant(
            "learner_mask_axes_swapped", MaskAxesSwapped,
            bug="a learner's module applies a square (B, L, S) mask with its query and key axes swapped",
            origin="hand-written pitfall (a mask built (B, S, L) for scores laid out (B, H, L, S))",
            smallest_case=case(L=2, is_causal=True, attn_mask="causal_bool"), expected_property="mha_agreement",
            safe_case=case(L=1, N=2),
        ),
    ]
