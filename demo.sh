#!/usr/bin/env bash
# Builds gpufrac and runs a capped workload: a cudarc program that
# allocates 256 MiB blocks until the driver says no — once as it is, once
# under `gpufrac run --gpu-memory 4G`.
set -euo pipefail
cd "$(dirname "$0")"
echo "== building (release)"
cargo build --release --quiet
cargo build --release --quiet --example cudarc_alloc
# Where cargo put them (CARGO_TARGET_DIR, if set, is relative to here).
rel=$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/release
if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
  echo "== NVIDIA driver found: running on the real GPU"
else
  echo "== No NVIDIA driver (libcuda.so.1) on this machine, so there is no real GPU to cap."
  echo "== Running the same program against gpufrac's simulated driver instead"
  echo "   (the one the test suite uses: two devices of 16 GiB and 8 GiB, host bookkeeping only)."
  cargo build --release --quiet -p gpufrac-sim
  mkdir -p "$rel/sim-driver"
  for n in libcuda.so.1 libcuda.so libnvidia-ml.so.1; do ln -sf ../libgpufrac_sim.so "$rel/sim-driver/$n"; done
  export LD_LIBRARY_PATH="$rel/sim-driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export GPUFRAC_SIM_DEVICES=16G,8G
  echo "== Simulated driver settings (README.md, \"Try it without a GPU\"):"
  echo "   LD_LIBRARY_PATH=$rel/sim-driver (libcuda.so.1, libnvidia-ml.so.1 -> libgpufrac_sim.so)"
  echo "   GPUFRAC_SIM_DEVICES=$GPUFRAC_SIM_DEVICES (device sizes)"
  echo "   GPUFRAC_SIM_STATE=${GPUFRAC_SIM_STATE:-(unset: each process has an engine of its own, so processes never contend)}"
  echo "   GPUFRAC_SIM_QUANTUM_US=${GPUFRAC_SIM_QUANTUM_US:-2000} GPUFRAC_SIM_SWITCH_US=${GPUFRAC_SIM_SWITCH_US:-100} GPUFRAC_SIM_DRIVER_VERSION=${GPUFRAC_SIM_DRIVER_VERSION:-13000}"
fi
echo
echo "== without gpufrac (stops at 64 blocks = 16 GiB, or when the device is full):"
"$rel/examples/cudarc_alloc" --block 256 --max 64
echo
echo "== gpufrac run --gpu-memory 4G (expect 16 blocks = 4 GiB, then CUDA_ERROR_OUT_OF_MEMORY, and a 4 GiB device):"
"$rel/gpufrac" run --gpu-memory 4G -- "$rel/examples/cudarc_alloc" --block 256 --max 64
