"""The sharded level's strategies: inside the declared claims, world size shrinking to 1."""

from __future__ import annotations

from hypothesis import find, given, settings
from hypothesis import strategies as st

from conformance.sharded.strategies import sharded_cases, sharded_directed
from implementations.builtins.distributed._sharded_common import sharded_capabilities
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
    assert case.padded_length % sharding.divisor(case.layout, case.world_size) == 0
    assert case.features() <= caps.sharded_features
    assert case.N % case.K == 0
    if caps.sharded_heads_divisible:
        assert case.N % case.world_size == 0 and case.K % case.world_size == 0
    assert not sharding_reasons(caps, case)


def sharding_reasons(caps, case):
    from implementations.builtins.distributed.ring_attention import make_implementation

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


FEATURES = RING  # the built-ins declare both window and padding


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_window_and_padding_are_drawn_only_where_declared(data):
    caps = data.draw(st.sampled_from([RING.replace(sharded_features=frozenset()), FEATURES,
                                      ULYSSES.replace(sharded_features=frozenset({"padding"}))]))
    case = data.draw(sharded_cases(dtype="float64", device="cpu", caps=caps))
    assert case.features() <= caps.sharded_features
    assert case.L >= 1 and case.padded_length % sharding.divisor(case.layout, case.world_size) == 0
    assert case.padded_length - case.L < sharding.divisor(case.layout, case.world_size)
    assert all(-1 <= side <= case.L for side in case.window)
    assert not sharding_reasons(caps, case)


def test_windows_and_padding_appear_and_shrink_to_the_smallest():
    window = find(sharded_cases(dtype="float64", device="cpu", caps=FEATURES), lambda c: c.window != (-1, -1),
                  settings=settings(max_examples=300, database=None))
    assert (window.world_size, window.layout, window.L, window.window) == (1, "contiguous", 1, (0, 0)), \
        window.describe()
    padded = find(sharded_cases(dtype="float64", device="cpu", caps=FEATURES), lambda c: c.padded,
                  settings=settings(max_examples=300, database=None))
    # the smallest sequence that needs padding: one position, zigzag at world size 1 (2 chunks)
    assert (padded.world_size, padded.layout, padded.L, padded.padded_length) == (1, "zigzag", 1, 2)


def test_a_window_or_padding_outside_the_declaration_is_outside_the_claims():
    from conformance.sharded.strategies import make_case

    case = make_case(world_size=2, layout="contiguous", shard=2, pad=1, window=(1, 0))
    assert case.features() == {"window", "padding"}
    reasons = sharding_reasons(RING.replace(sharded_features=frozenset({"padding"})), case)
    assert reasons == ["sharded features not supported: ['window'] (declare sharded_features)"]


def test_directed_cases_put_window_edges_across_shards_and_pad_a_whole_rank():
    cases = sharded_directed(dtype="float64", device="cpu", caps=FEATURES)
    windows = [c for c in cases if c.window != (-1, -1)]
    assert {(c.layout, c.causal) for c in windows} == {(layout, causal) for layout in ("contiguous", "zigzag")
                                                      for causal in (True, False)}
    # two positions per rank and chunk, the window one key back and one forward: its edges
    # fall inside every shard and across every boundary
    assert all(c.world_size == 4 and c.window == (1, 1) and c.L == 2 * sharding.divisor(c.layout, 4)
               for c in windows)
    padded = [c for c in cases if c.padded]
    assert len(padded) == 1
    last = sharding.positions(padded[0].padded_length, padded[0].world_size, padded[0].world_size - 1,
                              padded[0].layout)
    assert (last >= padded[0].L).all(), "the last rank holds padding only"
    bare = RING.replace(sharded_features=frozenset())
    assert not [c for c in sharded_directed(dtype="float64", device="cpu", caps=bare) if c.features()]
