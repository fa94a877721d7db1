"""What an implementation claims, in words: ``describe(impl)`` and the ``--impl=list`` table."""

from __future__ import annotations

from implementations.base import (
    ALL_MHA_FEATURES,
    VARLEN_LEVELS,
    Capabilities,
    Implementation,
)
from implementations.flash_from_sdpa import derive_flash, is_derived_flash
from implementations.registry.resolution import registered

__all__ = ["describe", "listing"]

_SHORT_DTYPES = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_LISTING_HEADER = ("name", "available", "levels", "devices", "dtypes", "masks", "causal",
                   "fully-masked", "gqa", "Ev!=E", "dropout", "grad", "inputs", "xfails")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _source(c: Capabilities, name: str) -> str:
    """``(contract)`` / ``(probed)`` after a semantic value not declared ("" if declared)."""
    source = c.source(name)
    return "" if source == "declared" else f"({source})"


def _per_dtype(c: Capabilities) -> list[str]:
    """``autograd=no in float16 (probed)`` for each capability that differs in a dtype."""
    parts = []
    for dtype, values in c.by_dtype:
        for name, value in values:
            shown = ",".join(sorted(value)) if name == "mask_kinds" else _yes(value)
            parts.append(f"{name}={shown} in {dtype} (probed)")
    return parts


def _caps_line(c: Capabilities, level: str) -> str:
    parts = [
        f"devices={','.join(c.devices)}",
        f"dtypes={','.join(c.dtypes)}",
        f"masks={','.join(sorted(c.mask_kinds))}",
        f"causal={c.causal or 'no'}{_source(c, 'causal')}",
        f"fully_masked={c.fully_masked_text()}{_source(c, 'fully_masked')}",
    ]
    if level == "sdpa":
        parts += [f"Ev!=E={_yes(c.different_v_dim)}", f"gqa={_yes(c.gqa)}"]
        parts += _input_conventions(c)
    else:
        parts += [f"weights={_yes('need_weights' in c.mha_features)}"]
    parts += [
        f"dropout={_yes(c.dropout)}", f"scale={_yes(c.custom_scale)}",
        f"autograd={_yes(c.autograd)}", f"mask_grad={_yes(c.mask_grad)}",
        f"non_contiguous={_yes(c.non_contiguous)}",
    ]
    for bound in ("min_head_dim", "max_head_dim", "max_seq_len"):
        if getattr(c, bound) is not None:
            parts.append(f"{bound}={getattr(c, bound)}")
    if level == "mha":
        missing = sorted(ALL_MHA_FEATURES - set(c.mha_features))
        parts.append(f"mha_features=all but {missing}" if missing else "mha_features=all")
    return " ".join(parts + _per_dtype(c))


def _input_conventions(c: Capabilities) -> list[str]:
    """The SDPA input declarations that differ from torch's convention."""
    parts = []
    if c.self_attention_lengths:
        parts.append("self_attention_lengths=yes (L == S only)")
    if c.shared_kv:
        parts.append("shared_kv=yes (key is value)")
    if c.batch_dims is not None:
        parts.append(f"batch_dims={c.batch_dims} (exactly (B, N, L, E))")
    return parts


