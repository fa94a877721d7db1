"""``--impl-option key=value``: override any declared or probed capability.

A value given here is the user's declaration: it wins over the signature's contract and
over whatever probing saw, holds in every dtype (``Capabilities.by_dtype`` loses that
field), and its source becomes ``declared`` (``Capabilities.sources``).

Keys are :class:`~implementations.base.Capabilities` fields, e.g. ``causal=lower_right``,
``fully_masked=nan``, ``dtypes=float32,float16``, ``gqa=false``; each value is parsed and
validated, and a bad key or value raises ImplementationError listing what is valid.

``fully_masked`` also takes a policy per kind of blocking, ``bool:uniform,additive:nan``
(kinds ``bool``, ``additive``, ``causal``; a bare policy in the list is the default of
the kinds not named, else ``zero``). ``batch_dims=1`` declares exactly 4-D inputs.

New partial-support declarations: ``head_dims=64,96,128`` (E and Ev in the set),
``seq_multiple=16`` (L and S multiples of it), ``seq_block=128`` (L and S up to 128 or
multiples of it), ``backward_seq_multiple=32`` (gradients only where L and S are multiples
of it: a limit of the backward alone), ``causal_only=true (every call causal), ``positive_scale=true`` (an explicit scale > 0 only). A key may name one level,
``mha.mask_kinds=none,bool`` (``sdpa.``, ``mha.``, ``flash.``: that level's capabilities
only), or one dtype, ``float64.mask_kinds=none,bool`` (a per-dtype field of
:data:`~implementations.base.PER_DTYPE_FIELDS` in that dtype only: a dtype x feature
exclusion).

Options are parsed before the implementation is probed (:func:`parse_options`), and the
probe calls are built inside them (:mod:`.probe_plan`). A declaration that claims what a
probe saw fail (a declared dtype whose plain call raised, a declared mask kind that
raised) is refused (:func:`apply_options`).

``dtypes`` also takes the 8-bit float formats (``dtypes=bfloat16,float8_e4m3fn``): those
go to ``fp8_dtypes`` (q, k, v in that format with descale factors at the flash level; an
FP8 call's output is 16- or 32-bit, so an 8-bit format is never a target dtype), the
others stay ``dtypes`` (a list of 8-bit formats alone leaves ``dtypes`` as it was).

``derived_flash=false`` is not a capability: it turns off the flash level the registry
derives from an SDPA callable (``implementations.flash_from_sdpa``); read it with
:func:`derived_flash_wanted`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from implementations.base import (
    ALL_DTYPES,
    ALL_FLASH_FEATURES,
    ALL_KVCACHE_FEATURES,
    ALL_VARLEN_FEATURES,
    ALL_MASK_KINDS,
    FP8_DESCALE_FORMS,
    FP8_DTYPES,
    ALL_MHA_FEATURES,
    ALL_SHARDED_FEATURES,
    CAUSAL_ALIGNMENTS,
    FULLY_MASKED_KINDS,
    FULLY_MASKED_POLICIES,
    PER_DTYPE_FIELDS,
    SEMANTIC_FIELDS,
    Capabilities,
    Implementation,
    ImplementationError,
    renamed_mha_features,
)

__all__ = ["CAPABILITY_OPTION_KEYS", "DERIVED_FLASH_OPTION", "OPTION_LEVELS", "ParsedOptions", "apply_options",
           "derived_flash_wanted", "parse_options"]

#: The levels a ``LEVEL.key=value`` option may name.
OPTION_LEVELS = ("sdpa", "mha", "flash")

#: The option that turns the derived flash level off (``derived_flash=false``).
DERIVED_FLASH_OPTION = "derived_flash"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError("use true or false")


def _parse_list(choices: tuple[str, ...] | frozenset[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise ValueError(f"a comma-separated list of {sorted(choices)}; {bad or text!r} is not")
        return items
    return parse


def _parse_choice(choices: tuple[str, ...], *, allow_none: bool = False) -> Callable[[str], str | None]:
    def parse(text: str) -> str | None:
        if allow_none and text.strip().lower() in ("none", "false", "no"):
            return None
        if text.strip() not in choices:
            raise ValueError(f"one of {list(choices) + (['none'] if allow_none else [])}")
        return text.strip()
    return parse


def _parse_optional_int(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise ValueError("a positive integer or none")
    return value


def _parse_fully_masked(text: str) -> str | dict[str, str]:
    """``nan``, or ``bool:uniform,additive:nan[,causal:...]`` with an optional bare
    default policy among the items (``uniform,additive:nan``)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    expected = (f"one of {list(FULLY_MASKED_POLICIES)}, or KIND:POLICY pairs such as "
                f"bool:uniform,additive:nan with KIND in {list(FULLY_MASKED_KINDS)}")
    if len(items) == 1 and ":" not in items[0]:
        if items[0] not in FULLY_MASKED_POLICIES:
            raise ValueError(expected)
        return items[0]
    default, per_kind = "zero", {}
    for item in items:
        kind, sep, policy = (part.strip() for part in item.partition(":"))
        if not sep:
            kind, policy = "", kind
        if policy not in FULLY_MASKED_POLICIES or (sep and kind not in FULLY_MASKED_KINDS) \
                or kind in per_kind:
            raise ValueError(f"{expected}; {item!r} is not (or names its kind twice)")
        if sep:
            per_kind[kind] = policy
        else:
            default = policy
    if not items:
        raise ValueError(expected)
    return {kind: per_kind.get(kind, default) for kind in FULLY_MASKED_KINDS}


