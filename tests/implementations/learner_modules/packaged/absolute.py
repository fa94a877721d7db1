"""Self-attention inside a package that imports its own package by name (minGPT's
``from mingpt.utils import CfgNode`` in ``mingpt/model.py``)."""

from packaged.attention import PackagedAttention


class AbsolutelyImportedAttention(PackagedAttention):
    """The packaged module, reached through an absolute import of its own package."""
