"""Hand-written multi-head attention modules in the styles tutorials teach, each correct.

Every class here must certify at the learner level with no adapter
(``tests/implementations/test_learner_level.py``). They differ in what the learner level
has to read: constructor order and names, projection names (or a ModuleList, or a fused
Linear), forward inputs, mask polarity, dtype and shape, what is returned, dropout.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class KeepMaskAttention(nn.Module):
    """w_q/w_k/w_v/w_o, forward(x, mask) with 1 = keep of shape (B, 1, 1, S), -1e9 fill."""

    def __init__(self, d_model, num_heads, dropout=0.1):
        super().__init__()
        self.h, self.dk = num_heads, d_model // num_heads
        self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        B, L, D = x.shape
        q = self.w_q(x).view(B, L, self.h, self.dk).transpose(1, 2)
        k = self.w_k(x).view(B, L, self.h, self.dk).transpose(1, 2)
        v = self.w_v(x).view(B, L, self.h, self.dk).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dk)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(B, L, D)
        return self.w_o(out)


def clones(module, n):
    import copy

    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores + mask
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class AnnotatedMultiHeadedAttention(nn.Module):
    """The Annotated Transformer's (h, d_model) with a ModuleList ``linears`` of four,
    forward(query, key, value, mask) and an additive mask."""

    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k, self.h = d_model // h, h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        nbatches = query.size(0)
        query, key, value = [lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value), strict=False)]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query, key, value
        return self.linears[-1](x)


class FusedBlockedAttention(nn.Module):
    """One fused ``qkv`` Linear (3·D), ``proj`` out, mask True = blocked of shape (B, S),
    returns (output, weights per head)."""

    def __init__(self, dim, heads=8, qkv_bias=False, attn_drop=0.0):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, padding_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if padding_mask is not None:
            attn = attn.masked_fill(padding_mask[:, None, None, :], float("-inf"))
        attn = attn.softmax(dim=-1)
        attn = torch.nan_to_num(attn)
        weights = attn
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x), weights


class CrossAttention(nn.Module):
    """q_proj/k_proj/v_proj/out_proj, forward(query, key, value, attn_mask) with a bool
    keep mask of shape (B, L, S), F.dropout with training=self.training."""

    def __init__(self, embed_dim, n_heads, dropout=0.0, bias=True):
        super().__init__()
        self.n_heads, self.head_dim, self.p = n_heads, embed_dim // n_heads, dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _split(self, x):
        B, T, _ = x.shape
        return x.reshape(B, T, self.n_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, query, key, value, attn_mask=None):
        q, k, v = self._split(self.q_proj(query)), self._split(self.k_proj(key)), self._split(self.v_proj(value))
        scores = torch.einsum("bhld,bhsd->bhls", q, k) / math.sqrt(self.head_dim)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask.unsqueeze(1), torch.finfo(scores.dtype).min)
        weights = F.dropout(torch.softmax(scores, dim=-1), p=self.p, training=self.training)
        out = torch.einsum("bhls,bhsd->bhld", weights, v)
        B, H, L, E = out.shape
        return self.out_proj(out.permute(0, 2, 1, 3).reshape(B, L, H * E))


class GPTStyleAttention(nn.Module):
    """nanoGPT's names: fused ``c_attn`` cut with split(n_embd), ``c_proj``; forward(x,
    attention_mask) additive of shape (B, 1, 1, S) or (B, 1, L, S); returns the output."""

    def __init__(self, n_embd, n_head, bias=True):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x, attention_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if attention_mask is not None:
            att = att + attention_mask
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class PerHeadFusedAttention(nn.Module):
    """``to_qkv`` fused per head (reshape(B, L, H, 3·dh) then chunk), ``to_out``, no mask,
    returns (output, weights)."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, D = x.shape
        qkv = self.to_qkv(x).reshape(B, L, self.num_heads, 3 * D // self.num_heads).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        return self.to_out((w @ v).transpose(1, 2).reshape(B, L, D)), w


class SDPAAttention(nn.Module):
    """wq/wk/wv/wo without bias calling F.scaled_dot_product_attention; forward(x, kv,
    mask) with a bool keep mask of shape (B, 1, L, S)."""

    def __init__(self, hidden_size, num_attention_heads, dropout_p=0.0):
        super().__init__()
        self.nh, self.p = num_attention_heads, dropout_p
        self.wq = nn.Linear(hidden_size, hidden_size, bias=False)
        self.wk = nn.Linear(hidden_size, hidden_size, bias=False)
        self.wv = nn.Linear(hidden_size, hidden_size, bias=False)
        self.wo = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x, kv, mask=None):
        B, L, D = x.shape
        S = kv.shape[1]
        q = self.wq(x).view(B, L, self.nh, -1).transpose(1, 2)
        k = self.wk(kv).view(B, S, self.nh, -1).transpose(1, 2)
        v = self.wv(kv).view(B, S, self.nh, -1).transpose(1, 2)
        if mask is not None and mask.dim() == 4:
            rows = mask.any(dim=-1, keepdim=True)  # rows with no key: SDPA would give NaN
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~rows,
                                                 dropout_p=self.p if self.training else 0.0)
            out = out.masked_fill(~rows, 0.0)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p if self.training else 0.0)
        return self.wo(out.transpose(1, 2).reshape(B, L, D))


class D2LAttention(nn.Module):
    """Dive into Deep Learning's shape: lazy W_q/W_k/W_v/W_o without bias (their in_features
    are known only after a first call), heads folded into the batch, ``valid_lens`` (lengths,
    not a mask: masked cases are skipped, with the reason)."""

    def __init__(self, num_hiddens, num_heads, dropout=0.0, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = nn.Dropout(dropout)
        self.W_q, self.W_k = nn.LazyLinear(num_hiddens, bias=bias), nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v, self.W_o = nn.LazyLinear(num_hiddens, bias=bias), nn.LazyLinear(num_hiddens, bias=bias)

    def fold(self, X):  # (B, T, D) -> (B * H, T, D / H)
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def forward(self, queries, keys, values, valid_lens=None):
        q, k, v = self.fold(self.W_q(queries)), self.fold(self.W_k(keys)), self.fold(self.W_v(values))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        out = torch.bmm(self.dropout(F.softmax(scores, dim=-1)), v)
        out = out.reshape(-1, self.num_heads, out.shape[1], out.shape[2]).permute(0, 2, 1, 3)
        return self.W_o(out.reshape(out.shape[0], out.shape[1], -1))
