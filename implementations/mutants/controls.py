"""The correct bases of the bug zoo as implementations: the controls.

``pytest conformance --impl=implementations.mutants.controls:tiled`` must pass for
each of them; otherwise a mutant could be "caught" by a bug of its base.
"""

from __future__ import annotations

from implementations.base import Implementation
from implementations.mutants._base import (
    MHA_CAPABILITIES,
    SDPA_CAPABILITIES,
    LOWER_RIGHT_CAPABILITIES,
    HandwrittenMHA,
    LowerRightSDPA,
    ManualBackwardSDPA,
    NaiveSDPA,
    TiledSDPA,
    mha_implementation,
    sdpa_implementation,
)
from implementations.mutants.flash.flash_mutants import FLASH_CAPABILITIES, FlashBase
from implementations.mutants.sdpa.sdpa_sink_mutants import SDPA_SINK_CAPABILITIES, SinkSDPA

__all__ = ["CONTROLS", "naive", "lower_right", "manual_backward", "tiled", "mha", "flash", "sinks"]

naive = sdpa_implementation("control:naive", NaiveSDPA(), SDPA_CAPABILITIES,
                            "correct straight-line SDPA (base of the SDPA mutants)")
lower_right = sdpa_implementation("control:lower_right", LowerRightSDPA(), LOWER_RIGHT_CAPABILITIES,
                                  "correct SDPA with a lower-right causal flag (base of the "
                                  "lower-right mutants)")
manual_backward = sdpa_implementation("control:manual_backward", ManualBackwardSDPA(),
                                      SDPA_CAPABILITIES.replace(dropout=False),
                                      "correct SDPA with a hand-written backward")
tiled = sdpa_implementation("control:tiled", TiledSDPA(), SDPA_CAPABILITIES.replace(dropout=False),
                            "correct tiled online-softmax SDPA (base of the kernel mutants)")
mha = mha_implementation("control:mha", HandwrittenMHA, MHA_CAPABILITIES,
                         "correct hand-written nn.MultiheadAttention drop-in (base of the MHA mutants)")

flash = Implementation(name="control:flash", capabilities=FLASH_CAPABILITIES, flash=FlashBase(), listed=False,
                       description="correct flash_attn_func in plain PyTorch, FP8 inputs with "
                                   "FlashAttention-3's numerics (base of the flash mutants)")

sinks = sdpa_implementation("control:sinks", SinkSDPA(), SDPA_SINK_CAPABILITIES,
                            "correct straight-line SDPA with learned sinks (base of the SDPA sink mutants)")

CONTROLS = {"naive": naive, "lower_right": lower_right, "manual_backward": manual_backward, "tiled": tiled, "mha": mha,
            "flash": flash, "sinks": sinks}
