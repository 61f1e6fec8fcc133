#!/usr/bin/env bash
# gpufrac in one command.
#
#   ./demo.sh          a memory cap: a program allocates 256 MiB blocks until
#                      the driver says no, once as it is and once under
#                      `gpufrac run --gpu-memory 4G` (on the GPU if there is
#                      one, else on the simulated driver)
#   ./demo.sh shares   compute shares and priority classes on a simulated GPU
#                      (no GPU needed): two jobs at 70% and 30%, then an
#                      interactive job at high beside a normal and a low one
#   ./demo.sh top      gpufrac top on a simulated GPU (no GPU needed): two jobs
#                      at 70% and 30% converging to their shares, and a third,
#                      queued behind them, that starts when the first ends
#   ./demo.sh env      builds the simulated driver and prints the exports that
#                      put a shell on it:  eval "$(./demo.sh env)"
#   ./demo.sh container
#                      the memory cap on a sealed container image, with Podman
#                      or Docker, on the simulated driver (no GPU, no NVIDIA
#                      container toolkit): the same program in a Debian image,
#                      as it is and under `gpufrac docker-args --gpu-memory 4G`
#
# GPUFRAC_DEMO_IMAGE=IMAGE runs the container demo in a local image of yours
# (one with glibc 2.28 or newer); without it the demo makes one, once, with
# mmdebstrap (Debian's essential packages, about 140 MB from a mirror).
# GPUFRAC_DEMO_ENGINE=podman|docker chooses the engine (default: podman when
# it is installed and can run a container here, else docker). Where the
# engine's runtime is crun and crun cannot run (hybrid cgroups), the demo
# runs runc; where nothing can run, it says in one line what to install or
# start.
#
# GPUFRAC_DEMO_PROFILE=debug builds and runs the debug profile instead of
# release (a quicker first build; the test suite runs the demo that way).
set -euo pipefail
cd "$(dirname "$0")"

what=${1:-cap}
profile=${GPUFRAC_DEMO_PROFILE:-release}
case $profile in
  release) profile_flag=(--release) ;;
  debug) profile_flag=() ;;
  *) echo "GPUFRAC_DEMO_PROFILE=$profile: expected release or debug" >&2; exit 2 ;;
esac
cargo=${CARGO:-cargo}
# Where cargo puts them (CARGO_TARGET_DIR, if set, is relative to here).
mkdir -p "${CARGO_TARGET_DIR:-target}"
bin=$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/$profile

# Progress goes to stderr, so that `eval "$(./demo.sh env)"` reads only the
# exports.
say() { echo "$@" >&2; }

# Whether this is a first build: an output missing. Only then does build
# say what a build costs; a later one is incremental, and cargo shows what
# it compiles, if anything.
needs_build() {
  local outs=("$bin/libgpufrac.so" "$bin/libgpufrac_sim.so") o
  if [ -n "${1:-}" ]; then outs+=("$bin/gpufrac" "$bin/examples/$1"); fi
  for o in "${outs[@]}"; do
    [ -e "$o" ] || return 0
  done
  return 1
}

# The shim, the simulated CUDA driver (sim/) and, given an example's name,
# gpufrac and that example. Cargo shows what it compiles as it goes. The
# simulated driver, libgpufrac_sim.so, goes where the dynamic loader looks
# for libcuda.so.1 and libnvidia-ml.so.1.
build() {
  if needs_build "${1:-}"; then
    say "== Building ${1:+gpufrac, the $1 example, }the shim and the simulated driver ($profile;"
    say "   the first build compiles gpufrac and its dependencies, which takes what the CPU has:"
    say "   under 2 minutes on an idle machine, 14 or more on 2 cores busy with other work)"
  fi
  # Two invocations, as the tests build them: a target filter such as
  # --bins would apply to the libraries too. The shim with gpufrac, as
  # `cargo build --release` and a release build it: built alone, it would
  # take gpufrac-common with other features, and each of those builds would
  # compile it again after this one.
  "$cargo" build "${profile_flag[@]}" -p gpufrac -p gpufrac-shim -p gpufrac-sim
  if [ -n "${1:-}" ]; then
    "$cargo" build "${profile_flag[@]}" -p gpufrac --bins --example "$1"
  fi
  mkdir -p "$bin/sim-driver"
  for n in libcuda.so.1 libcuda.so libnvidia-ml.so.1; do
    ln -sf ../libgpufrac_sim.so "$bin/sim-driver/$n"
  done
}

