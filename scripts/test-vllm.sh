#!/usr/bin/env bash
# kvbm's vLLM connector against a real vLLM (CPU backend, a tiny
# random-weight Llama): correct bytes, breakpoints, the recording, bad
# configuration (kvbm-py/tests/vllm/run.py), the fleet through a real
# nats-server (vLLM's own events bridged: fleet_bridge.py; the connector's
# `publish`: fleet_publish.py), and the console attached to the running
# engine in tmux (kvbm-py/tests/vllm/console.py); first, without an engine,
# the module against hostile arguments (kvbm-py/tests/vllm/api_inputs.py).
#
# Prepares what it needs: the vLLM environment (scripts/setup-vllm.sh, cached
# in ~/.cache/kvbm/vllm-venv), kvbm's Python package installed into it the way
# the README says (`pip install ./kvbm-py`, an optimised build), and
# kvbm-recorder and kvbm-console built in the dev profile: debug assertions
# and overflow checks on, and `cargo test` has built most of it already (a
# release build of the two took 4.4 minutes of CI's 2 cores);
# KVBM_TEST_PROFILE=release tests release builds instead. About 11 minutes
# on 2 cores once the environment exists (each vLLM start takes ~40 s).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-vllm.sh
VENV="${KVBM_VLLM_VENV:-$HOME/.cache/kvbm/vllm-venv}"
PY="$VENV/bin/python"

echo "== installing kvbm into $VENV (pip install ./kvbm-py)"
"$PY" -m pip install --disable-pip-version-check -q ./kvbm-py
"$PY" -c 'import kvbm, kvbm.vllm; print("kvbm", kvbm.__version__, "from", kvbm.__file__)'
echo "== the module against inputs vLLM would never give (no engine)"
"$PY" kvbm-py/tests/vllm/api_inputs.py

PROFILE="${KVBM_TEST_PROFILE:-dev}"
case "$PROFILE" in
  dev) BIN=target/debug ;;
  release) BIN=target/release ;;
  *) echo "KVBM_TEST_PROFILE must be dev or release, not '$PROFILE'" >&2; exit 2 ;;
esac
echo "== building kvbm-recorder and kvbm-console ($PROFILE profile)"
cargo build --profile "$PROFILE" -q -p kvbm-recorder -p kvbm-console

command -v tmux >/dev/null || { echo "tmux is needed (apt-get install tmux)" >&2; exit 1; }

echo "== the connector against vLLM"
"$PY" kvbm-py/tests/vllm/run.py --recorder "$BIN/kvbm-recorder"
echo "== the fleet bridge: vLLM's own KV events onto NATS, into the fleet recorder"
NATS_BIN="$(bash scripts/setup-nats.sh)"
"$PY" kvbm-py/tests/vllm/fleet_bridge.py --recorder "$BIN/kvbm-recorder" --nats-server "$NATS_BIN"
echo "== the connector's publish: kvbm inside vLLM onto NATS, into the fleet recorder"
"$PY" kvbm-py/tests/vllm/fleet_publish.py --recorder "$BIN/kvbm-recorder" --nats-server "$NATS_BIN" \
  --console "$BIN/kvbm-console"
echo "== the console attached to vLLM, in tmux"
"$PY" kvbm-py/tests/vllm/console.py --console "$BIN/kvbm-console"
