"""What each ``--impl-option`` key declares, with an example value: one entry per key of
:func:`~implementations.registry.declaration.known_keys`, the same keys a declaration
(TOML file, ``pyproject.toml`` table) holds. docs/OPTIONS.md's table of the keys is
generated from :func:`option_rows` (``python -m conformance.docgen``), and the tests hold
that every key has an entry and that every example parses as its key's value.

The bridge's, the learner's and ONNX's modules keep a one-line form of their keys for
their usage errors (``BRIDGE_OPTIONS``, ``LEARNER_OPTIONS``, ``ONNX_OPTIONS``); the entries
here say more.
"""

from __future__ import annotations

__all__ = ["DOCS", "EXAMPLES", "option_rows"]

#: Every key -> what it declares, in the order of the docs' table (by topic).
DOCS: dict[str, str] = {
    # -- where and in what it runs
    "devices": "the devices it runs on (`cpu`, `cuda`, `mps`, `xpu`); `--device` picks among them",
    "dtypes": "the dtypes it runs in; the first probe call is in float32 when declared, else in the first dtype "
              "declared. An 8-bit float format here goes to `fp8_dtypes`",
    "fp8_dtypes": "8-bit float formats q, k, v may be given in, with `q_descale`/`k_descale`/`v_descale` "
                  "(`fp8_agreement` at the flash level; `varlen_fp8_agreement`, `kvcache_fp8_agreement` where "
                  "those levels' features hold `fp8`); `none`: no FP8 inputs",
    "fp8_descales": "how the descales of an FP8 call may be given: `none`, per tensor (`per_tensor`, shape (1,)), "
                    "per batch element and kv head (`per_head`, (B, K)); FlashAttention-3 takes (B, K) or none "
                    "(probed for a function naming the descales, at B, K > 1)",
    "tf32": "float32 matmuls may run as TF32 on CUDA: float32 targets on CUDA get TF32's tolerance",
    # -- what the calls mean
    "causal": "the alignment `is_causal=True` means: `upper_left` (torch's) or `lower_right` (FlashAttention's "
              "and transformers'); `none`: no causal flag",
    "causal_only": "every call causal (a kernel without a non-causal path): cases draw causal only, properties "
                   "that check only non-causal calls skip; at the SDPA level no mask is tried",
    "fully_masked": "what a query row whose keys are all blocked gives: `zero`, `nan`, `uniform` or "
                    "`unspecified`; or one policy per kind of blocking (`bool:uniform,additive:nan,causal:zero`; "
                    "a bare policy in the list covers the kinds not named)",
    "custom_scale": "`scale=` honoured (`temperature`, and the properties that need an explicit scale); false: "
                    "a case with an explicit scale is outside the claims",
    "positive_scale": "an explicit scale must be > 0 (ONNX Runtime's `Attention`): negative and zero scales "
                      "are not drawn",
    "sdpa_sinks": "the SDPA callable takes learned sinks (N,) as `sinks=`, one logit per query head in the "
                  "softmax denominator (recognised from a parameter named `sinks`, `s_aux` or "
                  "`learnable_sink`, and probed)",
    # -- shapes and lengths
    "batch_dims": "exactly (B, N, L, E) inputs (`1`): the suite reshapes other ranks, and masks such as (L, S), "
                  "to 4-D, and the output back; none: any number of leading dims",
    "min_head_dim": "E and Ev at least this (tensor-core tiles); the flash level then draws E in [min, 2·min] "
                    "within `max_head_dim`",
    "max_head_dim": "E and Ev at most this",
    "head_dims": "E and Ev each one of these (kernels compiled for a few head dims): every case draws its head "
                 "dims from the set",
    "different_v_dim": "Ev != E accepted; false: a case with Ev != E is outside the claims",
    "seq_multiple": "L and S multiples of this (tiles not masked at the edges): lengths are drawn in blocks, "
                    "directed examples scaled by the block, the sweeps visit multiples only (sdpa, mha, flash)",
    "seq_block": "L and S each at most this or a multiple of it (any length inside one block, whole blocks "
                 "beyond: JAX's Pallas flash attention): draws and directed examples stay inside one block, "
                 "the sweeps visit the lengths inside it and its multiples; not with `seq_multiple`",
    "max_seq_len": "L and S at most this: draws, directed examples and sweeps stay under it",
    "backward_seq_multiple": "a limit of the backward alone: gradients are taken only where L and S are "
                             "multiples of this (`gradient_agreement` and `flash_gradients` draw such lengths, "
                             "the autograd probe runs at L = S = this); the forward takes any length",
    "self_attention_lengths": "L == S only (sliding-window and fused self-attention kernels): cases draw "
                              "L == S, the sweep visits L = S",
    "shared_kv": "key is value (one memory tensor, `forward(x, memory)`): the same tensor goes as key and "
                 "value (Ev = E), its gradient checked as dk + dv; properties that change values apart from "
                 "keys skip",
    # -- optional features
    "mask_kinds": "the attn_mask kinds accepted: `none`, `bool`, `additive` (a dtype-scoped one, "
                  "`float64.mask_kinds=none,bool`, in that dtype only)",
    "gqa": "K < N key/value heads (with `enable_gqa=True` where the callable has it): `gqa_equivalence`",
    "dropout": "`dropout_p > 0` honoured: `dropout_expectation`; at the flash level, false leaves "
               "`dropout_p` uncertified",
    "autograd": "backward through q, k, v (and an additive mask): the gradient properties",
    "mask_grad": "a gradient with respect to an additive mask; false: no mask gradient is asked for",
    "non_contiguous": "arbitrary strides accepted: `layout_independence`; false: contiguous inputs only",
    "mha_features": "the MHA level's features honoured (`attn_mask`, `key_padding_mask`, `need_weights`, "
                    "`cross_attention`, `bias_kv`, `zero_attn`, `kdim_vdim`, `dropout`, ...: docs/CONTRACTS.md); "
                    "`none`",
    "flash_features": "the `flash_attn_func` features honoured (`window`, `softcap`, `alibi`, `lse`, `sinks`, "
                      "`dropout_pattern`); by default flash_attn_func's own",
    "varlen_features": "the `flash_attn_varlen_func` options honoured (`window`, `softcap`, `alibi`, `lse`, "
                       "`dropout`, `dropout_pattern`, `fp8`); `none`",
    "kvcache_features": "the `flash_attn_with_kvcache` options honoured (`window`, `softcap`, `alibi`, `lse`, "
                        "`rotary`, `cache_batch_idx`, `cache_leftpad`, `num_splits`, `fp8`); a function with "
                        "that signature claims those whose parameters it has; `none`",
    "kv_paged": "`block_table=` (a paged cache) honoured: `paged_equivalence`",
    "kv_append": "new `k=`/`v=` written into the cache at `cache_seqlens`: `kvcache_equivalence`",
    "rotary_dim_multiple": "rotary dims (2·rotary_cos.shape[1]) multiples of this (FlashAttention-2: 16): the "
                           "kvcache strategies draw them so, with a head dim that holds one",
    # -- context-parallel (sharded) level
    "sharded_features": "the sharded level's optional features: `window` (`window_size=(left, right)` over "
                        "global positions), `padding` (lengths the world size does not divide, `seq_len=L`); "
                        "none unless declared",
    "sharded_lse": "the sharded callable returns `(output, lse)`, lse (B, N, L_shard) in natural log",
    "sharded_heads_divisible": "the sharded callable re-shards over heads (all-to-all): N and K must be "
                               "multiples of the world size",
    # -- how it is run
    "jit": "compiles per configuration (JAX, torch.compile): each property draws from a budget of shapes "
           "(`--compile-budget`), and no flash level is derived unless `derived_flash=true`; a bridged JAX "
           "function is compiled by default, `jit=false` runs it op by op",
    "derived_flash": "false: no flash level derived from the SDPA callable through masks (docs/BUILTINS.md, "
                     "levels derived from SDPA); `jit` implementations: off unless `derived_flash=true`",
    # -- a function of another framework (the bridge)
    "framework": "the array framework of a function the bridge runs: `numpy`, `jax`, `keras`, `tensorflow`, "
                 "`tinygrad`, `cupy`, `mlx`, `paddle` (else recognised from the function's module, the framework "
                 "modules its body uses, or for a body of method calls only the one framework its module imports)",
    "layout": "query, key, value and output of a bridged function are (B, L, N, E) (default BNLE; BLNE for "
              "Keras' and JAX's own `dot_product_attention` and Paddle's own `scaled_dot_product_attention`)",
    "call_kwargs": "keyword arguments given to every call of a bridged function, `NAME=VALUE` with Python "
                   "literal values: parameters SDPA's arguments do not fill (a required one, a mode switch; JAX's "
                   "Pallas flash attention in interpret mode); a name the bridge fills, or that the function "
                   "lacks, is refused",
    "interface_mask": "the `attention_mask` form of a transformers attention-interface function: `additive` or "
                      "`bool` (default: bool for `sdpa_attention_forward`, additive otherwise; the mask function "
                      "registered with `AttentionMaskInterface` decides it in a model)",
    # -- a hand-written multi-head module (the learner level: docs/LEARNER.md)
    "learner_mask": "the module's mask convention: `keep` (1 = attend), `blocked` (True = blocked) or "
                    "`additive` (added to the scores)",
    "learner_fused": "how a fused q, k, v projection is cut: `qkv`, `kqv` or `qkv_per_head`",
    "learner_projections": "the attribute names of the Linear layers, `Q,K,V,O` (or `QKV,O` for a fused one)",
    "learner_init": "`DIM,HEADS`: the names of the constructor's model-dim and head-count parameters",
    "learner_config": "`NAME=VALUE,...`: attributes of the config object the constructor takes (a missing "
                      "one, a smaller limit); a value set here is kept",
    "learner_layout": "the module's inputs are (B, L, D) (`batch_first`) or (L, B, D) (`seq_first`)",
    # -- ONNX (docs/FRAMEWORKS.md)
    "onnx_exporter": "`--impl=onnx:SPEC`: `torch.onnx.export`'s exporter, `torchscript` (default) or `dynamo` "
                     "(needs onnxscript, exports about 30 times slower)",
    "onnx_opset": "`--impl=onnx:SPEC`: the ONNX opset to export to (default 17; the dynamo exporter converts its "
                  "own opset 18 down, the certificate says which opset the graphs got)",
    "onnx_inputs": "`--impl=path/model.onnx`: the graph's query, key, value and optional mask input names "
                   "(default: inputs named `query, key, value` or `q, k, v`, and `attn_mask`, `mask` or "
                   "`attention_mask`)",
    "onnx_layout": "`--impl=path/model.onnx`: the graph's query, key, value and output are (B, L, N, E) "
                   "(default BNLE)",
    "onnx_causal": "`--impl=path/model.onnx`: the graph is causal with this alignment, `upper_left` or "
                   "`lower_right` (then every call is causal, `causal_only`); without it `is_causal=True` is "
                   "refused",
}

