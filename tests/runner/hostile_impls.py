"""Hostile implementations: each misbehaves in one way the runner must survive.

Plugged in as ``tests/runner/hostile_impls.py:NAME`` by ``tests/runner/test_hostile.py``.
Bare functions go through capability probing; ``Implementation`` objects skip it,
so that the misbehaviour reaches the property tests.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from implementations.base import Capabilities, Implementation
from implementations.builtins.references.handwritten import scaled_dot_product_attention


def correct(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The hand-written built-in: passes every property."""
    return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


# --------------------------------------------------------------------------- probing


def hangs(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Never returns (sleeps)."""
    time.sleep(3600)


def returns_none(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    return None


def returns_numpy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).numpy()


def returns_list(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).tolist()


def returns_squeezed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).squeeze(0)


def returns_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).to("meta")


def sets_numpy_raise(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """Correct, but turns every NumPy floating-point warning into an error."""
    np.seterr(all="raise")
    np.set_printoptions(precision=2, legacy="1.13")
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def disables_grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    """Correct, but switches autograd off (and changes other global torch state) after computing."""
    out = correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    return out


def ignores_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """is_causal has no effect (as with flash=True in some libraries)."""
    return correct(query, key, value, attn_mask, dropout_p, False, scale, enable_gqa)


def odd_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """is_causal blocks the diagonal too: neither alignment."""
    if is_causal:
        L, S = query.shape[-2], key.shape[-2]
        keep = torch.ones(L, S, dtype=torch.bool).tril(-1)
        keep[0, 0] = True
        return correct(query, key, value, keep, dropout_p, False, scale, enable_gqa)
    return correct(query, key, value, attn_mask, dropout_p, False, scale, enable_gqa)


# --------------------------------------------------------------------------- calls

_caps = Capabilities(dtypes=("float64", "float32"))


def _crash_on_big(kill):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.shape[-2] >= 2:
            kill()
        return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return sdpa


#: Ends the process (``os._exit(3)``) on every case with L >= 2.
exits = Implementation(name="exits", capabilities=_caps, sdpa=_crash_on_big(lambda: os._exit(3)))
#: Aborts (SIGABRT) on every case with L >= 2.
aborts = Implementation(name="aborts", capabilities=_caps, sdpa=_crash_on_big(os.abort))


def _cuda_fault():
    raise RuntimeError("CUDA error: an illegal memory access was encountered\n"
                       "CUDA kernel errors might be asynchronously reported at some other API call")


#: Raises what a CUDA kernel's illegal access raises (it breaks the process's CUDA
#: context: every later CUDA call fails) on every case with L >= 2; runs on the CPU.
faults_cuda = Implementation(name="faults_cuda", capabilities=_caps, sdpa=_crash_on_big(_cuda_fault))


def _spin(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    while True:  # a pure-Python spin holds the GIL in slices
        pass


#: Spins forever on every call.
spins = Implementation(name="spins", capabilities=_caps, sdpa=_spin)
#: Sleeps forever on every call.
sleeps = Implementation(name="sleeps", capabilities=_caps, sdpa=hangs)


def _wrong_device(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).to("meta")


#: Returns its output on the meta device.
wrong_device = Implementation(name="wrong-device", capabilities=_caps, sdpa=_wrong_device)
#: Returns a NumPy array.
wrong_type = Implementation(name="wrong-type", capabilities=_caps, sdpa=returns_numpy)

_calls = [0]


def _flaky(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _calls[0] += 1
    out = correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out + 1.0 if _calls[0] % 3 == 0 else out


#: Wrong on every third call, whatever the case.
flaky = Implementation(name="flaky", capabilities=_caps, sdpa=_flaky)

_every_other = [0]


def _alternating(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    _every_other[0] += 1
    out = correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out + 1.0 if _every_other[0] % 2 == 0 else out


#: Wrong on every second call: a failure that does not reproduce when replayed.
alternating = Implementation(name="alternating", capabilities=_caps, sdpa=_alternating)


def _two_bugs(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    out = correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.shape[-2] >= 3:
        raise RuntimeError("kernel launch failed")
    if key.shape[-2] >= 2:
        return out * 2
    return out


#: Two distinct bugs (Hypothesis reports both as an exception group).
two_bugs = Implementation(name="two-bugs", capabilities=_caps, sdpa=_two_bugs)

_seen: set[bytes] = set()


def _first_time_wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    out = correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    digest = query.detach().cpu().numpy().tobytes() + key.detach().cpu().numpy().tobytes()
    if digest in _seen:
        return out
    _seen.add(digest)
    return out + 1.0


#: Wrong the first time it sees an input, right afterwards: Hypothesis calls it flaky.
first_time_wrong = Implementation(name="first-time-wrong", capabilities=_caps, sdpa=_first_time_wrong)


_first_calls = [0]


def _slow_first(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _first_calls[0] += 1
    if _first_calls[0] == 1:
        time.sleep(2.5)  # compiles on its first call
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


#: Correct; its first call takes 2.5 s (as a JIT compiling on its first call would).
slow_first = Implementation(name="slow-first", capabilities=_caps, sdpa=_slow_first)
