"""The learner level's ``--impl-option`` keys and the names it reads parameters by."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

from implementations.base import ImplementationError

#: ``--impl-option`` keys of the learner level -> what they take.
LEARNER_OPTIONS = {
    "learner_mask": "keep|blocked|additive (1 = keep / True = blocked / added to the scores)",
    "learner_fused": "qkv|kqv|qkv_per_head (how a fused q, k, v projection is cut)",
    "learner_projections": "Q,K,V,O attribute names of the Linear layers (or QKV,O for a fused one)",
    "learner_init": "DIM,HEADS names of the constructor's model-dim and head-count parameters",
    "learner_config": "NAME=VALUE[,NAME=VALUE] attributes of the config object the constructor takes",
    "learner_layout": "batch_first|seq_first (the module's inputs (B, L, D) or (L, B, D))",
}
MASK_CONVENTIONS = ("keep", "blocked", "additive")
FUSED_LAYOUTS = ("qkv", "kqv", "qkv_per_head")

DIM_NAMES = ("d_model", "embed_dim", "dim", "hidden_size", "n_embd", "d_embed", "model_dim", "emb_dim",
             "embedding_dim", "hidden_dim", "embed_size", "d_hidden", "n_state", "d", "dmodel", "width",
             "input_dim", "in_dim", "num_hiddens", "d_in")
HEAD_NAMES = ("num_heads", "n_heads", "heads", "h", "n_head", "nhead", "nheads", "num_attention_heads",
              "head_count", "n_heads_", "num_head", "head_num", "n_h")
#: forward arguments that give lengths (a prefix of valid keys), not a mask.
LENGTH_NAMES = ("valid_lens", "valid_len", "valid_length", "valid_lengths", "lengths", "lens", "seq_lens",
                "seq_len", "src_lengths", "key_lengths", "kv_lens")
DROPOUT_NAMES = ("dropout", "dropout_p", "attn_dropout", "p_drop", "drop", "p", "dropout_rate", "attn_pdrop",
                 "attention_dropout", "attn_drop", "drop_prob", "dropout_prob")

_OPTIONS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("learner_options", default=None)


# --------------------------------------------------------------------------- options


def split_learner_options(options: Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """``(learner options, the other options)``; an unknown ``learner_*`` key or a bad
    value raises ImplementationError naming the valid ones."""
    learner, rest = {}, {}
    for key, value in (options or {}).items():
        (learner if key.startswith("learner_") else rest)[key] = str(value)
    for key, value in learner.items():
        if key not in LEARNER_OPTIONS:
            raise ImplementationError(
                f"--impl-option {key}={value}: unknown learner option {key!r}; valid: "
                + "; ".join(f"{k}={v}" for k, v in LEARNER_OPTIONS.items()))
        choices = {"learner_mask": MASK_CONVENTIONS, "learner_fused": FUSED_LAYOUTS,
                   "learner_layout": ("batch_first", "seq_first")}.get(key)
        if choices and value not in choices:
            raise ImplementationError(f"--impl-option {key}={value}: bad value; expected one of {list(choices)}")
        names = [n.strip() for n in value.split(",") if n.strip()]
        if key == "learner_projections" and len(names) not in (2, 4):
            raise ImplementationError(
                f"--impl-option {key}={value}: expected 4 names (q, k, v, o Linear layers) or 2 (the "
                "fused q, k, v Linear and the output Linear), comma-separated")
        if key == "learner_init" and len(names) != 2:
            raise ImplementationError(
                f"--impl-option {key}={value}: expected the names of the model-dim and head-count "
                "constructor parameters, e.g. learner_init=d_model,n_heads")
        if key == "learner_config" and any("=" not in n for n in names):
            raise ImplementationError(
                f"--impl-option {key}={value}: expected NAME=VALUE pairs, comma-separated, e.g. "
                "learner_config=block_size=32,bias=false")
    return learner, rest


@contextlib.contextmanager
def learner_options(options: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """While open, :func:`recognise_learner` reads ``options`` (the registry opens it
    around resolving ``--impl``); the yielded dict gets ``"_used"`` once they are read."""
    held = dict(options)
    token = _OPTIONS.set(held)
    try:
        yield held
    finally:
        _OPTIONS.reset(token)

