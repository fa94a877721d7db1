"""Classic mistakes written into the copied modules' fixtures, one each, as a learner
would make them in that code (subclasses overriding the one method the mistake is in):
each must fail its certificate with the mistake named."""

import math

import torch
import torch.nn.functional as F

from . import espnet_style, labml_style, mingpt_style, timm_style


class MinGPTScaledByEmbedding(mingpt_style.CausalSelfAttention):
    """minGPT's forward with the scores scaled by 1/sqrt(n_embd), not 1/sqrt(head size)."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k, q, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (k, q, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class ESPnetSoftmaxOverQueries(espnet_style.MultiHeadedAttention):
    """ESPnet's attention with the softmax over the query axis (dim=-2)."""

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
            self.attn = torch.softmax(scores, dim=-2).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-2)
        x = torch.matmul(self.dropout(self.attn), value)
        return self.linear_out(x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k))


class LabmlScaledByModelDim(labml_style.MultiHeadAttention):
    """labml-nn's module with its scale taken from d_model, not d_k."""

    def __init__(self, heads, d_model, dropout_prob=0.1, bias=True):
        super().__init__(heads, d_model, dropout_prob, bias)
        self.scale = 1 / math.sqrt(d_model)


class TimmMergedWithoutTranspose(timm_style.Attention):
    """timm's Attention merging the heads with a reshape and no transpose back."""

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj(x.reshape(B, N, C))