# Puts this script on the simulated driver with devices of these sizes.
use_sim() {
  export LD_LIBRARY_PATH="$bin/sim-driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export GPUFRAC_SIM_DEVICES=$1
}

# GPU time (s) a `loadgen batch` printed.
executed_s() { awk '/^batch /{for (i = 2; i <= NF; i++) if ($i ~ /^executed_ns=/) {sub(/^executed_ns=/, "", $i); printf "%.2f", $i / 1e9}}' "$1"; }
# A field of a `loadgen interactive` line, in ms.
latency_ms() { awk -v k="$2" '/^interactive /{for (i = 2; i <= NF; i++) if (index($i, k "=") == 1) {sub(/^[^=]*=/, "", $i); printf "%.2f", $i / 1000}}' "$1"; }
percent() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (a + b > 0) ? 100 * a / (a + b) : 0 }'; }

cap() {
  build cudarc_alloc
  if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
    echo "== NVIDIA driver found: running on the real GPU"
  else
    echo "== No NVIDIA driver (libcuda.so.1) on this machine, so there is no real GPU to cap."
    echo "== Running the same program against gpufrac's simulated driver instead"
    echo "   (the one the test suite uses: two devices of 16 GiB and 8 GiB, host bookkeeping only)."
    use_sim 16G,8G
    echo "== Simulated driver settings (docs/simulator.md):"
    echo "   LD_LIBRARY_PATH=$bin/sim-driver (libcuda.so.1, libnvidia-ml.so.1 -> libgpufrac_sim.so)"
    echo "   GPUFRAC_SIM_DEVICES=$GPUFRAC_SIM_DEVICES (device sizes)"
  fi
  echo
  echo "== without gpufrac (stops at 64 blocks = 16 GiB, or when the device is full):"
  "$bin/examples/cudarc_alloc" --block 256 --max 64
  echo
  echo "== gpufrac run --gpu-memory 4G (expect 16 blocks = 4 GiB, then CUDA_ERROR_OUT_OF_MEMORY, and a 4 GiB device):"
  "$bin/gpufrac" run --gpu-memory 4G -- "$bin/examples/cudarc_alloc" --block 256 --max 64
}

env_exports() {
  build
  printf 'export LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n' "$bin/sim-driver"
  printf 'export GPUFRAC_SIM_DEVICES=16G,8G\n'
  # One execution engine for every process of this shell, as on one GPU.
  printf 'export GPUFRAC_SIM_STATE=%q\n' "$bin/sim-driver/state"
  say "== The simulated driver: two GPUs of 16 GiB and 8 GiB (docs/simulator.md)."
}

