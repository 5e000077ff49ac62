#!/usr/bin/env bash
# The fleet benchmark on a machine with no Rust toolchain, such as a lent
# machine with more cores than this one: what bounds the recorder when its
# writer threads have cores to spare is a question this 2-core machine
# cannot answer by measuring.
#
#   bash bench/bench-fleet-kit.sh prepare   # here: build, strip, gather
#   bash bench/bench-fleet-kit.sh run       # there, from the repository root
#   bash bench/bench-fleet-kit.sh scaling   # there: the check, N at once
#   bash bench/bench-fleet-kit.sh variants  # there: recorder arguments
#
# `prepare` builds the fleet bench, the events bench (the emitter's cost
# and the clock's) and the recorder (release), strips them and puts them
# with `nats-server` (scripts/setup-nats.sh) in target/fleet-bench-kit
# (about 40 MB: small enough to carry to another machine). `run` runs the
# fleet bench from that kit RUNS times (default 2) with the recording on
# disk, then once with it on a tmpfs (/dev/shm) and once on disk with the
# writer threads' queues QUEUE deep (default 64), each run's tables, and
# the recorder's CPU by thread (bench/thread-cpu.py), into $OUT
# (default: the current directory) and onto stdout; then the events bench
# (EVENTS= skips it); then, if LONG names the events per engine and fewer
# than LONG_BEFORE_S seconds (default 400) have gone by, one longer run on
# disk. The recorder's arguments, the events per engine and a smoke run
# are the bench's own variables (KVBM_FLEET_RECORDER_ARGS,
# KVBM_FLEET_PER_ENGINE, KVBM_BENCH_QUICK), passed through.
set -euo pipefail

KIT=target/fleet-bench-kit

die() {
  echo "bench-fleet-kit: $*" >&2
  exit 1
}

prepare() {
  command -v strip >/dev/null || die "strip (binutils) is needed"
  local nats fleet events
  nats="$(bash scripts/setup-nats.sh)"
  cargo build --release -p kvbm-cli --bin kvbm-recorder
  fleet="$(bench_executable kvbm-recorder fleet)"
  events="$(bench_executable kvbm-sim events)"
  rm -rf "$KIT"
  mkdir -p "$KIT"
  cp "$fleet" "$KIT/fleet"
  cp "$events" "$KIT/events"
  cp target/release/kvbm-recorder "$KIT/kvbm-recorder"
  cp "$nats" "$KIT/nats-server"
  strip "$KIT/fleet" "$KIT/events" "$KIT/kvbm-recorder"
  du -sh "$KIT"
  echo "carry $KIT to the other machine, then: bash bench/bench-fleet-kit.sh run"
}

# The executable of bench $2 of package $1, built, as cargo names it
# (target/release/deps/NAME-HASH).
bench_executable() {
  local exe
  exe="$(cargo bench -p "$1" --bench "$2" --no-run --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])
' "$2")"
  [[ -n "$exe" && -x "$exe" ]] || die "cargo named no $2 bench executable"
  echo "$exe"
}

# Checks the kit is whole and points the bench at its recorder and
# nats-server.
use_kit() {
  local f
  for f in fleet kvbm-recorder nats-server; do
    [[ -x "$KIT/$f" ]] || die "$KIT/$f is missing: run 'prepare' on a machine with cargo first"
  done
  export KVBM_BIN_KVBM_RECORDER="$PWD/$KIT/kvbm-recorder"
  export KVBM_NATS_SERVER="$PWD/$KIT/nats-server"
}

run() {
  local out="${OUT:-.}"
  use_kit
  mkdir -p "$out"
  nproc
  "$KVBM_NATS_SERVER" --version
  local i
  for ((i = 1; i <= ${RUNS:-2}; i++)); do
    echo "== run $i, the recording on disk ($(df --output=fstype "${TMPDIR:-/tmp}" | tail -1))"
    bench "$out/fleet-disk-$i.txt"
  done
  [[ -d /dev/shm ]] || die "no /dev/shm for the tmpfs run"
  echo "== the recording on tmpfs (/dev/shm)"
  KVBM_FLEET_OUT=/dev/shm bench "$out/fleet-tmpfs.txt"
  # Then on disk with deeper writer queues: whether a full queue holding
  # back the receiving bounds the recorder there (QUEUE= skips it).
  local queue="${QUEUE-64}"
  if [[ -n "$queue" ]]; then
    echo "== the recording on disk, --writer-queue $queue"
    KVBM_FLEET_RECORDER_ARGS="${KVBM_FLEET_RECORDER_ARGS:-} --writer-queue $queue" \
      bench "$out/fleet-disk-queue-$queue.txt"
  fi
  if [[ -n "${EVENTS-1}" && -x "$KIT/events" ]]; then
    echo "== the events bench"
    "$KIT/events" --bench | tee "$out/events.txt"
  fi
  # A longer run, while there is time for it (a lent machine's time is
  # short): what the recorder's start and closing weigh in a short run.
  if [[ -n "${LONG:-}" ]]; then
    if ((SECONDS < ${LONG_BEFORE_S:-400})); then
      echo "== the recording on disk, $LONG events per engine"
      KVBM_FLEET_PER_ENGINE="$LONG" bench "$out/fleet-disk-long.txt"
    else
      echo "== no time left for the longer run ($SECONDS s gone)"
    fi
  fi
}

