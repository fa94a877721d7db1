"""An FP8 kvcache call (``KVCacheCase.fp8`` with descales) is saved, described, rebuilt
and replayed as made: the format and the descales travel with the case, the call hands
them over, and the rebuilt call tells the reference (agrees) from the FP8 mutant."""

from __future__ import annotations

import numpy as np
import pytest

import spec
from conformance.calls.call_specs import CallLog
from conformance.core.registry import registered_properties
from conformance.core.target import Target
from conformance.reporting import failures
from implementations.registry import resolve


def _fp8_kvcache_case():
    from conformance.calls.kvcache import KVCacheCase

    rng = np.random.default_rng(8)
    fmt = "float8_e4m3fn"
    q, k_cache, v_cache, k_new, v_new = (spec.fp8.quantize(rng.standard_normal(s) * 4, fmt) for s in
                                         ((2, 1, 2, 3), (2, 4, 1, 3), (2, 4, 1, 2), (2, 1, 1, 3), (2, 1, 1, 2)))
    return KVCacheCase(q, k_cache, v_cache, cache_seqlens=(1, 2), k_new=k_new, v_new=v_new, causal=True,
                       page_size=2, page_order=(3, 0, 4, 1, 2), fp8=fmt, q_descale=np.array([[0.5], [2.0]]),
                       k_descale=np.array([[0.25], [4.0]]), v_descale=np.array([3.0]))


@pytest.mark.parametrize("paged", [False, True])
def test_an_fp8_kvcache_call_round_trips(tmp_path, paged):
    from conformance.calls.kvcache import KVCacheCallSpec, report_kvcache_call, run_kvcache, validate

    case = _fp8_kvcache_case()
    validate(case)
    target = Target(resolve("varlen-reference"), "kvcache", "float64", "cpu", log=CallLog())
    run_kvcache(target, case, paged=paged)
    [call] = target.log.calls
    assert call.attrs()["fp8"] == "float8_e4m3fn" and "fp8" in call.attrs()["kvcache_features"]
    assert call.attrs()["descale_forms"] == {"per_head", "per_tensor"}
    path = failures.save_case(case, tmp_path / "kv.npz", call=call, property="kvcache_fp8_agreement",
                              target="kvcache-float64-cpu")
    loaded, meta = failures.load_case(path)
    assert loaded.describe() == case.describe() and "q/k/v=float8_e4m3fn" in loaded.describe()
    failures.validate_saved(loaded, meta, registered_properties())
    back = failures.load_call(path)
    assert isinstance(back, KVCacheCallSpec) and back.paged is paged and back.attrs() == call.attrs()
    for name in ("q_descale", "k_descale", "v_descale"):
        assert np.array_equal(getattr(back.case, name), getattr(case, name)), name
    assert not report_kvcache_call(target.impl, back).shows_failure
    assert report_kvcache_call(resolve("mutant:kvcache_fp8_new_keys_undescaled"), back).shows_failure


def test_a_case_with_values_outside_the_format_is_invalid():
    from conformance.calls.kvcache import validate

    case = _fp8_kvcache_case()
    with pytest.raises(ValueError, match="k_new holds values that are not float8_e4m3fn values"):
        validate(case.replace(k_new=case.k_new + 1 / 3))
