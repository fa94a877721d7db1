"""Declarations (``implementations.registry.declaration``): one table whose keys are the
``--impl-option`` keys, read from a TOML file or a ``pyproject.toml`` table, giving the
same parsed values as the options."""

from __future__ import annotations

from pathlib import Path

import pytest

from implementations import registry
from implementations.base import (
    ImplementationError,
)
from implementations.registry.declaration import (
    find_declaration,
    known_keys,
    load_declaration_file,
    read_declaration,
    toml_value,
)
from implementations.registry.option_docs import DOCS, EXAMPLES
from implementations.registry.options import CAPABILITY_OPTION_KEYS, parse_options

EXAMPLE = "examples/sdpa_function.py:attention"
IMPLS = "tests/runner/partial_support_impls.py"

def _sample(key: str) -> str | None:
    """The key's documented example (docs/OPTIONS.md's table is generated from them)."""
    return EXAMPLES.get(key)


def test_every_option_key_has_a_documented_meaning_and_an_example_that_parses():
    assert set(DOCS) == set(EXAMPLES) == set(known_keys()), "a key without a row in option_docs (or a row for no key)"
    for key in CAPABILITY_OPTION_KEYS:
        parse_options({key: EXAMPLES[key]})  # an ImplementationError names the key
    assert all(meaning.strip() for meaning in DOCS.values())


def _native(text: str):
    """The option text as a TOML user would write it natively."""
    if text in ("true", "false"):
        return text == "true"
    if text.isdigit():
        return int(text)
    items = text.split(",")
    if all(":" in item for item in items):
        return dict(item.split(":", 1) for item in items)
    if all("=" in item for item in items):
        return {k: int(v) if v.isdigit() else v for k, v in (item.split("=", 1) for item in items)}
    if len(items) > 1:
        return [int(i) if i.isdigit() else i for i in items]
    return text


def _declare(key: str, value) -> dict:
    scope, dot, name = key.rpartition(".")
    return {"spec": EXAMPLE, **({scope: {name: value}} if dot else {key: value})}


@pytest.mark.parametrize("key", known_keys())
def test_every_option_key_declared_natively_parses_as_the_option(key):
    text = _sample(key)
    assert text is not None, f"no example for the new option {key!r}: add one to option_docs.EXAMPLES"
    for value in (_native(text), text):  # TOML's own value, and the option's text as a string
        declared = read_declaration(_declare(key, value), source="t.toml", base=Path.cwd())
        if key in CAPABILITY_OPTION_KEYS:
            assert parse_options(declared.options) == parse_options({key: text}), (key, value)
        else:
            assert declared.options == {key: text}, (key, value)


@pytest.mark.parametrize("key, value, option", [
    ("flash.head_dims", [64, 128], "64,128"),
    ("mha.mask_kinds", ["none", "bool"], "none,bool"),
    ("float64.mask_kinds", ["none", "bool"], "none,bool"),
    ("float16.gqa", False, "false"),
])
def test_a_subtable_is_the_level_or_dtype_scoped_option(key, value, option):
    declared = read_declaration(_declare(key, value), source="t.toml", base=Path.cwd())
    assert declared.options == {key: option}
    assert parse_options(declared.options) == parse_options({key: option})


@pytest.mark.parametrize("table, said", [
    ({"spec": EXAMPLE, "head_dim": [64]}, "unknown key 'head_dim'"),
    ({"spec": EXAMPLE, "flash": {"tile": 16}}, "unknown key 'flash.tile'"),
    ({"spec": EXAMPLE, "float64": {"dtypes": ["float64"]}}, "'dtypes' cannot differ per dtype"),
    ({"spec": EXAMPLE, "seq_multiple": 0}, "bad value for 'seq_multiple'"),
    ({"spec": EXAMPLE, "seq_multiple": 1.5}, "seq_multiple = 1.5 is a float"),
    ({"head_dims": [64]}, "no spec"),
    ({"spec": "other.toml"}, "names a declaration"),
    ({"spec": EXAMPLE, "xfail_file": "missing.toml"}, "no such file"),
])
def test_a_bad_declaration_names_the_key_the_rule_and_the_fix(table, said):
    with pytest.raises(ImplementationError) as raised:
        read_declaration(table, source="decl.toml", base=Path.cwd())
    message = str(raised.value)
    assert said in message and message.startswith("decl.toml")
    if "unknown key" in said:
        assert "seq_multiple" in message and "head_dims" in message and "fix the spelling" in message