shares() {
  build loadgen
  # Nothing from the caller's environment may change what the demo shows.
  while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(GPU_|GPUFRAC_)' || true)
  use_sim 16G
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpufrac-demo.XXXXXX")
  export GPUFRAC_SIM_STATE=$tmp/sim-state GPUFRAC_SOCKET=$tmp/broker.sock
  local gpufrac=$bin/gpufrac loadgen=$bin/examples/loadgen
  # Its state (leases, the queue) in the demo's own directory, gone with it.
  "$gpufrac" broker --state-dir "$tmp/state" 2>"$tmp/broker.log" &
  broker=$!
  trap 'kill $broker 2>/dev/null; wait $broker 2>/dev/null; rm -rf "$tmp"' EXIT
  until "$gpufrac" status >/dev/null 2>&1; do
    if ! kill -0 "$broker" 2>/dev/null; then
      cat "$tmp/broker.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "== A simulated 16 GiB GPU that time-slices processes like a real one, and a broker"
  echo "   on $GPUFRAC_SOCKET (loadgen runs 1 ms kernels back to back; see docs/simulator.md)."
  echo
  echo "== 1. Shares: two jobs, each busy for 8 seconds"
  echo "   gpufrac run --gpu-compute 70% -- loadgen batch 1000 +1 +9 &"
  echo "   gpufrac run --gpu-compute 30% -- loadgen batch 1000 +1 +9 &"
  "$gpufrac" run --gpu-compute 70% -- "$loadgen" batch 1000 +1 +9 >"$tmp/70" &
  local a=$!
  "$gpufrac" run --gpu-compute 30% -- "$loadgen" batch 1000 +1 +9 >"$tmp/30" &
  local b=$!
  sleep 5
  echo "   gpufrac status, halfway:"
  "$gpufrac" status | sed 's/^/   | /'
  wait "$a" "$b"
  local ta tb
  ta=$(executed_s "$tmp/70")
  tb=$(executed_s "$tmp/30")
  echo "   asked 70%: got $(percent "$ta" "$tb")% of the GPU time ($ta s)"
  echo "   asked 30%: got $(percent "$tb" "$ta")% of the GPU time ($tb s)"
  echo "   (The same two without gpufrac split it about evenly, as a GPU's own time-slicer does.)"
  echo
  echo "== 2. Priorities: an interactive job (10 kernels of 50 us every 20 ms, a notebook or an"
  echo "   inference server), first alone for 3 seconds, then at high beside two busy batch jobs,"
  echo "   one at normal and a scavenger at low, for 6 seconds"
  echo "   gpufrac run --priority high -- loadgen interactive 10 50 20000 +1 +7 &"
  echo "   gpufrac run -- loadgen batch 1000 +1 +7 &"
  echo "   gpufrac run --priority low -- loadgen batch 1000 +1 +7 &"
  "$gpufrac" run --priority high -- "$loadgen" interactive 10 50 20000 +0.5 +3.5 >"$tmp/alone"
  "$gpufrac" run --priority high -- "$loadgen" interactive 10 50 20000 +1 +7 >"$tmp/high" &
  a=$!
  "$gpufrac" run -- "$loadgen" batch 1000 +1 +7 >"$tmp/normal" &
  b=$!
  "$gpufrac" run --priority low -- "$loadgen" batch 1000 +1 +7 >"$tmp/low" &
  local c=$!
  wait "$a" "$b" "$c"
  local tn tl
  tn=$(executed_s "$tmp/normal")
  tl=$(executed_s "$tmp/low")
  echo "   high, interactive: p50 $(latency_ms "$tmp/high" p50_us) ms, p99 $(latency_ms "$tmp/high" p99_us) ms per request" \
    "(alone: p50 $(latency_ms "$tmp/alone" p50_us) ms, p99 $(latency_ms "$tmp/alone" p99_us) ms)"
  echo "   normal, batch: $tn s of GPU time in the 6 s"
  echo "   low, batch: $tl s of GPU time in the 6 s (it runs only on time nobody else wants)"
  echo
  echo "== Figures measured with more care, against the GPU's own time-slicing: docs/benchmarks.md"
}

