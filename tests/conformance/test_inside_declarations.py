"""Every case the suite hands over is inside the target's declarations (conformance.calls.declarations):
random draws, directed examples and the cases properties derive from them, at every level,
for restrictive declarations (what real kernels declare: tensor-core head dims, short
sequences, self-attention only, no GQA, bool masks only...)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conformance.core.cases import SDPACase
from conformance.core.compare import PropertyFailure
from conformance.calls.declarations import (
    OutsideDeclarations,
    fit_head_dims,
    fit_lengths,
    outside_declarations,
    require_inside,
)
from conformance.calls.flash import FlashCallSpec, FlashCase, run_flash
from conformance.calls.replay import CallLog, SDPACallSpec
from conformance.core.registry import registered_checks, registered_properties, skip_reasons
from conformance.core.target import Target
from conformance.strategies.flash import flash_cases
from conformance.calls.varlen import VarlenCase
from implementations import registry
from implementations.base import Capabilities, Implementation
from implementations.flash_from_sdpa import derive_flash

#: Restrictive declarations, each what some real kernel declares.
DECLARATIONS = {
    "min_head_dim=16": dict(min_head_dim=16),
    "head dims 64..128": dict(min_head_dim=64, max_head_dim=128),
    "max_seq_len=4": dict(max_seq_len=4),
    "self-attention lengths": dict(self_attention_lengths=True),
    "no GQA, no Ev != E": dict(gqa=False, different_v_dim=False),
    "bool masks, no custom scale": dict(mask_kinds=frozenset({"none", "bool"}), custom_scale=False),
    "no causal flag, contiguous only": dict(causal=None, non_contiguous=False),
    "4-D only, no autograd, window only, no paged cache or append": dict(
        batch_dims=1, autograd=False, flash_features=frozenset({"window"}), kv_paged=False, kv_append=False),
    # Partial support as declarations: a set of head dims, lengths a multiple of a block,
    # a positive scale only.
    "head dims in {8, 16}": dict(head_dims=(8, 16)),
    "lengths a multiple of 4": dict(seq_multiple=4),
    "positive scale only": dict(positive_scale=True),
    "causal only": dict(causal_only=True, mask_kinds=frozenset({"none"})),
}
#: (level, the built-in it is checked on); "flash-derived": the flash level derived from SDPA.
LEVELS = [("sdpa", "sdpa"), ("flash-derived", "sdpa"), ("flash", "flash-ref"), ("mha", "torch-mha"),
          ("varlen", "varlen-reference"), ("kvcache", "varlen-reference")]
#: Random draws per property and declaration (derandomized), besides every directed case.
DRAWS = 3


def _impl(level: str, builtin: str, changes: dict) -> Implementation:
    base = registry.resolve(builtin)
    if level in ("sdpa", "flash-derived"):
        base = dataclasses.replace(base, flash=None, flash_capabilities=None)
        return derive_flash(dataclasses.replace(base, capabilities=base.caps("sdpa").replace(**changes)))
    at = "mha" if level == "mha" else "flash" if level == "flash" else "sdpa"
    caps = base.caps(at)
    return dataclasses.replace(base, capabilities=caps.replace(**changes), mha_capabilities=None,
                               flash_capabilities=None)


def _draws(strategy, n: int) -> list:
    got: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(st.data())
    def draw(data):
        got.append(data.draw(strategy))

    draw()
    return got


@pytest.mark.parametrize("declaration", list(DECLARATIONS))
@pytest.mark.parametrize("level, builtin", LEVELS, ids=[level for level, _ in LEVELS])
def test_every_case_and_every_call_is_inside_the_declarations(level, builtin, declaration):
    """Each property's directed cases and random draws are inside; checking each of them
    makes no call outside (the cases it derives: more batch, padded, split keys, V = I...)."""
    if declaration == "lengths a multiple of 4" and level in ("varlen", "kvcache"):
        pytest.skip("seq_multiple bounds L and S of the sdpa, mha and flash levels (a packed or cached "
                    "kernel's lengths are per sequence and per cache)")
    impl = _impl(level, builtin, DECLARATIONS[declaration])
    at = "flash" if level.startswith("flash") else level
    if declaration == "causal only" and level == "flash-derived":
        assert impl.flash is None  # an upper-left causal-only SDPA has no flash level derived
        return
    target = Target(impl, at, impl.caps(at).dtypes[0], "cpu")
    checks = registered_checks()
    outside, ran = [], 0
    for pid, info in registered_properties().items():
        if info.level != at or info.sweep is not None or skip_reasons(info, target):
            continue
        cases = [("directed", c) for c in (info.directed(target) if info.directed else [])]
        cases += [("random", c) for c in _draws(info.cases(target), DRAWS)]
        for source, case in cases:
            reasons = outside_declarations(target, case)
            if reasons:
                outside.append(f"{pid} {source} case {case.describe()}: {reasons}")
                continue
            ran += 1
            try:
                checks[pid](dataclasses.replace(target, log=CallLog()), case)
            except OutsideDeclarations as exc:
                outside.append(f"{pid} {source} case, a call it derives: {exc}")
            except PropertyFailure:
                pass  # the built-in's own (expected) failures are not this test's concern
    assert ran, "no property ran: the test checks nothing"
    assert not outside, "\n".join(outside[:10])


def test_the_sweep_stays_inside_the_declared_head_dims():
    """small_sizes_sweep calls the implementation directly: its sizes are inside too."""
    from conformance.test_sdpa_sweep import _head_dim, _layouts

    for changes in DECLARATIONS.values():
        target = Target(_impl("sdpa", "sdpa", changes), "sdpa", "float64", "cpu")
        E = _head_dim(target)
        caps = target.caps
        for layout in _layouts(target, E):
            for dim in (E, layout.Ev):
                assert (caps.min_head_dim or 1) <= dim <= (caps.max_head_dim or dim), (changes, layout)
            assert caps.different_v_dim or layout.Ev == E


# --------------------------------------------------------------------------- the checker


def _sdpa_target(**changes) -> Target:
    return Target(Implementation(name="k", sdpa=lambda *a, **k: None, capabilities=Capabilities(**changes)),
                  "sdpa", "float64", "cpu")


def _sdpa_case(L=2, S=3, E=4, Ev=4, **kw) -> SDPACase:
    rng = np.random.default_rng(0)
    return SDPACase(rng.standard_normal((1, 2, L, E)), rng.standard_normal((1, 2, S, E)),
                    rng.standard_normal((1, 2, S, Ev)), **kw)


def _flash_case(L=1, S=3, E=2, Ev=2, **kw) -> FlashCase:
    rng = np.random.default_rng(0)
    return FlashCase(rng.standard_normal((1, L, 2, E)), rng.standard_normal((1, S, 2, E)),
                     rng.standard_normal((1, S, 2, Ev)), **kw)


def test_the_checker_names_each_bound_a_case_breaks():
    t = _sdpa_target(min_head_dim=16, max_seq_len=2, gqa=False)
    assert outside_declarations(t, _sdpa_case()) == [
        "E=4 < min_head_dim=16", "Ev=4 < min_head_dim=16", "S=3 > max_seq_len=2"]
    assert outside_declarations(_sdpa_target(min_head_dim=4), _sdpa_case()) == []
    assert outside_declarations(_sdpa_target(self_attention_lengths=True), _sdpa_case()) == [
        "L=2 != S=3 but self_attention_lengths declares L == S only"]
    assert "custom scale not supported" in outside_declarations(_sdpa_target(custom_scale=False),
                                                                _sdpa_case(scale=0.5))


def test_the_checker_judges_the_call_as_made():
    """A causal constraint the declared flag does not mean is folded into a bool mask: a
    call that needs bool masks, not that flag; with the flag, the flag is what is judged."""
    case = _sdpa_case(causal="lower_right")
    folded = _sdpa_target(causal="upper_left", mask_kinds=frozenset({"none"}))
    assert outside_declarations(folded, case) == ["mask_kind='bool' not in declared ['none']"]
    assert outside_declarations(_sdpa_target(causal="upper_left"), case) == []
    flag = _sdpa_target(causal="lower_right", mask_kinds=frozenset({"none"}))
    assert outside_declarations(flag, case) == []
    # copies along the batch, shared_kv (the value handed over must be the key)
    assert outside_declarations(_sdpa_target(shared_kv=True), SDPACallSpec(_sdpa_case())) == [
        "value != key but shared_kv declares key is value"]


def test_the_checker_at_the_flash_and_varlen_levels():
    impl = Implementation(name="f", flash=lambda *a, **k: None,
                          capabilities=Capabilities(min_head_dim=16, causal="lower_right",
                                                    flash_features=frozenset({"window"}),
                                                    self_attention_lengths=True))
    target = Target(impl, "flash", "float64", "cpu")
    # main's first directed flash example: E = 2 on a min_head_dim=16 kernel
    reasons = outside_declarations(target, _flash_case())
    assert "E=2 < min_head_dim=16" in reasons and "L=1 != S=3 but self_attention_lengths declares L == S only" in reasons
    inside = _flash_case(L=3, S=3, E=16, Ev=16)
    assert outside_declarations(target, inside) == []
    assert outside_declarations(target, FlashCallSpec(inside, lse=True)) == [
        "flash features not supported: ['lse']"]
    varlen = Target(Implementation(name="v", varlen=lambda *a, **k: None,
                                   capabilities=Capabilities(self_attention_lengths=True)), "varlen", "float64", "cpu")
    rng = np.random.default_rng(0)
    packed = VarlenCase(rng.standard_normal((3, 1, 2)), rng.standard_normal((3, 1, 2)),
                        rng.standard_normal((3, 1, 2)), cu_seqlens_q=(0, 1, 3), cu_seqlens_k=(0, 2, 3))
    assert outside_declarations(varlen, packed) == [
        "sequence lengths (L, S) [(1, 2), (2, 1)] differ but self_attention_lengths declares L == S only"]


def test_a_call_outside_is_not_made_and_is_the_suites_error():
    calls = []
    impl = Implementation(name="tile", flash=lambda *a, **k: calls.append(a),
                          capabilities=Capabilities(min_head_dim=16, causal="lower_right"))
    target = Target(impl, "flash", "float64", "cpu", log=CallLog())
    with pytest.raises(OutsideDeclarations, match=r"outside tile's declarations: E=2 < min_head_dim=16.*"
                                                  r"not of the implementation"):
        run_flash(target, _flash_case())
    assert not calls and not target.log.calls
    assert not issubclass(OutsideDeclarations, PropertyFailure)  # never reported as the implementation's
    with pytest.raises(OutsideDeclarations):
        require_inside(_sdpa_target(max_seq_len=2), SDPACallSpec(_sdpa_case()))


def test_fitting_an_example_keeps_its_class_where_the_bounds_allow():
    caps = Capabilities(min_head_dim=16)
    assert fit_head_dims(caps, 2, 2) == (16, 16)
    assert fit_head_dims(caps, 2, 3) == (16, 17)          # Ev != E kept
    assert fit_head_dims(Capabilities(min_head_dim=16, max_head_dim=16), 2, 3) == (16, 16)
    assert fit_head_dims(Capabilities(min_head_dim=16, different_v_dim=False), 2, 3) == (16, 16)
    assert fit_head_dims(Capabilities(max_head_dim=8), 4, 2) == (4, 2)
    assert fit_lengths(Capabilities(max_seq_len=4), 1, 5) == (3, 4)   # L < S kept
    assert fit_lengths(Capabilities(max_seq_len=4), 6, 2) == (4, 3)   # L > S kept
    assert fit_lengths(Capabilities(self_attention_lengths=True), 1, 3) == (3, 3)
    assert fit_lengths(Capabilities(max_seq_len=1), 1, 3) is None


# --------------------------------------------------------------------------- head dims drawn


def _head_dims(caps) -> set[int]:
    cases = _draws(flash_cases(caps=caps), 60)
    return {d for c in cases for d in (c.E, c.Ev)}


def test_flash_draws_declared_head_dims_above_16_and_keeps_default_draws_small():
    dims = _head_dims(Capabilities(min_head_dim=64, max_head_dim=128, causal="lower_right"))
    assert min(dims) >= 64 and max(dims) <= 128 and len(dims) > 2
    dims = _head_dims(Capabilities(min_head_dim=128, max_head_dim=256, causal="lower_right"))
    assert min(dims) >= 128 and max(dims) <= 256 and len(dims) > 2
    assert max(_head_dims(Capabilities(causal="lower_right"))) <= 16
    dims = _head_dims(Capabilities(min_head_dim=16, causal="lower_right"))
    assert min(dims) >= 16 and len(dims) > 1                       # Ev != E still drawn


@pytest.mark.parametrize("level, builtin", LEVELS, ids=[level for level, _ in LEVELS])
def test_directed_examples_are_adapted_to_min_head_dim_not_dropped(level, builtin):
    """Head dims are incidental to every directed example's bug class: under
    min_head_dim=16 each property runs as many directed cases as without a bound."""
    at = "flash" if level.startswith("flash") else level

    def counts(changes):
        impl = _impl(level, builtin, changes)
        target = Target(impl, at, impl.caps(at).dtypes[0], "cpu")
        return {pid: len(info.directed(target)) for pid, info in registered_properties().items()
                if info.level == at and info.directed is not None and not skip_reasons(info, target)}

    plain, bounded = counts({}), counts({"min_head_dim": 16})
    assert sum(plain.values()) > 0 and bounded == plain
