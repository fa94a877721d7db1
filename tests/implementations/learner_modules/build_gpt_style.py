"""Self-attention as "Let's build GPT" writes it (the project's own code, in that
structure): a ``ModuleList`` of ``Head`` modules, each with its own bias-free
``key``/``query``/``value`` Linear and a ``tril`` buffer, concatenated and projected by
``proj``. The tutorial reads ``n_embd`` and ``block_size`` from globals; here the
multi-head module computes n_embd = num_heads * head_size and passes it down, so that the
suite can choose the model dim."""

import torch
import torch.nn.functional as F
from torch import nn

block_size = 32
dropout = 0.0


class Head(nn.Module):
    """One head of self-attention."""

    def __init__(self, head_size, n_embd):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        T = x.shape[1]
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        wei = self.dropout(wei)
        v = self.value(x)
        return wei @ v


class MultiHeadAttention(nn.Module):
    """Multiple heads of self-attention in parallel."""

    def __init__(self, num_heads, head_size):
        super().__init__()
        n_embd = num_heads * head_size
        self.heads = nn.ModuleList([Head(head_size, n_embd) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        return self.dropout(self.proj(out))


class HeadsConcatenatedReversed(MultiHeadAttention):
    """A mistake written into it: the heads concatenated in reverse order."""

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in reversed(self.heads)], dim=-1))
