#!/usr/bin/env bash
# GPU certification run, one prepared script for a CUDA machine (not runnable without one).
#
#   OUT=/some/dir bash benchmarks/gpu_certify.sh
#
# 1. pytest conformance --impl={triton,sdpa,torch-mha} --device cuda
#    --dtype float32,float16,bfloat16 --hypothesis-profile ci
#    --conformance-report $OUT/cert-<impl>          (-> $OUT/cert-<impl>.json / .md)
#    Each includes the flash level: triton's own flash_attn_func (window, soft-capping,
#    ALiBi, LSE, split/merge), the SDPA flash level derived through masks for sdpa.
# 2. benchmarks/triton_speed.py -> $OUT/triton_speed.md
# 3. the triton unit tests on CUDA (compiled forward, backward and flash features vs the
#    float64 reference and flash-ref)
#
# Budget: under 8 minutes in all. Each step has its own `timeout` (seconds, below);
# a step that times out is recorded as such and the script goes on. Logs are in $OUT.
# Exit status: non-zero when any step failed or timed out (summary in $OUT/summary.txt).
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export TRITON_INTERPRET=0          # compiled kernels on the GPU, never the interpreter
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9's current default, stated explicitly

# Worst case 140 + 75 + 75 + 80 + 60 = 430 s (7.2 min). triton gets the most: its
# kernels JIT-compile on first use of each variant (a few seconds each, cold cache).
TRITON_CERT_TIMEOUT="${TRITON_CERT_TIMEOUT:-140}"
CERT_TIMEOUT="${CERT_TIMEOUT:-75}"     # sdpa, torch-mha
SPEED_TIMEOUT="${SPEED_TIMEOUT:-80}"
UNIT_TIMEOUT="${UNIT_TIMEOUT:-60}"

python - <<'EOF' > "$OUT/environment.txt" 2>&1
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except ImportError as exc:
    print("triton missing:", exc)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
EOF
cat "$OUT/environment.txt"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: nothing to certify" | tee -a "$SUMMARY"
    exit 2
fi

status=0
step() {  # step NAME TIMEOUT CMD... : run, log to $OUT/NAME.log, record the outcome
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local outcome="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then outcome="TIMEOUT after ${limit}s"; status=1
    elif [ "$rc" -ne 0 ]; then outcome="FAILED (exit $rc)"; status=1; fi
    printf '%-22s %-24s %4ss  %s\n' "$name" "$outcome" "$((SECONDS - start))" "$OUT/$name.log" \
        | tee -a "$SUMMARY"
    tail -n 3 "$OUT/$name.log"
}

for impl in triton sdpa torch-mha; do
    limit="$CERT_TIMEOUT"; [ "$impl" = triton ] && limit="$TRITON_CERT_TIMEOUT"
    step "cert-$impl" "$limit" \
        python -m pytest conformance --impl="$impl" --device cuda \
            --dtype float32,float16,bfloat16 --hypothesis-profile ci \
            --conformance-report "$OUT/cert-$impl" -q -p no:cacheprovider
done

step "triton_speed" "$SPEED_TIMEOUT" python benchmarks/triton_speed.py --out "$OUT/triton_speed.md"
step "triton_unit_tests" "$UNIT_TIMEOUT" \
    python -m pytest tests/triton_kernel/test_triton_forward.py tests/triton_kernel/test_triton_backward.py \
        tests/triton_kernel/test_triton_flash.py -q -x -p no:cacheprovider

echo "results in $OUT (summary: $SUMMARY)"
exit "$status"