# gpufrac top, live when this runs in a terminal (q leaves it), else a
# frame printed at two moments.
top() {
  build loadgen
  "$cargo" build "${profile_flag[@]}" -p gpufrac --example probe
  while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(GPU_|GPUFRAC_)' || true)
  use_sim 16G
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpufrac-demo.XXXXXX")
  export GPUFRAC_SIM_STATE=$tmp/sim-state GPUFRAC_SOCKET=$tmp/broker.sock
  local gpufrac=$bin/gpufrac loadgen=$bin/examples/loadgen probe=$bin/examples/probe
  # Its state (leases, the queue) in the demo's own directory, gone with it.
  "$gpufrac" broker --state-dir "$tmp/state" 2>"$tmp/broker.log" &
  broker=$!
  jobs_pids=()
  # Each step may find its process gone already: none may stop the rest
  # (set -e holds in a trap too). The jobs' processes that outlive their
  # run end with the directory their stop files are in.
  trap 'kill "${jobs_pids[@]}" 2>/dev/null || true; wait "${jobs_pids[@]}" 2>/dev/null || true
        kill $broker 2>/dev/null || true; wait $broker 2>/dev/null || true; rm -rf "$tmp"' EXIT
  until "$gpufrac" status >/dev/null 2>&1; do
    if ! kill -0 "$broker" 2>/dev/null; then
      cat "$tmp/broker.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  # Each job: a process holding memory and one keeping the GPU busy
  # (1 ms kernels back to back) for SECONDS; the job ends with the latter.
  # Stopped early (gpufrac run forwards the signal to its shell), the
  # shell stops both: they outlived the demo by up to 10 s.
  job() {
    local mem=$1 held=$2 seconds=$3
    shift 3
    "$gpufrac" run --gpu-memory "$mem" "$@" -- sh -c '
      trap '"'"'kill $pr $lg 2>/dev/null; exit 143'"'"' TERM INT
      "$1" ctx alloc alloc "$2" wait-file "$4.$$" >/dev/null & pr=$!
      "$3" batch 1000 +1 "+$5" >/dev/null & lg=$!
      wait $lg
      touch "$4.$$"; wait' job "$probe" "$held" "$loadgen" "$tmp/stop" "$seconds" >/dev/null 2>&1 &
    jobs_pids+=($!)
  }
  echo "== A simulated 16 GiB GPU and a broker on $GPUFRAC_SOCKET (docs/simulator.md)."
  echo "   gpufrac run --gpu-memory 6G --gpu-compute 70% -- (2 GiB held, 16 s busy) &"
  echo "   gpufrac run --gpu-memory 8G --gpu-compute 30% -- (1 GiB held, 32 s busy) &"
  echo "   gpufrac run --gpu-memory 8G -- (512 MiB held, 16 s busy)   # queued: 14 GiB are committed"
  job 6G 2G 16 --gpu-compute 70%
  job 8G 1G 32 --gpu-compute 30%
  sleep 0.5
  job 8G 512M 16
  if [ -t 0 ] && [ -t 1 ]; then
    echo "== gpufrac top: the two jobs converge to 70% and 30%; when the first ends (16 s),"
    echo "   the queued one starts. Keys: ? help, t flat, Tab queue, Enter detail, q quit."
    sleep 3
    "$gpufrac" top
  else
    sleep 8
    echo "== gpufrac top --once, 8 s in: the two jobs at their shares, the third queued"
    "$gpufrac" top --once --size 100x24
    sleep 14
    echo "== gpufrac top --once, 22 s in: the first job is done, the queued one runs"
    "$gpufrac" top --once --size 100x24
  fi
}

# crun refuses to start a container on hybrid cgroups (v1 controllers, with
# cgroup v2 mounted at /sys/fs/cgroup/unified) as soon as v2 holds any
# controller ("cgroups in hybrid mode not supported"); runc runs there. The
# controllers v2 holds, when crun cannot run, else nothing.
crun_refuses() {
  [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ] || return 0
  [ "$(stat -fc %T /sys/fs/cgroup/unified 2>/dev/null)" = cgroup2fs ] || return 0
  cat /sys/fs/cgroup/unified/cgroup.controllers 2>/dev/null || true
}

