"""The bug zoo: implementations with exactly one documented bug each.

``MUTANTS[name]`` is a :class:`Mutant` record (bug, origin, smallest exposing case,
the property expected to catch it) whose ``build()`` returns an ``Implementation``
named ``mutant:<name>`` (``listed=False``); the registry resolves
``--impl=mutant:NAME`` through it. A conformance suite worth its name fails every
one of them (``tests/test_mutants.py``, ``benchmarks/mutation_score.py``).

Mutants are small subclasses of correct bases in :mod:`._base` (straight-line SDPA,
manual-backward SDPA, tiled online-softmax SDPA, hand-written MHA), each overriding
one step; their capabilities are honest about everything except their bug. The bases
themselves are importable as implementations from :mod:`.controls` and must pass the
suite; :mod:`.cases` turns a record's ``smallest_case`` into a concrete call.

Modules: :mod:`.sdpa_mutants`, :mod:`.tiled_mutants`, :mod:`.mha_mutants`,
:mod:`.triton_mutants` (the known-bug classes and classic mistakes);
:mod:`.property_mutants` (one mutant for each property no other mutant names, so
every property is shown to fail on its own); :mod:`.real_code_mutants` (bugs
modelled on real libraries, named in their ``origin``); :mod:`.size_mutants`
(bugs that live at one (L, S) size); :mod:`.flash_mutants` (``flash_attn_func`` with
one step wrong, one per flash-level property); :mod:`.sdpa_sink_mutants` (learned sinks
at the SDPA level); :mod:`.flash_extra_mutants` (its FP8
inputs and its dropout); :mod:`.varlen_mutants` (packed-sequence
and KV-cache bugs, at the varlen and kvcache levels); :mod:`.cache_option_mutants`
(FlashAttention's options there: window, softcap, LSE); :mod:`.cache_feature_mutants`
(the KV cache's own options: rotary, cache_batch_idx, cache_leftpad, split-KV);
:mod:`.contract_mutants` (bare
functions resolved through recognition and probing, whose bug a behaviour-driven probe
used to turn into a declaration; its ``CONTRACT_CONTROLS`` declare a non-default
convention and must pass); :mod:`.learner_mutants` (hand-written modules with no adapter,
each with a classic tutorial mistake, probed through the learner level);
:mod:`.sharded_mutants` (context-parallel ring and all-to-all attention with one step
wrong, at the sharded level); :mod:`.dropout_mutants` (dropout that keeps the
expectation and gets the spread wrong: ignored, one mask for the batch, on the output);
:mod:`.long_block_mutants` (bugs past the first block of 128 of a GPU kernel, for
``long_sizes_sweep``).
"""

from __future__ import annotations

from implementations.mutants.varlen.cache_feature_mutants import CACHE_FEATURE_MUTANTS
from implementations.mutants.varlen.cache_option_mutants import CACHE_OPTION_MUTANTS
from implementations.mutants.sdpa.contract_mutants import CONTRACT_MUTANTS
from implementations.mutants.flash.dropout_mutants import DROPOUT_MUTANTS
from implementations.mutants.flash.flash_extra_mutants import FLASH_EXTRA_MUTANTS
from implementations.mutants.flash.flash_mutants import FLASH_MUTANTS
from implementations.mutants.mha.learner_mutants import LEARNER_MUTANTS
from implementations.mutants.sdpa.long_block_mutants import LONG_BLOCK_MUTANTS
from implementations.mutants.mha.mha_mutants import MHA_MUTANTS
from implementations.mutants.sdpa.property_mutants import PROPERTY_MUTANTS
from implementations.mutants.sdpa.real_code_mutants import REAL_CODE_MUTANTS
from implementations.mutants.record import Mutant
from implementations.mutants.sdpa.sdpa_mutants import SDPA_MUTANTS
from implementations.mutants.sdpa.sdpa_sink_mutants import SDPA_SINK_MUTANTS
from implementations.mutants.sharded.sharded_mutants import SHARDED_MUTANTS
from implementations.mutants.sdpa.size_mutants import SIZE_MUTANTS
from implementations.mutants.sdpa.tiled_mutants import TILED_MUTANTS
from implementations.mutants.sdpa.triton_mutants import TRITON_MUTANTS
from implementations.mutants.varlen.varlen_mutants import VARLEN_MUTANTS

__all__ = ["MUTANTS", "Mutant"]

MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (*SDPA_MUTANTS, *TILED_MUTANTS, *MHA_MUTANTS, *TRITON_MUTANTS,
              *PROPERTY_MUTANTS, *REAL_CODE_MUTANTS, *SIZE_MUTANTS, *SDPA_SINK_MUTANTS, *FLASH_MUTANTS,
              *FLASH_EXTRA_MUTANTS, *VARLEN_MUTANTS, *CACHE_OPTION_MUTANTS, *CACHE_FEATURE_MUTANTS,
              *DROPOUT_MUTANTS, *LONG_BLOCK_MUTANTS,
              *CONTRACT_MUTANTS, *LEARNER_MUTANTS, *SHARDED_MUTANTS)
}
