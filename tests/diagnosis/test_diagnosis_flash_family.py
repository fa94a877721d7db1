"""The diagnosis at the flash, varlen and kvcache levels, through the runner's own calls
(``calls.flash.run_flash``, ``calls.varlen``, ``calls.kvcache.run_kvcache``, observed in
``core.observe``) and ``diagnosis.diagnose``: on each bug-zoo mutant's smallest case the
variant of its record (``expected_cause``) is named, confirmed; on the calls of the correct
built-ins (``flash-ref``, ``varlen-reference``), float64 and float32, nothing is fitted.
Fast: no conformance run (``test_diagnosis_mutants.py`` runs the certificates).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conformance.calls.flash import FlashCase, run_flash
from conformance.calls.kvcache import KVCacheCase, run_kvcache
from conformance.calls.varlen import VarlenCase, run_varlen, run_varlen_lse
from conformance.core.observe import _EXAMPLE
from conformance.core.target import Target
from conformance.diagnosis.diagnose import _diagnose_call, diagnose, start_example
from implementations.mutants import MUTANTS
from spec import variants as V
from spec.emulate import round_to

FAMILY = sorted(name for name, m in MUTANTS.items()
                if m.expected_cause and m.level in V.FLASH_FAMILY and not name.startswith("triton_"))


def _f32(values):
    return None if values is None else np.asarray(values, dtype=np.float32).astype(np.float64)


def flash_case(record: dict, rng: np.random.Generator, dtype: str = "float64") -> FlashCase:
    B, N, K, L, S, E, Ev = (record.get(d, 1) for d in ("B", "N", "K", "L", "S", "E", "Ev"))
    q, k, v = (round_to(rng.standard_normal(s), dtype) for s in ((B, L, N, E), (B, S, K, E), (B, S, K, Ev)))
    return FlashCase(q, k, v, causal=bool(record.get("causal")), window=tuple(record.get("window", (-1, -1))),
                     softcap=float(record.get("softcap", 0.0)), alibi_slopes=_f32(record.get("alibi")),
                     sinks=_f32(record.get("sinks")), dtype=dtype)


def varlen_case(record: dict, rng: np.random.Generator, dtype: str = "float64") -> VarlenCase:
    lengths = record["lengths"]
    cu_q = tuple(int(x) for x in np.cumsum([0] + [L for L, _ in lengths]))
    cu_k = tuple(int(x) for x in np.cumsum([0] + [S for _, S in lengths]))
    q = round_to(rng.standard_normal((cu_q[-1], record["N"], record["E"])), dtype)
    k = round_to(rng.standard_normal((cu_k[-1], record["K"], record["E"])), dtype)
    v = round_to(rng.standard_normal((cu_k[-1], record["K"], record["Ev"])), dtype)
    return VarlenCase(q, k, v, cu_q, cu_k, causal=bool(record.get("causal")), dtype=dtype,
                      window=tuple(record.get("window", (-1, -1))), softcap=float(record.get("softcap", 0.0)),
                      alibi_slopes=_f32(record.get("alibi")))


def kvcache_case(record: dict, rng: np.random.Generator, dtype: str = "float64") -> KVCacheCase:
    seqlens = tuple(record["cache_seqlens"])
    B, L, N, K, E, Ev, new = len(seqlens), record["L"], record["N"], record["K"], record["E"], record["Ev"], \
        record["S_new"]
    S_cache, rows = record["S_cache"], record.get("B_cache", B)
    q = rng.standard_normal((B, L, N, E))
    k_cache, v_cache = rng.standard_normal((rows, S_cache, K, E)), rng.standard_normal((rows, S_cache, K, Ev))
    if record.get("values") == "huge":  # q = 30, keys ±30: logits beyond float64's exp range
        q = np.full(q.shape, 30.0)
        k_cache = np.where(np.arange(k_cache.size).reshape(k_cache.shape) % 3 == 1, -30.0, 30.0)
    options: dict = {}
    if record.get("page_size"):
        table = np.asarray(record["block_table"]).reshape(-1)
        spare = [page for page in range(record["num_pages"]) if page not in table]
        options.update(page_size=record["page_size"], page_order=tuple(int(x) for x in (*table, *spare)))
    if record.get("rotary_dim"):
        angle = rng.uniform(0, 2 * np.pi, (S_cache + L + 2, record["rotary_dim"] // 2))
        options.update(rotary_cos=round_to(np.cos(angle), dtype), rotary_sin=round_to(np.sin(angle), dtype),
                       rotary_interleaved=bool(record.get("rotary_interleaved", True)))
    for name in ("cache_batch_idx", "cache_leftpad"):
        if record.get(name) is not None:
            options[name] = tuple(record[name])
    if record.get("num_splits") is not None:
        options["num_splits"] = int(record["num_splits"])
    k_new = round_to(rng.standard_normal((B, new, K, E)), dtype) if new else None
    v_new = round_to(rng.standard_normal((B, new, K, Ev)), dtype) if new else None
    return KVCacheCase(round_to(q, dtype), round_to(k_cache, dtype), round_to(v_cache, dtype), seqlens, k_new=k_new,
                       v_new=v_new, causal=bool(record.get("causal")), window=tuple(record.get("window", (-1, -1))),
                       softcap=float(record.get("softcap", 0.0)), alibi_slopes=_f32(record.get("alibi")), dtype=dtype,
                       **options)


def call(target: Target, case, lse: bool) -> None:
    """The call a property makes of ``case`` (observed), with the LSE when ``lse``."""
    if target.level == "flash":
        run_flash(target, case, lse=lse)
    elif target.level == "varlen":
        (run_varlen_lse if lse else run_varlen)(target, case)
    else:
        run_kvcache(target, case, lse=lse)


BUILD = {"flash": flash_case, "varlen": varlen_case, "kvcache": kvcache_case}


@pytest.mark.parametrize("name", FAMILY)
def test_the_diagnosis_names_the_mutants_bug_on_its_smallest_case(name):
    mutant = MUTANTS[name]
    target = Target(mutant.build(), mutant.level, "float64", "cpu")
    case = BUILD[mutant.level](mutant.smallest_case, np.random.default_rng(3))
    start_example(case)
    call(target, case, lse=bool(mutant.smallest_case.get("lse")))
    verdict = diagnose(target, SimpleNamespace(failing_case=case, property=mutant.expected_property,
                                               failing_calls=()))
    assert verdict.causes and verdict.causes[0]["variant"] == mutant.expected_cause, verdict.line
    assert verdict.causes[0]["confirmed"], verdict.line
    assert verdict.line.startswith(f"probable cause: {mutant.expected_cause} — "), verdict.line


def _random_record(level: str, rng: np.random.Generator) -> dict:
    """A random call in the records' vocabulary, every option of the level drawn half the time."""
    sizes = {"N": 2, "K": int(rng.choice([1, 2])), "E": 2 * int(rng.integers(1, 3)), "Ev": int(rng.integers(1, 4))}
    options = {}
    if rng.integers(2):
        options["window"] = [int(rng.integers(-1, 3)), int(rng.integers(-1, 3))]
    if rng.integers(2):
        options["softcap"] = float(rng.choice([0.5, 5.0]))
    if rng.integers(2):
        options["alibi"] = [0.5, -0.25]
    options["causal"] = bool(rng.integers(2))
    if level == "flash":
        if rng.integers(2):
            options["sinks"] = [0.5, -1.0]
        return {**sizes, "B": int(rng.integers(1, 3)), "L": int(rng.integers(1, 5)), "S": int(rng.integers(1, 6)),
                "lse": bool(rng.integers(2)), **options}
    if level == "varlen":
        return {**sizes, "lengths": [(int(rng.integers(0, 4)), int(rng.integers(0, 5))) for _ in range(3)],
                "lse": bool(rng.integers(2)), **options}
    new = int(rng.integers(0, 3))
    S_cache = int(rng.integers(new + 2, 7))
    record = {**sizes, "L": int(rng.integers(1, 4)), "S_new": new, "S_cache": S_cache, "B_cache": 3,
              "cache_seqlens": [int(rng.integers(0, S_cache - new + 1)) for _ in range(2)], "lse": True, **options}
    record["cache_batch_idx"] = [int(x) for x in rng.permutation(3)[:2]]
    record["cache_leftpad"] = [int(rng.integers(0, n + 1)) for n in record["cache_seqlens"]]
    if new and rng.integers(2):
        record.update(rotary_dim=2, rotary_interleaved=bool(rng.integers(2)))
    if rng.integers(2):
        record["num_splits"] = int(rng.integers(1, 4))
    return record


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("level, builtin", [("flash", "flash-ref"), ("varlen", "varlen-reference"),
                                            ("kvcache", "varlen-reference")])
def test_no_variant_is_fitted_to_a_correct_builtins_calls(level, builtin, dtype):
    """A correct call is within the level's rule of the oracle (the diagnosis finds it right),
    and ``rank`` names no variant on it, on 25 random calls with every option of the level."""
    from implementations.registry import resolve

    target = Target(resolve(builtin), level, dtype, "cpu")
    rng = np.random.default_rng(["float64", "float32"].index(dtype) * 10 + V.FLASH_FAMILY.index(level))
    for i in range(25):
        record = _random_record(level, rng)
        case = BUILD[level](record, rng, dtype)
        start_example(case)
        call(target, case, lse=bool(record.get("lse")))
        observed = _EXAMPLE.get().calls[-1]
        assert _diagnose_call(target, observed) is False, (i, case)
