"""PyTorch backends: SDPA, nn.MultiheadAttention, flex_attention."""
