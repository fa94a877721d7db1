"""The learner level: certify a hand-written multi-head attention module with no adapter.

A tutorial's module is never an ``nn.MultiheadAttention`` drop-in: its constructor is
``(d_model, num_heads)`` (or ``(h, d_model)``, with ``dropout=``), its projections are four
``nn.Linear`` (``w_q/w_k/w_v/w_o``, ``q_proj/..``, ``linears``) or one fused ``qkv`` Linear,
its ``forward`` is ``(x, mask=None)``, ``(query, key, value, mask=None)`` or ``(q, kv,
mask=None)`` on batch-first ``(B, L, D)`` inputs, its mask is 1 = keep, True = blocked
or additive in one of several shapes, and it returns the output or ``(output, weights)``.
:func:`recognise_learner` reads such a class and returns an MHA-level
:class:`~implementations.base.Implementation` whose factory wraps the module in
nn.MultiheadAttention's interface (:class:`LearnerMHA`) and whose ``load_weights`` maps
``spec.MHAParams`` onto the module's own Linear layers, so every MHA-level property
runs on it.

What is *read* (``docs/LEARNER.md``): the constructor (model dim and head count, or one
config object: :mod:`.construct`), the projections by dataflow (one observed call: which
layer reads which input, which gives the output: :mod:`.dataflow`), the forward's inputs
bound by name or position, its mask argument, dropout, a causal rule in the code.
What is *probed*, each a convention the module may choose and never its behaviour:

* the mask convention (1 = keep, True = blocked, additive) and which shapes it accepts:
  every query row of a batch item is left exactly one key; a convention is accepted when
  that makes the rows of each batch item equal (a single attended key gives every row
  that key's value, whatever the scale, the head layout or the softmax's numerics), a
  property that the classic mistakes (scale by d_model, heads split without a transpose)
  do not change and that a wrong polarity breaks;
* the fused projection's head layout (q, k, v blocks or per-head q, k, v): each candidate
  is accepted only when the module matches ``spec.mha_forward`` exactly with it (float64,
  no mask), else the block layout is assumed and said so;
* whether weights are returned, per head or averaged; whether dropout can be switched on;
  what a row with every key blocked gives (zero, NaN, uniform).

Where a convention cannot be told apart from a bug (a fused projection cut k, q, v; four
anonymous Linear layers in another order) the common one is assumed, the certificate says
so, and ``--impl-option`` overrides it (:data:`LEARNER_OPTIONS`).
"""

from implementations.registry.learner.options import (
    LEARNER_OPTIONS,
    learner_options,
    split_learner_options,
)
from implementations.registry.learner.plan import LearnerPlan
from implementations.registry.learner.reading import is_learner_candidate
from implementations.registry.learner.recognise import recognise_learner
from implementations.registry.learner.wrapper import LearnerMHA

__all__ = [
    "LEARNER_OPTIONS",
    "LearnerMHA",
    "LearnerPlan",
    "is_learner_candidate",
    "learner_options",
    "recognise_learner",
    "split_learner_options",
]