def _parse_batch_dims(text: str) -> int | None:
    if text.strip().lower() in ("none", "any"):
        return None
    if text.strip() != "1":
        raise ValueError("1 (exactly (B, N, L, E) inputs) or none (any leading batch dims)")
    return 1


def _parse_head_dims(text: str) -> tuple[int, ...] | None:
    if text.strip().lower() in ("none", "any"):
        return None
    try:
        dims = tuple(sorted({int(item) for item in text.split(",") if item.strip()}))
    except ValueError:
        dims = ()
    if not dims or dims[0] < 1:
        raise ValueError("a comma-separated list of positive head dims such as 64,96,128, or none")
    return dims


def _parse_mha_features(text: str) -> frozenset[str]:
    renamed = renamed_mha_features(item.strip() for item in text.split(","))
    if renamed:
        raise ValueError(f"the current feature names ({renamed})")
    return frozenset(() if text.strip().lower() == "none" else _parse_list(ALL_MHA_FEATURES)(text))


def _parse_flash_features(text: str) -> frozenset[str]:
    return frozenset(() if text.strip().lower() == "none" else _parse_list(ALL_FLASH_FEATURES)(text))


def _parse_features(known: frozenset[str]) -> Callable[[str], frozenset[str]]:
    return lambda text: frozenset(() if text.strip().lower() == "none" else _parse_list(known)(text))


def _option_parsers() -> dict[str, Callable[[str], Any]]:
    """Capabilities field -> parser of its ``--impl-option`` text (every bool field too)."""
    parsers: dict[str, Callable[[str], Any]] = {
        "devices": _parse_list(("cpu", "cuda", "mps", "xpu")),
        "dtypes": _parse_list(ALL_DTYPES + FP8_DTYPES),
        "fp8_dtypes": lambda text: () if text.strip().lower() == "none" else _parse_list(FP8_DTYPES)(text),
        "fp8_descales": _parse_list(FP8_DESCALE_FORMS),
        "mask_kinds": lambda text: frozenset(_parse_list(ALL_MASK_KINDS)(text)),
        "causal": _parse_choice(CAUSAL_ALIGNMENTS, allow_none=True),
        "fully_masked": _parse_fully_masked,
        "batch_dims": _parse_batch_dims,
        "mha_features": _parse_mha_features,
        "flash_features": _parse_flash_features,
        "varlen_features": _parse_features(ALL_VARLEN_FEATURES),
        "kvcache_features": _parse_features(ALL_KVCACHE_FEATURES),
        "sharded_features": _parse_features(ALL_SHARDED_FEATURES),
        "max_head_dim": _parse_optional_int,
        "max_seq_len": _parse_optional_int,
        "min_head_dim": _parse_optional_int,
        "head_dims": _parse_head_dims,
        "seq_multiple": _parse_optional_int,
        "seq_block": _parse_optional_int,
        "backward_seq_multiple": _parse_optional_int,
        "rotary_dim_multiple": _parse_optional_int,
    }
    for field in dataclasses.fields(Capabilities):
        if field.type in ("bool", bool):
            parsers[field.name] = _parse_bool
    return parsers


