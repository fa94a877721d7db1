"""The self-attention module a learner writes from a tutorial, and how to certify it.

The module has its own conventions: ``forward(x, mask=None)`` (self-attention only),
``mask`` with **1 = keep / 0 = blocked**, shape (L, L) or (B, L, L), and four Linear
layers ``w_q, w_k, w_v, w_o``. It is not an nn.MultiheadAttention drop-in, so it is
certified through an explicit ``Implementation`` (``implementation`` at the bottom):
an MHA-level adapter that converts the suite's masks and maps the weights.

    pytest conformance --impl=examples/learner_module.py:implementation
"""

import math

import torch
from torch import nn

from implementations import Capabilities, Implementation


class SelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, L, _ = x.shape  # x (B, L, D)
        # split heads: (B, L, D) -> (B, L, H, dh) -> (B, H, L, dh)
        q = self.w_q(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        k = self.w_k(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        v = self.w_v(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, L, L)
        if mask is not None:
            mask = mask if mask.dim() == 2 else mask.unsqueeze(1)  # (L, L) or (B, 1, L, L)
            scores = scores.masked_fill(mask == 0, float("-inf"))
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # a row that may attend nothing
        attn = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        out = (attn @ v).transpose(1, 2).contiguous().view(B, L, self.d_model)  # (B, L, D)
        return self.w_o(out)


# ---- the adapter: nn.MultiheadAttention's interface on top of SelfAttention ----------


class _AsMHA(nn.Module):
    """nn.MultiheadAttention's constructor and forward around SelfAttention (self-attention only)."""

    def __init__(self, embed_dim, num_heads, batch_first=False, device=None, dtype=None, **options):
        super().__init__()
        defaults = {"dropout": 0.0, "bias": True, "add_bias_kv": False, "add_zero_attn": False, "kdim": None, "vdim": None}
        if any(options.get(k, v) not in (v, embed_dim) for k, v in defaults.items()):
            raise NotImplementedError(f"SelfAttention supports none of {options}")
        self.inner = SelfAttention(embed_dim, num_heads).to(device=device, dtype=dtype)
        self.batch_first = batch_first

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not (torch.equal(query, key) and torch.equal(key, value)):
            raise NotImplementedError("SelfAttention is self-attention only: query, key, value must be equal")
        if is_causal and attn_mask is None:
            raise ValueError("is_causal is nn.MultiheadAttention's hint that attn_mask is causal: pass attn_mask")
        x = query if self.batch_first else query.transpose(0, 1)  # (B, L, D)
        blocked = torch.zeros(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)  # (B, L, L)
        for mask, view in ((attn_mask, (1, *x.shape[1:2] * 2)), (key_padding_mask, (x.shape[0], 1, x.shape[1]))):
            if mask is None:
                continue
            if mask.dim() == 3:
                raise NotImplementedError("per-head (B*N, L, S) masks: SelfAttention has one mask per batch")
            if mask.is_floating_point():  # MHA float masks are added: only 0 / -inf can become keep/blocked
                if not torch.all((mask == 0) | torch.isneginf(mask)):
                    raise NotImplementedError("float masks other than 0/-inf have no 1/0 equivalent")
                mask = torch.isneginf(mask)
            blocked = blocked | mask.reshape(view)  # MHA bool: True = blocked
        out = self.inner(x, mask=(~blocked).long())  # learner: 1 = keep, 0 = blocked
        return (out if self.batch_first else out.transpose(0, 1)), None


def _load(module, params):  # MHAParams names -> the learner's Linear layers
    with torch.no_grad():
        for i, layer in enumerate((module.inner.w_q, module.inner.w_k, module.inner.w_v)):
            D = module.inner.d_model
            layer.weight.copy_(torch.as_tensor(params.in_proj_weight[i * D:(i + 1) * D]))
            layer.bias.copy_(torch.as_tensor(params.in_proj_bias[i * D:(i + 1) * D]))
        module.inner.w_o.weight.copy_(torch.as_tensor(params.out_proj_weight))
        module.inner.w_o.bias.copy_(torch.as_tensor(params.out_proj_bias))


implementation = Implementation(
    name="learner-self-attention",
    capabilities=Capabilities(
        dtypes=("float64", "float32"), causal=None, gqa=False, different_v_dim=False,
        # No "cross_attention": the suite then only hands it query = key = value. No
        # "attn_mask": that feature includes per-head (B*N, L, S) masks and float biases,
        # which a 1/0 mask cannot express; causal cases (a 2-D mask with the is_causal
        # hint) and key padding masks still run.
        mha_features=frozenset({"batch_first", "key_padding_mask", "is_causal"}),
    ),
    mha=_AsMHA,
    load_weights=_load,
    description="examples/learner_module.py SelfAttention via an MHA-level adapter (self-attention, bool masks)",
)