def _write(path: Path, table: dict) -> Path:
    lines, subtables = [], []
    for key, value in table.items():
        if isinstance(value, dict) and key not in ("fully_masked", "learner_config"):
            subtables += [f"[{key}]", *(f"{k} = {toml_value(v)}" for k, v in value.items())]
        else:
            lines.append(f"{key} = {toml_value(value)}")
    path.write_text("\n".join(lines + subtables) + "\n")
    return path


def test_a_declaration_file_resolves_like_the_options_and_the_command_line_wins(tmp_path):
    decl = _write(tmp_path / "blocks.toml", {"spec": f"{IMPLS}:blocks_of_4", "seq_multiple": 4,
                                             "dtypes": ["float32", "float64"], "flash": {"head_dims": [8, 16]}})
    by_options = registry.resolve(f"{IMPLS}:blocks_of_4", {"seq_multiple": "4", "dtypes": "float32,float64",
                                                           "flash.head_dims": "8,16"})
    by_file = registry.resolve(str(decl))
    for level in ("sdpa", "mha", "flash"):
        assert by_file.caps(level) .replace(sources={}, probe_notes=()) == \
            by_options.caps(level).replace(sources={}, probe_notes=()), level
    overridden = registry.resolve(str(decl), {"dtypes": "float64"})
    assert overridden.caps("sdpa").dtypes == ("float64",) and overridden.caps("sdpa").seq_multiple == 4


def test_a_pyproject_table_is_found_by_name_but_never_shadows_a_builtin(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "mine"\n\n'
        '[tool.attention-conformance.implementations.my_kernel]\n'
        f'spec = "{Path(IMPLS).resolve()}:head_dims_8_16"\nhead_dims = [8, 16]\n\n'
        '[tool.attention-conformance.implementations.handwritten]\nspec = "sdpa"\n')
    found = find_declaration("my_kernel", tmp_path)
    assert found is not None and found.options == {"head_dims": "8,16"} and "my_kernel" in found.source
    assert registry.resolve("my_kernel", root=tmp_path).caps("sdpa").head_dims == (8, 16)
    assert find_declaration("handwritten", tmp_path) is None
    assert find_declaration("not_there", tmp_path) is None
    with pytest.raises(ImplementationError, match="not a registered implementation"):
        registry.resolve("not_there", root=tmp_path)


def test_the_xfail_file_of_a_declaration_is_attached(tmp_path):
    (tmp_path / "xfail.toml").write_text(
        '[[xfail]]\nproperty = "sdpa_agreement"\nreason = "known"\nmatch = { dtype = "float16" }\n')
    decl = _write(tmp_path / "d.toml", {"spec": EXAMPLE, "xfail_file": "xfail.toml"})
    assert load_declaration_file(decl).xfail_file == str(tmp_path / "xfail.toml")
    impl = registry.resolve(str(decl))
    assert [e.property for e in impl.expected_failures] == ["sdpa_agreement"]


def test_the_pasteable_declaration_reads_back_as_the_same_options(tmp_path):
    import tomllib

    decl = _write(tmp_path / "d.toml", {"spec": EXAMPLE, "seq_multiple": 2, "dtypes": ["float32"], "gqa": False,
                                        "fully_masked": {"bool": "uniform", "additive": "nan"},
                                        "flash": {"head_dims": [8, 16]}, "float64": {"mask_kinds": ["none"]}})
    first = load_declaration_file(decl)
    text = first.pasteable()
    assert "head_dims = [8, 16]" in text and "seq_multiple = 2" in text and "gqa = false" in text
    again = read_declaration(tomllib.loads(text), source="pasted", base=tmp_path)
    assert again.spec == first.spec and parse_options(again.options) == parse_options(first.options)