# The recorder's check (decompress, verify, validate: the fleet bench's
# KVBM_FLEET_PHASES=1 mode, one thread, no NATS) run by 1, 4, 8... copies
# at once (COUNTS), each copy PASSES times over: whether a core's checking
# slows when the others check too (shared cores, caches, memory), which
# no single-threaded figure shows. Prints the median ns an event of each
# part over every copy and pass, by how many ran at once.
scaling() {
  use_kit
  local tmp n i p
  tmp="$(mktemp -d)"
  echo "| copies at once | lz4 ns/event | verify ns/event | validate ns/event | check ns/event (all parts) |"
  echo "|---:|---:|---:|---:|---:|"
  for n in ${COUNTS:-1 4 8 12 16}; do
    for ((i = 0; i < n; i++)); do
      (for ((p = 0; p < ${PASSES:-5}; p++)); do
        KVBM_FLEET_PHASES=1 "$KIT/fleet" --bench
      done) >"$tmp/$n.$i" 2>&1 &
    done
    wait
    cat "$tmp/$n".* | python3 -c '
import statistics, sys
parts = {}
for line in sys.stdin:
    name, sep, rest = line.strip().partition(":")
    if sep and rest.strip().endswith("ns/event"):
        parts.setdefault(name, []).append(float(rest.split()[0]))
med = lambda k: "%.2f" % statistics.median(parts[k]) if k in parts else "-"
print("| %s | %s | %s | %s | %s |" % (sys.argv[1], med("lz4"), med("verify"), med("validate"), med("check")))
' "$n"
  done
  rm -rf "$tmp"
}

# The bench once per variant of the recorder's arguments (VARIANTS,
# separated by ';'), the recording on a tmpfs, each into
# $OUT/fleet-variant-N.txt, while fewer than VARIANTS_BEFORE_S seconds
# (default 400) have gone by; e.g. whether fewer wakes of idle writer
# threads or larger pull requests speed the recorder there:
#   VARIANTS='--handoff-batch 1;--handoff-batch 16;--pull-batch 1024' \
#     bash bench/bench-fleet-kit.sh variants
variants() {
  local out="${OUT:-.}" v i=0
  use_kit
  mkdir -p "$out"
  IFS=';' read -r -a vs <<<"${VARIANTS:?name the recorder arguments to try, separated by ;}"
  for v in "${vs[@]}"; do
    i=$((i + 1))
    if ((SECONDS >= ${VARIANTS_BEFORE_S:-400})); then
      echo "== no time left for: $v ($SECONDS s gone)"
      continue
    fi
    echo "== variant $i, the recording on tmpfs: $v"
    KVBM_FLEET_OUT=/dev/shm KVBM_FLEET_RECORDER_ARGS="$v" bench "$out/fleet-variant-$i.txt"
  done
}

# One run of the bench into $1, with the recorder's CPU by thread after its
# tables (bench/thread-cpu.py: such a machine has no perf to say which
# thread bounds the recorder).
bench() {
  python3 bench/thread-cpu.py kvbm-recorder >"$1.threads" &
  local sampler=$!
  "$KIT/fleet" --bench | tee "$1"
  kill -TERM "$sampler"
  wait "$sampler" || true
  echo "the recorder's CPU by thread (the file store's run first):" | tee -a "$1"
  tee -a "$1" <"$1.threads"
  rm -f "$1.threads"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  scaling) scaling ;;
  variants) variants ;;
  *) die "usage: bash bench/bench-fleet-kit.sh prepare|run|scaling|variants" ;;
esac