_OPTION_PARSERS = _option_parsers()
#: The capability keys of ``--impl-option`` (each a Capabilities field; a declaration's too).
CAPABILITY_OPTION_KEYS = tuple(_OPTION_PARSERS)


def derived_flash_wanted(options: Mapping[str, str] | None) -> bool | None:
    """What ``options`` say of the derived flash level (``derived_flash``): True, False,
    or None when not given (the registry then derives it unless the implementation
    declares ``jit``: one more level of shapes to compile doubles a JIT run)."""
    text = (options or {}).get(DERIVED_FLASH_OPTION)
    if text is None:
        return None
    try:
        return _parse_bool(str(text))
    except ValueError as exc:
        raise ImplementationError(
            f"--impl-option {DERIVED_FLASH_OPTION}={text}: bad value; expected {exc} (false turns "
            "off the flash level derived from the SDPA callable)"
        ) from None


@dataclasses.dataclass(frozen=True)
class ParsedOptions:
    """``--impl-option`` values parsed: for every level, for one level, for one dtype."""

    common: dict[str, Any]
    per_level: dict[str, dict[str, Any]]
    per_dtype: dict[str, dict[str, Any]]

    def for_probes(self, level: str) -> dict[str, Any]:
        """What the probe calls of ``level`` are built inside."""
        return {**self.common, **self.per_level.get(level, {})}


def _parse_value(key_name: str, field_name: str, text: str) -> Any:
    parser = _OPTION_PARSERS.get(field_name)
    if parser is None:
        raise ImplementationError(
            f"--impl-option {key_name}={text}: unknown option {field_name!r}; valid options are "
            f"{', '.join(sorted([*_OPTION_PARSERS, DERIVED_FLASH_OPTION]))} (prefixed by a level "
            f"{'/'.join(OPTION_LEVELS)}. or a dtype {'/'.join(ALL_DTYPES)}. for that level or dtype only)"
        )
    try:
        return parser(str(text))
    except ValueError as exc:
        raise ImplementationError(
            f"--impl-option {key_name}={text}: bad value for {field_name!r}; expected {exc}"
        ) from exc


def parse_options(options: Mapping[str, str] | None) -> ParsedOptions:
    """Each ``--impl-option`` value parsed and checked (ImplementationError naming the key,
    what is valid and the fix), before anything is probed."""
    parsed = ParsedOptions({}, {}, {})
    derived_flash_wanted(options)  # checked here, applied by the registry's resolve
    for key_name, text in (options or {}).items():
        if key_name == DERIVED_FLASH_OPTION:
            continue
        scope, dot, field_name = key_name.partition(".")
        if not dot:
            parsed.common[key_name] = _parse_value(key_name, key_name, text)
        elif scope in OPTION_LEVELS:
            parsed.per_level.setdefault(scope, {})[field_name] = _parse_value(key_name, field_name, text)
        elif scope in ALL_DTYPES:
            if field_name not in PER_DTYPE_FIELDS:
                raise ImplementationError(
                    f"--impl-option {key_name}={text}: {field_name!r} cannot differ per dtype; a dtype "
                    f"prefix takes one of {', '.join(PER_DTYPE_FIELDS)}")
            parsed.per_dtype.setdefault(scope, {})[field_name] = _parse_value(key_name, field_name, text)
        else:
            raise ImplementationError(
                f"--impl-option {key_name}={text}: {scope!r} before the dot is neither a level "
                f"({', '.join(OPTION_LEVELS)}) nor a dtype ({', '.join(ALL_DTYPES)}); write e.g. "
                f"mha.mask_kinds=none,bool or float64.mask_kinds=none,bool")
    for values in (parsed.common, *parsed.per_level.values()):
        _split_fp8(values)
    return parsed


