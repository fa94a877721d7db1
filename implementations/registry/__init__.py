"""Find the implementation that ``--impl`` names, and describe what it claims.

One module per job:

* :mod:`.resolution` — ``resolve(spec, options)``: a registered built-in, an entry point
  of group ``attention_conformance.implementations``, ``mutant:NAME``,
  ``package.module:attr`` or ``path/to/file.py:attr``, in that order; ``registered()``
  builds each built-in once and attaches its expected failures;
* :mod:`.recognition` — what an entry point or ``attr`` may be (an Implementation, an
  SDPA-signature function, an nn.MultiheadAttention drop-in class) and the adapters
  that fill in missing optional parameters;
* :mod:`.probing` — the capabilities of a bare function or class, found by tiny calls
  checked against the ``spec`` oracle;
* :mod:`.options` — ``--impl-option key=value`` overrides of any capability;
* :mod:`.declaration` — the same keys written once, in a TOML file or a
  ``[tool.attention-conformance.implementations.NAME]`` table of ``pyproject.toml``, and
  the draft a run writes (``--conformance-write-declaration``);
* :mod:`.expected_failures` — ``implementations/xfail/<name>.toml`` (and ``--xfail-file``) as data;
* :mod:`.describing` — ``describe(impl)`` and the ``--impl=list`` table.

Every failure is an :class:`~implementations.base.ImplementationError` whose message
is one paragraph naming what was found and what was expected.
"""

from __future__ import annotations

from implementations.registry.describing import describe, listing
from implementations.registry.expected_failures import (
    XFAIL_DIR,
    load_expected_failures,
    load_expected_failures_file,
    with_expected_failures,
)
from implementations.registry.options import apply_options
from implementations.registry.probing import probe_mha, probe_sdpa
from implementations.registry.recognition import (
    MHA_FORWARD_PARAMETERS,
    MHA_INIT_PARAMETERS,
    SDPA_PARAMETERS,
    recognise,
)
from implementations.registry.resolution import ENTRY_POINT_GROUP, registered, resolve

__all__ = [
    "ENTRY_POINT_GROUP",
    "MHA_FORWARD_PARAMETERS",
    "MHA_INIT_PARAMETERS",
    "SDPA_PARAMETERS",
    "XFAIL_DIR",
    "apply_options",
    "describe",
    "listing",
    "load_expected_failures",
    "load_expected_failures_file",
    "probe_mha",
    "probe_sdpa",
    "recognise",
    "registered",
    "resolve",
    "with_expected_failures",
]
