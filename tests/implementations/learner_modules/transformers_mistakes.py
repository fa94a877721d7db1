"""Classic mistakes written into transformers' own attention classes (the installed
library's code, changed in one place by a subclass that forwards ``*args, **kwargs``):
each must fail at the learner level with its cause named. Imported only by tests that
skip where transformers is missing."""

from transformers.models.bart.modeling_bart import BartAttention
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.whisper.modeling_whisper import WhisperAttention


class BartScaledByModelDim(BartAttention):
    """The scores scaled by 1/sqrt(embed_dim) instead of 1/sqrt(head_dim)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaling = self.embed_dim**-0.5


class WhisperScaledByModelDim(WhisperAttention):
    """The same mistake where the query is scaled before the product (Whisper's way)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaling = self.embed_dim**-0.5


class GPT2ScaledByModelDim(GPT2Attention):
    """The same mistake behind GPT-2's Conv1D layers (eager path, bidirectional)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaling = self.embed_dim**-0.5


class BertScaledByModelDim(BertSelfAttention):
    """The same mistake in BERT's self-attention (no output projection of its own)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaling = self.all_head_size**-0.5