def _split_fp8(values: dict[str, Any]) -> None:
    """``dtypes`` naming 8-bit float formats: those move to ``fp8_dtypes`` (added to any
    given there); ``dtypes`` keeps the others, or is dropped when none is left."""
    dtypes = values.get("dtypes")
    if dtypes is None or not set(dtypes) & set(FP8_DTYPES):
        return
    values["fp8_dtypes"] = tuple(dict.fromkeys((*values.get("fp8_dtypes", ()),
                                                *(d for d in dtypes if d in FP8_DTYPES))))
    rest = tuple(d for d in dtypes if d not in FP8_DTYPES)
    if rest:
        values["dtypes"] = rest
    else:
        del values["dtypes"]


def _refuse_contradictions(caps: Capabilities, changes: Mapping[str, Any], level: str) -> None:
    """A declaration claiming what a probe saw fail is refused (probed implementations:
    those with ``sources``): a declared dtype whose plain call raised, a declared mask kind
    whose call raised."""
    if not caps.sources:
        return
    notes = " ".join(caps.probe_notes)
    for name, what in (("dtypes", "dtype"), ("mask_kinds", "mask kind")):
        if name not in changes:
            continue
        extra = sorted(set(changes[name]) - set(getattr(caps, name)) - {"none"})
        said = [n for n in caps.probe_notes if n.startswith(f"{name}:") and any(x in n for x in extra)]
        if extra and (said or name == "dtypes"):
            raise ImplementationError(
                f"--impl-option {name}={','.join(sorted(changes[name]))} declares the {what}s {extra} at the {level} "
                f"level, but the probe saw them fail ({' '.join(said) or notes or 'a plain call raised'}); "
                f"declare only what runs ({','.join(sorted(getattr(caps, name)))}), or fix the implementation")


def apply_options(impl: Implementation, options: Mapping[str, str] | ParsedOptions) -> Implementation:
    """``impl`` with capabilities overridden by ``--impl-option key=value`` pairs
    (applied at every level; a ``LEVEL.`` key at that level, a ``DTYPE.`` key in that dtype)."""
    parsed = options if isinstance(options, ParsedOptions) else parse_options(options)

    def overridden(caps: Capabilities, level: str) -> Capabilities:
        changes = {**parsed.common, **parsed.per_level.get(level, {})}
        _refuse_contradictions(caps, changes, level)
        # A probe note ("causal: ...") no longer describes a value the user set; a value the
        # user sets holds in every dtype, and is declared (Capabilities.sources).
        notes = tuple(n for n in caps.probe_notes if n.split(":", 1)[0] not in changes)
        sources = {name: source for name, source in caps.sources if name not in changes}
        if caps.sources:  # a probed implementation: say which values the user declared
            sources.update({name: "declared" for name in changes if name in SEMANTIC_FIELDS})
        by_dtype = {dtype: {name: value for name, value in values if name not in changes}
                    for dtype, values in caps.by_dtype}
        for dtype, values in parsed.per_dtype.items():
            by_dtype.setdefault(dtype, {}).update(values)
        return caps.replace(**changes, probe_notes=notes, sources=sources, by_dtype=by_dtype)

    level_specific = set(parsed.per_level)
    try:
        caps = overridden(impl.capabilities, "sdpa")
        # A level-specific option keeps the other levels apart from ``capabilities``.
        mha_base = impl.mha_capabilities or (impl.capabilities if impl.mha is not None and level_specific else None)
        flash_base = impl.flash_capabilities or (impl.capabilities if impl.flash is not None and level_specific
                                                 else None)
        mha_caps = overridden(mha_base, "mha") if mha_base else None
        flash_caps = overridden(flash_base, "flash") if flash_base else None
    except ImplementationError as exc:
        if "probe saw" in str(exc):
            raise
        raise ImplementationError(f"--impl-option values {dict(options) if isinstance(options, Mapping) else parsed} "
                                  f"are inconsistent: {exc}") from exc
    return dataclasses.replace(impl, capabilities=caps, mha_capabilities=mha_caps,
                               flash_capabilities=flash_caps)
