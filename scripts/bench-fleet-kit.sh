#!/usr/bin/env bash
# The fleet benchmark on a machine with no Rust toolchain, such as a lent
# machine with more cores than this one: what bounds the recorder when its
# writer threads have cores to spare is a question this 2-core machine
# cannot answer by measuring.
#
#   bash scripts/bench-fleet-kit.sh prepare   # here: build, strip, gather
#   bash scripts/bench-fleet-kit.sh run       # there, from the repository root
#
# `prepare` builds the bench and the recorder (release), strips them and
# puts them with `nats-server` (scripts/setup-nats.sh) in
# target/fleet-bench-kit (about 37 MB: small enough to carry to another
# machine). `run` runs the bench from that kit RUNS times (default 2) with
# the recording on disk, then once with it on a tmpfs (/dev/shm) and once
# on disk with the writer threads' queues QUEUE deep (default 64), each run's
# tables, and the recorder's CPU by thread (scripts/thread-cpu.py), into
# $OUT (default: the current directory) and onto stdout. The
# recorder's arguments, the events per engine and a smoke run are the
# bench's own variables (KVBM_FLEET_RECORDER_ARGS, KVBM_FLEET_PER_ENGINE,
# KVBM_BENCH_QUICK), passed through.
set -euo pipefail

KIT=target/fleet-bench-kit

die() {
  echo "bench-fleet-kit: $*" >&2
  exit 1
}

prepare() {
  command -v strip >/dev/null || die "strip (binutils) is needed"
  local nats bench
  nats="$(bash scripts/setup-nats.sh)"
  cargo build --release -p kvbm-recorder --bin kvbm-recorder
  # The bench's executable, as cargo names it (target/release/deps/fleet-HASH).
  bench="$(cargo bench -p kvbm-recorder --bench fleet --no-run --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "fleet" and m.get("executable"):
        print(m["executable"])
')"
  [[ -n "$bench" && -x "$bench" ]] || die "cargo named no fleet bench executable"
  rm -rf "$KIT"
  mkdir -p "$KIT"
  cp "$bench" "$KIT/fleet"
  cp target/release/kvbm-recorder "$KIT/kvbm-recorder"
  cp "$nats" "$KIT/nats-server"
  strip "$KIT/fleet" "$KIT/kvbm-recorder"
  du -sh "$KIT"
  echo "carry $KIT to the other machine, then: bash scripts/bench-fleet-kit.sh run"
}

run() {
  local f out="${OUT:-.}"
  for f in fleet kvbm-recorder nats-server; do
    [[ -x "$KIT/$f" ]] || die "$KIT/$f is missing: run 'prepare' on a machine with cargo first"
  done
  mkdir -p "$out"
  export KVBM_BIN_KVBM_RECORDER="$PWD/$KIT/kvbm-recorder"
  export KVBM_NATS_SERVER="$PWD/$KIT/nats-server"
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
}

# One run of the bench into $1, with the recorder's CPU by thread after its
# tables (scripts/thread-cpu.py: such a machine has no perf to say which
# thread bounds the recorder).
bench() {
  python3 scripts/thread-cpu.py kvbm-recorder >"$1.threads" &
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
  *) die "usage: bash scripts/bench-fleet-kit.sh prepare|run" ;;
esac