#: Every key -> an example value, the one the docs' table shows (and the tests parse).
EXAMPLES: dict[str, str] = {
    "devices": "cpu,cuda", "dtypes": "float16,bfloat16", "fp8_dtypes": "float8_e4m3fn",
    "fp8_descales": "none,per_head", "tf32": "true", "causal": "lower_right", "causal_only": "true",
    "fully_masked": "bool:uniform,additive:nan", "custom_scale": "false", "positive_scale": "true",
    "sdpa_sinks": "true", "batch_dims": "1", "min_head_dim": "64", "max_head_dim": "256",
    "head_dims": "64,96,128", "different_v_dim": "false", "seq_multiple": "16", "seq_block": "128",
    "max_seq_len": "512", "backward_seq_multiple": "32", "self_attention_lengths": "true", "shared_kv": "true",
    "mask_kinds": "none,bool", "gqa": "false", "dropout": "true", "autograd": "false", "mask_grad": "false",
    "non_contiguous": "false", "mha_features": "need_weights,cross_attention", "flash_features": "window,lse",
    "varlen_features": "window,lse", "kvcache_features": "rotary,cache_leftpad", "kv_paged": "false",
    "kv_append": "false", "rotary_dim_multiple": "16", "sharded_features": "window,padding",
    "sharded_lse": "true", "sharded_heads_divisible": "true", "jit": "false",
    "derived_flash": "false", "framework": "jax", "layout": "BLNE", "call_kwargs": "interpret=True,segment_ids=None",
    "interface_mask": "bool", "learner_mask": "blocked", "learner_fused": "qkv",
    "learner_projections": "q_proj,k_proj,v_proj,out_proj", "learner_init": "d_model,n_heads",
    "learner_config": "block_size=32,bias=false", "learner_layout": "seq_first",
    "onnx_exporter": "dynamo", "onnx_opset": "18", "onnx_inputs": "q,k,v,mask", "onnx_layout": "BLNE",
    "onnx_causal": "lower_right",
}

def option_rows() -> list[tuple[str, str, str]]:
    """(key, example value, what it declares) for every ``--impl-option`` key, by topic."""
    return [(key, EXAMPLES[key], meaning) for key, meaning in DOCS.items()]
