"""The pieces the varlen and kvcache levels share: calls checked one sequence at a time.

``conformance.calls.varlen`` (packed sequences) and ``conformance.calls.kvcache`` (one
decoding step against a cache) differ in how a batch is laid out, not in how each of its
sequences is judged: each is one SDPA problem of its own (B = 1, its own L and S,
FlashAttention's bottom-right causal), or a flash problem with a window, soft-capping or
ALiBi. Here, once for both: the case's common attributes and saved fields
(:mod:`.cases`), that rule sequence by sequence (:mod:`.bounds`), the tensors handed over
and what must come back (:mod:`.calling`), and the reproducer's report (:mod:`.reports`).
"""
