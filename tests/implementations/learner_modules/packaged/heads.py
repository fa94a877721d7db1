"""Helpers the attention module imports relatively."""


def split_heads(t, n_heads):
    B, T, D = t.shape
    return t.view(B, T, n_heads, D // n_heads).transpose(1, 2)


def merge_heads(t):
    B, H, T, d = t.shape
    return t.transpose(1, 2).reshape(B, T, H * d)