# Whether ENGINE can run the demo's containers on this host, choosing runc
# where the engine's runtime is crun and crun cannot run here. Sets
# engine_cmd (the CLI and its global options) and run_opts (options of its
# `run`), and says which runtime it chose and why; else sets why_not to
# one line saying what to install or run.
engine_works() {
  local engine=$1 err rt held
  engine_cmd=("$engine") run_opts=() why_not=
  held=$(crun_refuses)
  case $engine in
    podman)
      if ! err=$(podman info 2>&1 >/dev/null); then
        why_not="'podman info' fails: $(tail -n 1 <<<"$err")"
        return 1
      fi
      rt=$(podman info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null || true)
      if [ "$rt" = crun ] && [ -n "$held" ]; then
        # Without --format, podman info succeeds with runc missing or
        # unusable; the runtime's own fields are there only when it runs.
        if [ "$(podman --runtime runc info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null)" != runc ]; then
          why_not="Podman's runtime crun cannot run on this host's hybrid cgroups (cgroup v2 holds $held) and runc is not installed: apt-get install runc"
          return 1
        fi
        engine_cmd+=(--runtime runc)
        echo "== Podman's runtime crun cannot run on this host's hybrid cgroups (cgroup v2 holds $held): using runc"
      fi
      ;;
    docker)
      if ! err=$(docker info 2>&1 >/dev/null); then
        if grep -qi 'permission denied' <<<"$err"; then
          why_not="Docker's daemon refuses this user (permission denied): run as root, or join the group docker"
        elif grep -qi 'cannot connect' <<<"$err"; then
          if [ -d /run/systemd/system ]; then
            why_not="Docker's daemon is not running${DOCKER_HOST:+ on $DOCKER_HOST}: systemctl start docker"
          else
            why_not="Docker's daemon is not running${DOCKER_HOST:+ on $DOCKER_HOST}, and this host has no systemd to start it: run (as root) dockerd >/var/log/dockerd.log 2>&1 &"
          fi
        else
          why_not="'docker info' fails: $(tail -n 1 <<<"$err")"
        fi
        return 1
      fi
      rt=$(docker info --format '{{.DefaultRuntime}}' 2>/dev/null || true)
      if [ "$rt" = crun ] && [ -n "$held" ]; then
        if ! docker info --format '{{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>/dev/null | grep -qw runc; then
          why_not="Docker's runtime crun cannot run on this host's hybrid cgroups (cgroup v2 holds $held) and its daemon knows no runc: apt-get install runc, then add it to the daemon's runtimes"
          return 1
        fi
        run_opts+=(--runtime runc)
        echo "== Docker's runtime crun cannot run on this host's hybrid cgroups (cgroup v2 holds $held): using runc"
      fi
      ;;
  esac
}

