"""Self-attention as timm's vision-transformer ``Attention`` writes it (the project's own
code, in that structure): ``(dim, num_heads, qkv_bias)``, a fused ``qkv`` Linear and
``proj``, the mask handed to ``F.scaled_dot_product_attention`` as it comes (so a bool keep
mask and an additive float one both work)."""

import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))
