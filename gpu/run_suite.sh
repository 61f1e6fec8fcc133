#!/usr/bin/env bash
# gpufrac real-GPU validation suite. Run as root on a machine with an NVIDIA
# GPU, from anywhere:   bash gpu/run_suite.sh
# See gpu/README.md for what each section checks and the knobs below.
#
#   REPORT=path            report file (default docs/gpu-results-YYYY-MM-DD.md)
#   OUT=dir                also copy the report (and raw logs) there
#   PYTHON=python3         interpreter with torch / cupy / jax
#   SUITE_SECTIONS="1 2 3 4 5 6 7" sections to run (the build always runs; 6 and 7 run before 5)
#   SUITE_SKIP_BUILD=1     use the artifacts already in target/release
#   SUITE_BUDGET_S=480     wall-clock budget; steps that would start after it are SKIPPED
#   SUITE_CAP_GIB=4        the memory cap the checks run under
#   SUITE_SHARE_SECONDS=8  length of each sharing measurement
#   SUITE_LATENCY_SECONDS=5  length of each latency window in section 6 (250 requests)
#   SUITE_REVISION=...     free text (e.g. a commit id) printed in the report
#
# Every step runs under `timeout`; a missing framework or tool makes its
# checks SKIPPED, never aborts the suite. Exit status: 0 when nothing FAILED.
set -u
set -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
GPU_DIR=$ROOT/gpu
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
DAY=$(date +%F)
REPORT=${REPORT:-$ROOT/docs/gpu-results-$DAY.md}
CAP_GIB=${SUITE_CAP_GIB:-4}
export SUITE_CAP="${CAP_GIB}G"
export SUITE_CAP_BYTES=$((CAP_GIB * 1024 * 1024 * 1024))
BUDGET=${SUITE_BUDGET_S:-480}
SECTIONS=" ${SUITE_SECTIONS:-1 2 3 4 5 6 7} "
SHARE_SECONDS=${SUITE_SHARE_SECONDS:-8}
LAT_SECONDS=${SUITE_LATENCY_SECONDS:-5}
SOCK=/tmp/gpufrac-suite/broker.sock
T0=$(date +%s)
WORK=$(mktemp -d /tmp/gpufrac-suite.XXXXXX)
LOGS=$WORK/logs
mkdir -p "$LOGS"
BODY=$WORK/body.md
: >"$BODY"
SHIM=$ROOT/target/release/libgpufrac.so
BIN=$ROOT/target/release/gpufrac
CUDARC=$ROOT/target/release/examples/cudarc_alloc
EMPTY=$WORK/empty_kernel
LOADBIN=$WORK/load

# Nothing gpufrac reads may leak in from the caller's environment.
ORIG_LD_PRELOAD=${LD_PRELOAD:-}
unset LD_PRELOAD
for v in $(compgen -e); do
    case $v in GPU_MEM_LIMIT* | GPU_COMPUTE_* | GPUFRAC_*) unset "$v" ;; esac
done
SHIM_VARS=(LD_PRELOAD="$SHIM" GPU_MEM_LIMIT="$SUITE_CAP" GPUFRAC_BROKER=off)

HAVE_GPU=0 HAVE_TORCH=0 HAVE_CUPY=0 HAVE_JAX=0
TORCH_WHY="not checked" CUPY_WHY="not checked" JAX_WHY="not checked"
declare -A SEC_TITLE SEC_P SEC_F SEC_S SEC_T SEC_START
ORDER=()
CUR=0
CHILD=""
FINALIZED=0

elapsed() { echo $(($(date +%s) - T0)); }
remaining() { echo $((BUDGET - $(elapsed))); }
md() { printf '%s\n' "$*" >>"$BODY"; }
wants() { [[ $SECTIONS == *" $1 "* ]]; }

section() {
    CUR=$1
    ORDER+=("$1")
    SEC_TITLE[$1]=$2
    SEC_P[$1]=0 SEC_F[$1]=0 SEC_S[$1]=0 SEC_T[$1]=0
    SEC_START[$1]=$(date +%s)
    md ""
    md "## $1. $2"
    md ""
    echo
    echo "=== $1. $2 ($(elapsed)s elapsed) ==="
}
end_section() { SEC_T[$CUR]=$(($(date +%s) - SEC_START[$CUR])); }