# The memory cap on a sealed image: nothing of gpufrac's is in the image; the
# shim comes in by the flags `gpufrac docker-args` prints, and the simulated
# driver (in place of a GPU and NVIDIA's container toolkit) and the program
# by read-only mounts.
container() {
  local engines=() e engine= whys=()
  if [ -n "${GPUFRAC_DEMO_ENGINE:-}" ]; then
    case $GPUFRAC_DEMO_ENGINE in
      podman | docker) ;;
      *) echo "GPUFRAC_DEMO_ENGINE=$GPUFRAC_DEMO_ENGINE: expected podman or docker" >&2; exit 2 ;;
    esac
    if ! command -v "$GPUFRAC_DEMO_ENGINE" >/dev/null 2>&1; then
      echo "./demo.sh container: GPUFRAC_DEMO_ENGINE=$GPUFRAC_DEMO_ENGINE, which is not installed" \
        "(apt-get install $([ "$GPUFRAC_DEMO_ENGINE" = docker ] && echo docker.io || echo podman))" >&2
      exit 1
    fi
    engines=("$GPUFRAC_DEMO_ENGINE")
  else
    for e in podman docker; do
      if command -v "$e" >/dev/null 2>&1; then engines+=("$e"); fi
    done
    if [ ${#engines[@]} = 0 ]; then
      echo "./demo.sh container needs Podman or Docker (apt-get install podman runc)" >&2
      exit 1
    fi
  fi
  # The first that can run a container here; each that cannot says why.
  for e in "${engines[@]}"; do
    if engine_works "$e"; then
      engine=$e
      break
    fi
    whys+=("./demo.sh container: $why_not")
  done
  if [ -z "$engine" ]; then
    printf '%s\n' "${whys[@]}" >&2
    exit 1
  fi
  if [ ${#whys[@]} -gt 0 ]; then
    printf '%s\n' "${whys[@]}"
    echo "== so using $engine"
  fi
  build cudarc_alloc
  local image=${GPUFRAC_DEMO_IMAGE:-gpufrac-demo:bookworm}
  if [ -z "${GPUFRAC_DEMO_IMAGE:-}" ] && ! "${engine_cmd[@]}" image inspect "$image" >/dev/null 2>&1; then
    if ! command -v mmdebstrap >/dev/null 2>&1; then
      echo "./demo.sh container: no image $image yet, and mmdebstrap (which makes one) is" >&2
      echo "not installed: apt-get install mmdebstrap, or GPUFRAC_DEMO_IMAGE=IMAGE for one of yours" >&2
      exit 1
    fi
    local tar=$bin/demo-bookworm.tar
    if [ ! -f "$tar" ]; then
      echo "== Making the image once: Debian bookworm's essential packages with mmdebstrap"
      echo "   (about 140 MB from a Debian mirror) into $tar"
      mmdebstrap --variant=essential --format=tar bookworm "$tar.part" >&2
      mv "$tar.part" "$tar"
    fi
    "${engine_cmd[@]}" import "$tar" "$image" >/dev/null
  fi
  use_sim 16G,8G
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpufrac-demo.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # The simulated GPUs are the host's: one state file, mounted at its path.
  local sim=(
    -v "$bin/libgpufrac_sim.so:/gpufrac-demo/lib/libcuda.so.1:ro"
    -v "$bin/libgpufrac_sim.so:/gpufrac-demo/lib/libnvidia-ml.so.1:ro"
    -e LD_LIBRARY_PATH=/gpufrac-demo/lib
    -e GPUFRAC_SIM_DEVICES=16G,8G
    -v "$tmp:$tmp" -e "GPUFRAC_SIM_STATE=$tmp/sim-state"
    -v "$bin/examples/cudarc_alloc:/gpufrac-demo/alloc:ro"
  )
  # Podman's default limits (1048576 files) are above the hard limits of
  # many machines, where its containers then fail to start; the program
  # needs few.
  local run=(run --rm --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 "${run_opts[@]}")
  local flags
  mapfile -t flags < <("$bin/gpufrac" docker-args --gpu-memory 4G --socket "$tmp/broker.sock")
  echo "== $engine, image $image (nothing of gpufrac's in it); the simulated driver and the"
  echo "   program mounted in, as a GPU and NVIDIA's container toolkit would be."
  echo
  echo "== $engine run IMAGE alloc (stops at 64 blocks = 16 GiB):"
  "${engine_cmd[@]}" "${run[@]}" "${sim[@]}" "$image" /gpufrac-demo/alloc --block 256 --max 64
  echo
  echo "== $engine run \$(gpufrac docker-args --gpu-memory 4G) IMAGE alloc (expect 16 blocks = 4 GiB):"
  printf '   gpufrac docker-args said:'
  printf ' %s' "${flags[@]}"
  echo
  "${engine_cmd[@]}" "${run[@]}" "${flags[@]}" "${sim[@]}" "$image" /gpufrac-demo/alloc --block 256 --max 64
}

case $what in
  cap) cap ;;
  shares) shares ;;
  top) top ;;
  env) env_exports ;;
  container) container ;;
  -h|--help|help) sed -n '2,/^set -e/{/^#/s/^# \{0,1\}//p;}' "$0" ;;
  *) echo "./demo.sh: unknown demo '$what'; expected cap (the default), shares, top, env or container" >&2; exit 2 ;;
esac
