"""The sharded level's strategies: inside the declared claims, world size shrinking to 1."""

from __future__ import annotations

from hypothesis import find, given, settings
from hypothesis import strategies as st

from conformance.sharded.strategies import sharded_cases, sharded_directed
from implementations.builtins._sharded_common import sharded_capabilities
from spec import sharding

RING = sharded_capabilities()
ULYSSES = sharded_capabilities(sharded_heads_divisible=True)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_cases_divide_and_respect_the_claims(data):
    caps = data.draw(st.sampled_from([RING, ULYSSES, RING.replace(sharded_layouts=frozenset({"contiguous"}),
                                                                 max_world_size=2)]))
    case = data.draw(sharded_cases(dtype="float32", device="cpu", caps=caps))
    assert 1 <= case.world_size <= caps.max_world_size
    assert case.layout in caps.sharded_layouts
    assert case.L % sharding.divisor(case.layout, case.world_size) == 0
    assert case.N % case.K == 0
    if caps.sharded_heads_divisible:
        assert case.N % case.world_size == 0 and case.K % case.world_size == 0
    assert not sharding_reasons(caps, case)


def sharding_reasons(caps, case):
    from implementations.builtins.ring_attention import make_implementation

    impl = make_implementation()
    impl = impl.__class__(**{**{f: getattr(impl, f) for f in impl.__dataclass_fields__},
                             "capabilities": caps, "sharded_capabilities": caps})
    return impl.not_supported_reasons(case.attrs())


def test_world_size_shrinks_to_one():
    case = find(sharded_cases(dtype="float64", device="cpu", caps=RING), lambda c: c.causal,
                settings=settings(max_examples=200, database=None))
    assert (case.world_size, case.shard_length, case.B, case.N) == (1, 1, 1, 1)


def test_directed_cases_put_the_causal_diagonal_across_every_shard():
    cases = sharded_directed(dtype="float64", device="cpu", caps=RING)
    causal = [(c.world_size, c.layout) for c in cases if c.causal and c.shard_length <= 2]
    assert {(w, layout) for w in (2, 3, 4) for layout in ("contiguous", "zigzag")} <= set(causal)
    assert any(c.regime == "huge" for c in cases)
