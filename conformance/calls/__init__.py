"""The call layer: one module per level (sdpa, mha, flash, varlen, kvcache) that makes the calls and checks them, their bounds, call specs and reports."""