def describe(impl: Implementation) -> str:
    """Several lines: name, version, availability, description, capabilities per level,
    expected failures."""
    status = "available" if impl.available else f"UNAVAILABLE: {impl.unavailable_reason}"
    lines = [f"{impl.name} ({impl.version}) - {status}"]
    if impl.description:
        lines.append(f"  {impl.description}")
    if impl.sdpa is not None:
        sinks = " sinks=yes" if impl.caps("sdpa").sdpa_sinks else ""
        lines.append(f"  SDPA level: {_caps_line(impl.caps('sdpa'), 'sdpa')}{sinks}")
    if impl.mha is not None:
        lines.append(f"  MHA level: {_caps_line(impl.caps('mha'), 'mha')}")
    if impl.flash is not None:
        c = impl.caps("flash")
        derived = " (derived from the SDPA level through masks)" if is_derived_flash(impl) else ""
        lines.append(f"  flash level{derived}: {_caps_line(c, 'sdpa')} "
                     f"flash_features={','.join(sorted(c.flash_features)) or 'none'}{_source(c, 'flash_features')}"
                     + (f" fp8={','.join(c.fp8_dtypes)}" if c.fp8_dtypes else ""))
        lines += [f"  flash probe note: {note}" for note in c.probe_notes
                  if impl.flash_capabilities is not None and note not in impl.capabilities.probe_notes]
    for level in VARLEN_LEVELS:  # varlen / kvcache
        if getattr(impl, level) is not None:
            c = impl.caps(level)
            features = getattr(c, f"{level}_features")
            lines.append(f"  {level} level: {_caps_line(c, 'sdpa')} kv_paged={_yes(c.kv_paged)} "
                         f"kv_append={_yes(c.kv_append)} {level}_features={','.join(sorted(features)) or 'none'}"
                         + (f" rotary_dim_multiple={c.rotary_dim_multiple}"
                            if level == "kvcache" and c.rotary_dim_multiple else ""))
    for entry in impl.expected_failures:
        match = f" {dict(entry.match)}" if entry.match else ""
        ref = f" [{entry.reference}]" if entry.reference else ""
        kind = " (intermittent)" if entry.intermittent else ""
        lines.append(f"  expected failure{kind}: {entry.property}{match}: {entry.reason}{ref}")
    for note in impl.capabilities.probe_notes:
        lines.append(f"  probe note: {note}")
    if any(c.sources for c in (impl.capabilities, impl.caps("mha"), impl.caps("flash"))):
        lines.append("  (contract): the signature's documented meaning, tested whatever a probe saw; "
                     "(probed): read off the implementation where the contract leaves it open, not a "
                     "declaration; unmarked values are declared")
    return "\n".join(lines)


def _listing_row(name: str, impl: Implementation) -> tuple[str, ...]:
    levels = "+".join(("derived-flash" if lvl == "flash" and is_derived_flash(impl) else lvl)
                      for lvl in ("sdpa", "mha", "flash", *VARLEN_LEVELS) if getattr(impl, lvl) is not None)
    c = impl.caps("sdpa" if impl.sdpa is not None else "mha")
    return (
        name, _yes(impl.available), levels or "-", ",".join(c.devices),
        ",".join(_SHORT_DTYPES[d] for d in c.dtypes), ",".join(sorted(c.mask_kinds - {"none"})) or "-",
        (c.causal or "-") + _source(c, "causal"), c.fully_masked_text() + _source(c, "fully_masked"),
        _yes(c.gqa) if impl.sdpa is not None else "-",
        _yes(c.different_v_dim) if impl.sdpa is not None else "-",
        _yes(c.dropout), _yes(c.autograd), _inputs_cell(c) if impl.sdpa is not None else "-",
        str(len(impl.expected_failures)),
    )


def _inputs_cell(c: Capabilities) -> str:
    """``any``, or the input declarations: ``L=S``, ``k=v``, ``4-D``."""
    marks = [mark for mark, on in (("L=S", c.self_attention_lengths), ("k=v", c.shared_kv),
                                   ("4-D", c.batch_dims == 1)) if on]
    return ",".join(marks) or "any"


def listing() -> str:
    """A table of every listed built-in (for ``--impl=list``), unavailable ones with why;
    each with the flash level ``resolve`` derives from its SDPA level (``derived-flash``)."""
    rows, notes = [], []
    for name, build in registered().items():
        impl = derive_flash(build())
        if not impl.listed:
            continue
        rows.append(_listing_row(name, impl))
        if not impl.available:
            notes.append(f"  {name}: {impl.unavailable_reason}")
        elif impl.description:
            notes.append(f"  {name}: {impl.description}")
    widths = [max(len(str(r[i])) for r in [_LISTING_HEADER, *rows]) for i in range(len(_LISTING_HEADER))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*_LISTING_HEADER), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    legend = ("derived-flash: flash_attn_func through the SDPA callable (causal and window_size as an "
              "attend mask, alibi_slopes as an additive mask; no softcap, no LSE), so a failure there is "
              "an SDPA mask bug; --impl-option derived_flash=false turns it off")
    return "\n".join(lines + ["", "notes:", *notes, f"  {legend}"])
