#!/usr/bin/env bash
# GPU certification run, one prepared script for a CUDA machine (not runnable without one).
#
#   OUT=/some/dir bash benchmarks/gpu_certify.sh
#
# 1. pytest conformance --impl=... --device cuda --dtype float32,float16,bfloat16
#    --hypothesis-profile ci --conformance-report $OUT/cert-<impl>  (-> .json / .md)
#    for triton, sdpa, torch-mha and the forced backends sdpa-flash-cuda,
#    sdpa-efficient and sdpa-cudnn (whose capabilities torch_sdpa.py declares).
#    Each includes the flash level: triton's own flash_attn_func (window, soft-capping,
#    ALiBi, LSE, split/merge), the SDPA flash level derived through masks for sdpa.
# 2. benchmarks/sdpa_backend_caps.py -> $OUT/sdpa_backend_caps.{md,json}: which inputs
#    each forced backend accepts, call by call (measures those capabilities).
# 3. the triton unit tests on CUDA (compiled forward, backward and flash features vs
#    the float64 reference and flash-ref).
# 4. benchmarks/triton_gpu_probe.py -> $OUT/triton_gpu_probe.md: the triton kernel case by
#    case, each in a process of its own (a fault cannot spill over), under compute-sanitizer
#    where it faults; triton and sdpa certified again with --isolate=always.
# 5. benchmarks/triton_speed.py -> $OUT/triton_speed.md, alone on the GPU.
#
# Steps 1-4 run side by side (one GPU and 16 CPU cores: their time is the CPU side,
# the float64 oracle and Hypothesis), each with OMP_NUM_THREADS=2; step 5 runs after
# them. Budget: under 6.5 minutes in all (phase 1 at most TRITON_CERT_TIMEOUT seconds,
# phase 2 at most SPEED_TIMEOUT). A step that times out is recorded as such and the
# others go on. The checkout need not be installed (its root goes on PYTHONPATH).
# Exit status: non-zero when any step failed or timed out (summary in $OUT/summary.txt).
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0          # compiled kernels on the GPU, never the interpreter
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9's current default, stated explicitly

TRITON_CERT_TIMEOUT="${TRITON_CERT_TIMEOUT:-300}"  # JIT-compiles each variant, cold cache
CERT_TIMEOUT="${CERT_TIMEOUT:-240}"
UNIT_TIMEOUT="${UNIT_TIMEOUT:-240}"
CAPS_TIMEOUT="${CAPS_TIMEOUT:-200}"
SPEED_TIMEOUT="${SPEED_TIMEOUT:-80}"

"$PY" - <<'PYEOF' > "$OUT/environment.txt" 2>&1
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except ImportError as exc:
    print("triton missing:", exc)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
PYEOF
cat "$OUT/environment.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: nothing to certify" | tee -a "$SUMMARY"
    exit 2
fi

step() {  # step NAME TIMEOUT CMD... : run, log to $OUT/NAME.log, record the outcome
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local outcome="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then outcome="TIMEOUT after ${limit}s"
    elif [ "$rc" -ne 0 ]; then outcome="FAILED (exit $rc)"; fi
    printf '%-26s %-24s %4ss  %s\n' "$name" "$outcome" "$((SECONDS - start))" "$OUT/$name.log" \
        >> "$SUMMARY"
}

export OMP_NUM_THREADS=2
for impl in triton sdpa torch-mha sdpa-flash-cuda sdpa-efficient sdpa-cudnn; do
    limit="$CERT_TIMEOUT"; [ "$impl" = triton ] && limit="$TRITON_CERT_TIMEOUT"
    step "cert-$impl" "$limit" \
        "$PY" -m pytest conformance --impl="$impl" --device cuda \
            --dtype float32,float16,bfloat16 --hypothesis-profile ci \
            --conformance-report "$OUT/cert-$impl" -q -p no:cacheprovider &
done
# A kernel fault (illegal address) breaks the CUDA context of its process: in-process,
# the properties after it fail as "not run". Isolated, a fresh worker runs each check after
# such a fault, so every property gets its own answer.
for impl in triton sdpa; do
    step "cert-$impl-isolated" "$TRITON_CERT_TIMEOUT" \
        "$PY" -m pytest conformance --impl="$impl" --device cuda --isolate=always \
            --dtype float32,float16,bfloat16 --hypothesis-profile ci \
            --conformance-report "$OUT/cert-$impl-isolated" -q -p no:cacheprovider &
done
step "triton_gpu_probe" "$CAPS_TIMEOUT" "$PY" benchmarks/triton_gpu_probe.py --jobs 6 --sanitize \
    --out "$OUT/triton_gpu_probe.md" &
step "sdpa_backend_caps" "$CAPS_TIMEOUT" "$PY" benchmarks/sdpa_backend_caps.py --device cuda \
    --out "$OUT/sdpa_backend_caps.md" --json "$OUT/sdpa_backend_caps.json" &
step "triton_unit_tests" "$UNIT_TIMEOUT" \
    "$PY" -m pytest tests/triton_kernel/test_triton_forward.py tests/triton_kernel/test_triton_backward.py \
        tests/triton_kernel/test_triton_flash.py -q -p no:cacheprovider &
wait
unset OMP_NUM_THREADS

step "triton_speed" "$SPEED_TIMEOUT" "$PY" benchmarks/triton_speed.py --out "$OUT/triton_speed.md"

cat "$SUMMARY"
for log in "$OUT"/*.log; do echo "== $log"; tail -n 4 "$log"; done
echo "results in $OUT (summary: $SUMMARY)"
status=0
if grep -qE "FAILED|TIMEOUT" "$SUMMARY"; then status=1; fi
exit "$status"