# record KIND NAME [DETAIL]: KIND is PASS, FAIL, SKIP or INFO
record() {
    local kind=$1 name=$2 detail=${3:-}
    case $kind in
        PASS) SEC_P[$CUR]=$((SEC_P[$CUR] + 1)) ;;
        FAIL) SEC_F[$CUR]=$((SEC_F[$CUR] + 1)) ;;
        SKIP) SEC_S[$CUR]=$((SEC_S[$CUR] + 1)) ;;
    esac
    if [ "$kind" = INFO ]; then
        md "- info: $name${detail:+ — $detail}"
    else
        md "- **$kind** $name${detail:+ — $detail}"
    fi
    printf '%-4s %s%s\n' "$kind" "$name" "${detail:+: $detail}"
}

# ingest FILE: turns the check scripts' PASS/FAIL/SKIP/INFO lines into records
ingest() {
    local line kind rest name detail
    while IFS= read -r line; do
        case $line in
            "PASS "* | "FAIL "* | "SKIP "* | "INFO "*)
                kind=${line%% *}
                rest=${line#* }
                if [[ $rest == *" :: "* ]]; then
                    name=${rest%% :: *}
                    detail=${rest#* :: }
                else
                    name=$rest detail=""
                fi
                record "$kind" "$name" "$detail"
                ;;
        esac
    done <"$1"
}

# logblock TITLE FILE...: the tails of the files, folded, in the report
logblock() {
    local title=$1 f
    shift
    md ""
    md "<details><summary>$title</summary>"
    md ""
    md '```text'
    for f in "$@"; do
        [ -s "$f" ] || continue
        md "# $(basename "$f") (last 40 lines)"
        tail -n 40 "$f" | cut -c1-400 | sed 's/```/`‵`/g' >>"$BODY"
    done
    md '```'
    md ""
    md "</details>"
    md ""
}

slug() { printf '%s' "$1" | tr -c 'A-Za-z0-9' '-' | tr -s '-' | cut -c1-60; }

# run_step LABEL TIMEOUT NEED CMD...: runs a check script under timeout and
# records its results; a timeout or a script that did not print DONE is a
# FAIL. The timeout is cut to what is left of the budget, and a step that
# needs NEED seconds when less is left is SKIPPED.
run_step() {
    local label=$1 t=$2 need=$3
    shift 3
    local rem
    rem=$(remaining)
    if ((rem < need)); then
        record SKIP "$label" "time budget: ${rem}s left of SUITE_BUDGET_S=${BUDGET}, the step needs about ${need}s"
        return 0
    fi
    ((t > rem)) && t=$rem
    local s out err rc s0
    s=$(slug "$label")
    out=$LOGS/$s.out err=$LOGS/$s.err
    echo ">>> $label (timeout ${t}s)"
    s0=$(date +%s)
    timeout -k 10 "$t" "$@" >"$out" 2>"$err" </dev/null &
    CHILD=$!
    wait "$CHILD"
    rc=$?
    CHILD=""
    ingest "$out"
    if ((rc == 124 || rc == 137)); then
        record FAIL "$label" "timed out after ${t}s"
    elif ! grep -q '^DONE' "$out"; then
        record FAIL "$label" "did not run to the end (exit status $rc): $(tail -n 3 "$err" | tr '\n' ' ' | cut -c1-300)"
    fi
    logblock "log: $label (exit status $rc, $(($(date +%s) - s0)) s)" "$out" "$err"
}

# quiet CMD...: stdout+stderr of a short command (30 s limit), on one line
quiet() { timeout -k 5 30 "$@" 2>&1 | tr '\n' ' ' | sed 's/  */ /g; s/ $//'; }

finalize() {
    ((FINALIZED)) && return
    FINALIZED=1
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
    [ -n "${SEC_START[$CUR]:-}" ] && [ "${SEC_T[$CUR]:-0}" = 0 ] && end_section
    local p=0 f=0 s=0 n
    for n in "${ORDER[@]}"; do
        p=$((p + SEC_P[$n])) f=$((f + SEC_F[$n])) s=$((s + SEC_S[$n]))
    done
    mkdir -p "$(dirname "$REPORT")"
    {
        echo "# gpufrac real-GPU validation — $DAY"
        echo
        echo "Generated by \`gpu/run_suite.sh\` on \`$(hostname)\` at $(date -u '+%Y-%m-%d %H:%M UTC'), $(elapsed) s in all."
        echo "GPU: ${GPU_DESC:-unknown}. Memory cap under test: \`GPU_MEM_LIMIT=$SUITE_CAP\` ($SUITE_CAP_BYTES bytes)."
        [ -n "${SUITE_REVISION:-}" ] && echo "Revision: $SUITE_REVISION."
        [ -n "$ORIG_LD_PRELOAD" ] && echo "Note: the caller's LD_PRELOAD (\`$ORIG_LD_PRELOAD\`) was cleared for the suite."
        echo
        if ((f == 0)); then
            echo "**Result: $p passed, 0 failed, $s skipped.**"
        else
            echo "**Result: $p passed, $f FAILED, $s skipped.**"
        fi
        echo
        echo "| # | section | pass | fail | skip | time |"
        echo "|---|---|---:|---:|---:|---:|"
        for n in "${ORDER[@]}"; do
            echo "| $n | ${SEC_TITLE[$n]} | ${SEC_P[$n]} | ${SEC_F[$n]} | ${SEC_S[$n]} | ${SEC_T[$n]} s |"
        done
        cat "$BODY"
        echo
        echo "---"
        echo "Raw logs: \`$WORK\` on the GPU machine${OUT:+ (copied to \`\$OUT/gpu-suite-logs/\`)}."
    } >"$REPORT"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT/gpu-suite-logs"
        cp "$REPORT" "$OUT/"
        cp -r "$LOGS" "$OUT/gpu-suite-logs/" 2>/dev/null
        [ -d "$WORK/sharing" ] && cp -r "$WORK/sharing" "$OUT/gpu-suite-logs/" 2>/dev/null
        [ -d "$WORK/latency" ] && cp -r "$WORK/latency" "$OUT/gpu-suite-logs/" 2>/dev/null
    fi
    echo
    echo "Report: $REPORT ($p passed, $f failed, $s skipped, $(elapsed) s)"
    SUITE_FAILS=$f
}

on_signal() {
    echo "run_suite.sh: interrupted, writing the report" >&2
    md ""
    md "**The suite was interrupted at $(elapsed) s; the results above are partial.**"
    record FAIL "suite" "interrupted by a signal at $(elapsed) s"
    finalize
    exit 130
}
trap on_signal INT TERM
trap finalize EXIT

# ---------------------------------------------------------------- 0. build
section 0 "Build"
build() { # build TIMEOUT ARGS...: appends to build.log; the timeout is cut to the budget
    local t=$1 rem
    shift
    rem=$(remaining)
    ((rem < 30)) && { echo "### skipped cargo build --release $*: time budget" >>"$LOGS/build.log"; return 1; }
    ((t > rem)) && t=$rem
    echo "### cargo build --release $*" >>"$LOGS/build.log"
    timeout -k 10 "$t" cargo build --release "$@" >>"$LOGS/build.log" 2>&1 </dev/null
}
if [ "${SUITE_SKIP_BUILD:-0}" = 1 ]; then
    record INFO "build" "SUITE_SKIP_BUILD=1: using the artifacts already in target/release"
elif ! command -v cargo >/dev/null 2>&1; then
    record INFO "build" "cargo not found: using the artifacts already in target/release"
else
    b0=$(date +%s)
    if build 360 --workspace || build 120 --workspace --offline; then
        record PASS "cargo build --release --workspace" "$(($(date +%s) - b0)) s"
    elif [ -f "$SHIM" ] && [ -x "$BIN" ]; then
        record INFO "cargo build --release --workspace failed" "using the artifacts already in target/release (see build.log)"
    else
        record FAIL "cargo build --release --workspace" "$(tail -n 3 "$LOGS/build.log" | tr '\n' ' ' | cut -c1-300)"
    fi
    b0=$(date +%s)
    if build 300 -p gpufrac --examples || build 300 -p gpufrac --example cudarc_alloc ||
        build 120 -p gpufrac --example cudarc_alloc --offline; then
        record PASS "cargo build --release --examples (cudarc_alloc)" "$(($(date +%s) - b0)) s"
    elif [ -x "$CUDARC" ]; then
        record INFO "cargo build --release --examples failed" "using the cudarc_alloc already in target/release"
    else
        record FAIL "cargo build --release --examples" "$(tail -n 3 "$LOGS/build.log" | tr '\n' ' ' | cut -c1-300)"
    fi
fi
for a in "$SHIM" "$BIN" "$CUDARC"; do
    if [ -e "$a" ]; then
        record INFO "artifact ${a#"$ROOT"/}" "$(stat -c '%s bytes, built %y' "$a" | cut -c1-60)"
    else
        record FAIL "artifact ${a#"$ROOT"/}" "missing"
    fi
done
[ -s "$LOGS/build.log" ] && logblock "log: build" "$LOGS/build.log"
end_section
HAVE_SHIM=0
[ -f "$SHIM" ] && HAVE_SHIM=1

# ---------------------------------------------------------------- 1. environment
fw_probe() { # fw_probe NAME: runs env_info.py natively; output in $LOGS/env-NAME.txt
    timeout -k 5 120 "$PY" "$GPU_DIR/env_info.py" "$1" >"$LOGS/env-$1.txt" 2>"$LOGS/env-$1.err" </dev/null
}
kv() { sed -n "s/^$2=//p" "$1" 2>/dev/null | head -n 1; }

if wants 1 || wants 2 || wants 3 || wants 4 || wants 6; then
    section 1 "Environment"
    smi_l=$(timeout 30 nvidia-smi -L 2>&1)
    if [ $? -eq 0 ] && grep -q '^GPU ' <<<"$smi_l"; then
        HAVE_GPU=1
        record PASS "nvidia-smi -L lists a GPU" "$(tr '\n' ';' <<<"$smi_l" | cut -c1-300)"
    else
        record FAIL "nvidia-smi -L lists a GPU" "$(tr '\n' ' ' <<<"$smi_l" | cut -c1-300)"
    fi
    GPU_DESC=$(quiet nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader -i 0)
    cuda_ver=$(timeout 30 nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | head -n 1)
    GPU_DESC="$GPU_DESC${cuda_ver:+, $cuda_ver}"
    NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
    fw_probe torch
    fw_probe cupy
    fw_probe jax
    fw_probe pynvml
    # why a framework is unusable: its error, or the tail of the probe's stderr
    fw_why() { local e; e=$(kv "$LOGS/env-$1.txt" "$1_error"); [ -n "$e" ] || e=$(tail -n 2 "$LOGS/env-$1.err" 2>/dev/null | tr '\n' ' ' | cut -c1-200); echo "${e:-probe printed nothing}"; }
    if [ "$(kv "$LOGS/env-torch.txt" torch_gpu)" = True ]; then
        HAVE_TORCH=1
    else
        TORCH_WHY="PyTorch unusable: $([ "$(kv "$LOGS/env-torch.txt" torch_gpu)" = False ] && echo 'torch.cuda.is_available() is False' || fw_why torch)"
    fi
    if [ "$(kv "$LOGS/env-cupy.txt" cupy_gpu)" = True ]; then
        HAVE_CUPY=1
    else
        CUPY_WHY="cupy unusable: $([ "$(kv "$LOGS/env-cupy.txt" cupy_gpu)" = False ] && echo 'no CUDA device' || fw_why cupy)"
    fi
    if [ "$(kv "$LOGS/env-jax.txt" jax_gpu)" = True ]; then
        HAVE_JAX=1
    else
        JAX_WHY="JAX has no GPU backend here: $(b=$(kv "$LOGS/env-jax.txt" jax_backend); [ -n "$b" ] && echo "default backend is $b" || fw_why jax)"
    fi
    ((HAVE_GPU)) || GPU_DESC="unknown (nvidia-smi failed)"
    md ""
    md "| item | value |"
    md "|---|---|"
    md "| host | $(hostname), $(uname -sr), $(nproc) CPUs |"
    md "| GPU 0 | $GPU_DESC |"
    md "| nvcc | $([ -n "$NVCC" ] && "$NVCC" --version 2>/dev/null | tail -n 1 || echo 'not found') |"
    md "| python | $($PY --version 2>&1) ($(command -v "$PY")) |"
    md "| torch | $(kv "$LOGS/env-torch.txt" torch) cuda=$(kv "$LOGS/env-torch.txt" torch_cuda) cudnn=$(kv "$LOGS/env-torch.txt" torch_cudnn) gpu=$(kv "$LOGS/env-torch.txt" torch_gpu) $(kv "$LOGS/env-torch.txt" torch_error) |"
    md "| cupy | $(kv "$LOGS/env-cupy.txt" cupy) runtime=$(kv "$LOGS/env-cupy.txt" cupy_runtime) $(kv "$LOGS/env-cupy.txt" cupy_error) |"
    md "| jax | $(kv "$LOGS/env-jax.txt" jax) jaxlib=$(kv "$LOGS/env-jax.txt" jaxlib) backend=$(kv "$LOGS/env-jax.txt" jax_backend) $(kv "$LOGS/env-jax.txt" jax_error) |"
    md "| pynvml | $(kv "$LOGS/env-pynvml.txt" pynvml)$(kv "$LOGS/env-pynvml.txt" pynvml_error) |"
    md "| rust | $(quiet rustc --version) / $(quiet cargo --version) |"
    md ""
    md '```text'
    printf '%s\n' "$smi_l" >>"$BODY"
    md '```'
    md ""
    for fw in torch cupy jax; do
        v=HAVE_${fw^^}
        w=${fw^^}_WHY
        if [ "${!v}" = 1 ]; then record INFO "$fw" "usable on the GPU"; else record INFO "$fw" "${!w}"; fi
    done
    BASE_PIDS=$(timeout 30 nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | sort -u)
    record INFO "compute processes on the GPU before the suite" "${BASE_PIDS:-none}"
    end_section
fi

# skip_all NAME REASON
skip_all() { record SKIP "$1" "$2"; }
prereq() { # prints a reason to skip GPU sections, or nothing
    if ((HAVE_GPU == 0)); then echo "no GPU (nvidia-smi -L failed)"
    elif ((HAVE_SHIM == 0)); then echo "libgpufrac.so was not built"
    fi
}

# ---------------------------------------------------------------- 2. memory caps
if wants 2; then
    section 2 "Memory caps (GPU_MEM_LIMIT=$SUITE_CAP)"
    why=$(prereq)
    if [ -n "$why" ]; then
        skip_all "memory-cap checks" "$why"
    else
        if ((HAVE_TORCH)); then
            run_step "PyTorch, default caching allocator" 150 30 \
                env -u PYTORCH_CUDA_ALLOC_CONF "${SHIM_VARS[@]}" "$PY" "$GPU_DIR/check_torch.py"
            run_step "PyTorch, expandable_segments:True (VMM)" 150 30 \
                env "${SHIM_VARS[@]}" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" "$GPU_DIR/check_torch.py"
        else
            skip_all "PyTorch checks" "$TORCH_WHY"
        fi
        if ((HAVE_CUPY)); then
            run_step "cupy, default pool / MemoryPool(malloc_async) / MemoryAsyncPool" 150 20 \
                env "${SHIM_VARS[@]}" "$PY" "$GPU_DIR/check_cupy.py"
        else
            skip_all "cupy checks" "$CUPY_WHY"
        fi
        if ((HAVE_JAX)); then
            XLA_UNSET=(-u XLA_PYTHON_CLIENT_PREALLOCATE -u XLA_PYTHON_CLIENT_MEM_FRACTION -u XLA_CLIENT_MEM_FRACTION
                -u XLA_PYTHON_CLIENT_ALLOCATOR)
            run_step "JAX, preallocation on (defaults)" 150 30 \
                env "${XLA_UNSET[@]}" "${SHIM_VARS[@]}" JAX_PLATFORMS=cuda "$PY" "$GPU_DIR/check_jax.py"
            run_step "JAX, platform allocator" 150 30 \
                env "${XLA_UNSET[@]}" "${SHIM_VARS[@]}" JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
                XLA_PYTHON_CLIENT_ALLOCATOR=platform "$PY" "$GPU_DIR/check_jax.py"
        else
            skip_all "JAX checks" "$JAX_WHY"
        fi
        if [ -x "$CUDARC" ]; then
            run_step "cudarc example (examples/cudarc_alloc.rs)" 120 10 \
                "$PY" "$GPU_DIR/check_cudarc.py" --exe "$CUDARC" --shim "$SHIM"
        else
            skip_all "cudarc example" "target/release/examples/cudarc_alloc was not built"
        fi
        run_step "NVML and nvidia-smi inside the capped process" 90 10 \
            env "${SHIM_VARS[@]}" "$PY" "$GPU_DIR/check_nvml.py"
        run_step "VMM: map then release at once stays charged; driver lifetimes" 120 10 \
            env "${SHIM_VARS[@]}" "$PY" "$GPU_DIR/check_vmm.py"
        run_step "CUDA graph memory: captured allocation relaunched under the cap" 120 10 \
            env "${SHIM_VARS[@]}" "$PY" "$GPU_DIR/check_graphmem.py"
        margs=(--shim "$SHIM")
        [ -x "$CUDARC" ] && margs+=(--cudarc "$CUDARC")
        ((HAVE_TORCH)) && margs+=(--torch)
        ((HAVE_CUPY)) && margs+=(--cupy)
        run_step "malformed GPU_MEM_LIMIT=4X fails closed" 150 20 "$PY" "$GPU_DIR/check_malformed.py" "${margs[@]}"
    fi
    end_section
fi

# ---------------------------------------------------------------- 3. overhead
# build_cu NAME OUT [NVCC FLAGS...]: nvcc -O2 -arch=native (falling back to
# sm_90) of gpu/NAME into OUT, tried once per run; records PASS/FAIL/SKIP.
declare -A CU_TRIED
build_cu() {
    local name=$1 out=$2
    shift 2
    [ -x "$out" ] && return 0
    [ -n "${CU_TRIED[$name]:-}" ] && return 1
    CU_TRIED[$name]=1
    if (($(remaining) < 60)); then
        record SKIP "nvcc builds gpu/$name" "time budget"
        return 1
    fi
    if [ -z "${NVCC:-}" ]; then
        NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
    fi
    if [ -z "$NVCC" ]; then
        record SKIP "nvcc builds gpu/$name" "nvcc not found (PATH, /usr/local/cuda/bin)"
        return 1
    fi
    local arch
    for arch in native sm_90; do
        if timeout -k 5 180 "$NVCC" -O2 "$@" -arch=$arch -o "$out" "$GPU_DIR/$name" \
            >>"$LOGS/nvcc.log" 2>&1 </dev/null; then
            record PASS "nvcc builds gpu/$name" "-arch=$arch"
            return 0
        fi
    done
    record FAIL "nvcc builds gpu/$name" "$(tail -n 3 "$LOGS/nvcc.log" | tr '\n' ' ' | cut -c1-300)"
    return 1
}
build_empty_kernel() { build_cu empty_kernel.cu "$EMPTY"; }

if wants 3; then
    section 3 "Overhead (native vs LD_PRELOAD shim, GPUFRAC_BROKER=off)"
    why=$(prereq)
    if [ -n "$why" ]; then
        skip_all "overhead checks" "$why"
    else
        oargs=(--shim "$SHIM" --runs 5 --launches 200000 --train-runs 3 --steps 200)
        build_empty_kernel && oargs+=(--empty-kernel "$EMPTY")
        ((HAVE_TORCH)) && oargs+=(--train "$GPU_DIR/train_step.py")
        run_step "overhead: empty-kernel launches and a training loop" 300 60 "$PY" "$GPU_DIR/overhead.py" "${oargs[@]}"
    fi
    end_section
fi

# ---------------------------------------------------------------- 4. sharing
if wants 4; then
    section 4 "Compute sharing through the broker"
    why=$(prereq)
    if [ -z "$why" ] && [ ! -x "$BIN" ]; then why="target/release/gpufrac was not built"; fi
    if [ -z "$why" ] && ((HAVE_TORCH == 0)); then why="$TORCH_WHY (the load is a PyTorch matmul loop)"; fi
    if [ -n "$why" ]; then
        skip_all "sharing checks" "$why"
    else
        sargs=(--bin "$BIN" --shim "$SHIM" --script "$GPU_DIR/matmul_loop.py" --workdir "$WORK/sharing"
            --sock "$SOCK" --seconds "$SHARE_SECONDS")
        build_empty_kernel || true
        [ -x "$EMPTY" ] && sargs+=(--empty-kernel "$EMPTY")
        run_step "sharing: 50/50, 70/30, 25/25/50 against one process alone" 360 90 \
            "$PY" "$GPU_DIR/sharing.py" "${sargs[@]}"
    fi
    end_section
fi

# ---------------------------------------------------------------- 6. latency and shares
# Runs before section 5, which checks that nothing was left behind.

# latency_step LABEL TIMEOUT NEED ARGS...: one part of gpu/latency.py; it is
# told how long it has, so it skips scenarios rather than run into the timeout.
latency_step() {
    local label=$1 t=$2 need=$3 rem
    shift 3
    rem=$(remaining)
    ((t > rem)) && t=$rem
    run_step "$label" "$t" "$need" "$PY" "$GPU_DIR/latency.py" --bin "$BIN" --shim "$SHIM" \
        --workdir "$WORK/latency" --sock "$SOCK" --seconds "$LAT_SECONDS" --deadline-s $((t > 30 ? t - 15 : 15)) "$@"
}

if wants 6; then
    section 6 "Latency beside batch work, and shares with short and long kernels"
    why=$(prereq)
    if [ -z "$why" ] && [ ! -x "$BIN" ]; then why="target/release/gpufrac was not built"; fi
    if [ -n "$why" ]; then
        skip_all "latency and share checks" "$why"
    else
        if build_cu load.cu "$LOADBIN" -std=c++17; then
            latency_step "latency: load.cu interactive beside 50 us / 6 ms / 120 ms kernels" 150 60 \
                --part cuda --load "$LOADBIN"
            latency_step "shares: load.cu 70/30 with 50 us / 6 ms / 120 ms kernels" 100 40 \
                --part shares --load "$LOADBIN"
            # The broker's evidence of work: what NVML's per-process
            # utilisation reports of loads of a known duty (about 25 s).
            run_step "evidence: NVML per-process utilisation of busy, 10% and 2% loads" 60 30 \
                "$PY" "$GPU_DIR/check_procutil.py" --load "$LOADBIN"
        else
            skip_all "load.cu latency and share checks" "gpu/load.cu was not built"
        fi
        if ((HAVE_TORCH)); then
            latency_step "latency: PyTorch inference beside training; 70/30 training pair" 180 60 \
                --part torch --torch-script "$GPU_DIR/torch_load.py"
        else
            skip_all "PyTorch latency and share checks" "$TORCH_WHY"
        fi
    fi
    end_section
fi

# ---------------------------------------------------------------- 7. MPS
if wants 7; then
    section 7 "MPS: small jobs side by side (gpufrac broker --mps)"
    why=$(prereq)
    if [ -z "$why" ] && ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
        why="nvidia-cuda-mps-control is not installed"
    fi
    if [ -z "$why" ] && [ ! -x "$BIN" ]; then why="target/release/gpufrac was not built"; fi
    if [ -n "$why" ]; then
        skip_all "MPS checks" "$why"
    elif build_cu load.cu "$LOADBIN" -std=c++17; then
        margs=(--bin "$BIN" --load "$LOADBIN" --shim "$SHIM" --workdir "$WORK/mps")
        ((HAVE_TORCH)) && margs+=(--torch-check "$GPU_DIR/check_torch.py")
        run_step "MPS: 1/2/16 small-kernel jobs vs time-slicing; caps in a client; clean stop" 300 120 \
            "$PY" "$GPU_DIR/mps.py" "${margs[@]}"
    else
        skip_all "MPS checks" "gpu/load.cu was not built"
    fi
    end_section
fi

# ---------------------------------------------------------------- 5. sanity
if wants 5; then
    section 5 "Sanity: nothing left behind"
    if ((HAVE_GPU)); then
        sleep 2
        now=$(timeout 30 nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | sort -u)
        new=$(comm -13 <(printf '%s\n' "${BASE_PIDS:-}" | sort -u) <(printf '%s\n' "$now") | grep -v '^$')
        if [ -z "$new" ]; then
            record PASS "nvidia-smi --query-compute-apps shows no new process" "before: ${BASE_PIDS:-none}; now: ${now:-none}"
        else
            desc=$(for p in $new; do printf '%s(%s) ' "$p" "$(ps -o args= -p "$p" 2>/dev/null | cut -c1-80)"; done)
            record FAIL "nvidia-smi --query-compute-apps shows no new process" "new: $desc"
        fi
    else
        record SKIP "nvidia-smi --query-compute-apps" "no GPU"
    fi
    left=$(pgrep -af -- "$GPU_DIR/[a-z_]+\\.py|$EMPTY|$LOADBIN|$CUDARC|$SOCK" 2>/dev/null | grep -v "^$$ ")
    if [ -z "$left" ]; then
        record PASS "no suite process (check scripts, loads, broker) still running" ""
    else
        record FAIL "no suite process (check scripts, loads, broker) still running" "$(tr '\n' ';' <<<"$left" | cut -c1-400)"
    fi
    # A stopped broker leaves its socket (the path is never free for
    # another user to take); nothing may listen on it any more.
    if python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])' "$SOCK" 2>/dev/null; then
        record FAIL "nothing listens on the broker socket" "$SOCK still answers"
    else
        record PASS "nothing listens on the broker socket" "$SOCK"
    fi
    end_section
fi

finalize
trap - EXIT
((SUITE_FAILS == 0))
