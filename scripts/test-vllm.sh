#!/usr/bin/env bash
# kvbm's vLLM connector against a real vLLM (CPU backend, a tiny Llama):
# the KV oracle in seven configurations (one worker, tensor parallel 2, async
# scheduling, both, preemption, chunked prefill, disk only: logprobs bit for
# bit against vLLM's own prefix cache with a model whose outputs depend on
# the KV, and a corrupted load that must fail it), breakpoints, the
# recording, the observer (against vLLM alone, and beside vLLM's
# DecodeBenchConnector in its MultiConnector), bad configuration
# (kvbm-py/tests/vllm/run.py); the OpenAI server stopped with SIGTERM and
# with kill -9 (server_stop.py); the fleet through a real nats-server
# (vLLM's own events bridged: fleet_bridge.py; the connector's `publish`:
# fleet_publish.py), and the console attached to the running engine in
# tmux, with kvbm's tiers and as an observer (kvbm-py/tests/vllm/console.py); first,
# without an engine, the module against hostile arguments
# (kvbm-py/tests/vllm/api_inputs.py).
#
# Prepares what it needs: the vLLM environment (scripts/setup-vllm.sh, cached
# in ~/.cache/kvbm/vllm-venv), kvbm's Python package installed into it the way
# the README says (`pip install ./kvbm-py`), and kvbm-recorder and
# kvbm-console. All three are built in the dev profile: debug assertions and
# overflow checks on, and `cargo test` has built most of what they need
# already. Optimised, the Python module alone took 5 to 8 minutes of CI's 2
# cores from nothing (45 s in the dev profile after `cargo test`), and the two
# binaries 4.4 minutes. KVBM_TEST_PROFILE=release tests release builds of all
# three instead. About 30 minutes on 2 cores once the environment exists
# (each vLLM start takes 40-90 s; the oracle's seven take about 12).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-vllm.sh
VENV="${KVBM_VLLM_VENV:-$HOME/.cache/kvbm/vllm-venv}"
PY="$VENV/bin/python"

# maturin's build backend takes its cargo arguments from MATURIN_PEP517_ARGS;
# without them it builds optimised, as a user's `pip install` does.
PROFILE="${KVBM_TEST_PROFILE:-dev}"
case "$PROFILE" in
  dev) BIN=target/debug; export MATURIN_PEP517_ARGS="--profile dev" ;;
  release) BIN=target/release; unset MATURIN_PEP517_ARGS ;;
  *) echo "KVBM_TEST_PROFILE must be dev or release, not '$PROFILE'" >&2; exit 2 ;;
esac

echo "== installing kvbm into $VENV (pip install ./kvbm-py, $PROFILE profile)"
"$PY" -m pip install --disable-pip-version-check -q ./kvbm-py
# The module says how it was built: a check that maturin took the profile.
"$PY" - "$PROFILE" <<'EOF'
import sys, kvbm, kvbm.vllm
from kvbm import _kvbm
built = "dev" if _kvbm.DEBUG_BUILD else "release"
print("kvbm", kvbm.__version__, f"({built} build)", "from", kvbm.__file__)
if built != sys.argv[1]:
    sys.exit(f"asked for a {sys.argv[1]} build of kvbm-py, pip installed a {built} one")
EOF
# py-spy shows where an engine core was when server_stop.py finds it slow
# to handle SIGTERM; the test runs without it, saying so.
"$PY" -m pip install --disable-pip-version-check -q py-spy==0.4.3 \
  || echo "py-spy not installed: server_stop.py will not show a slow engine core's threads"
echo "== the module against inputs vLLM would never give (no engine)"
"$PY" kvbm-py/tests/vllm/api_inputs.py

echo "== building kvbm-recorder and kvbm-console ($PROFILE profile)"
# With the whole workspace's binaries and examples, features resolve as for
# `cargo test --workspace`, so what it built is reused as it is.
cargo build --profile "$PROFILE" -q --workspace --bins --examples

command -v tmux >/dev/null || { echo "tmux is needed (apt-get install tmux)" >&2; exit 1; }

echo "== the connector against vLLM"
"$PY" kvbm-py/tests/vllm/run.py --recorder "$BIN/kvbm-recorder"
echo "== vLLM's OpenAI server stopped with kill -9, then with SIGTERM"
"$PY" kvbm-py/tests/vllm/server_stop.py --recorder "$BIN/kvbm-recorder"
echo "== the fleet bridge: vLLM's own KV events onto NATS, into the fleet recorder"
NATS_BIN="$(bash scripts/setup-nats.sh)"
"$PY" kvbm-py/tests/vllm/fleet_bridge.py --recorder "$BIN/kvbm-recorder" --nats-server "$NATS_BIN"
echo "== the connector's publish: kvbm inside vLLM onto NATS, into the fleet recorder"
"$PY" kvbm-py/tests/vllm/fleet_publish.py --recorder "$BIN/kvbm-recorder" --nats-server "$NATS_BIN" \
  --console "$BIN/kvbm-console"
echo "== the console attached to vLLM, in tmux"
"$PY" kvbm-py/tests/vllm/console.py --console "$BIN/kvbm-console" --recorder "$BIN/kvbm-recorder"
echo "== the console attached to vLLM with kvbm as an observer (no tier of its own), in tmux"
"$PY" kvbm-py/tests/vllm/console.py --console "$BIN/kvbm-console" --recorder "$BIN/kvbm-recorder" --observer
echo "== the connector's cost guard: kvbm's threads and time per step beside a do-nothing connector"
"$PY" kvbm-py/tests/vllm/bench.py --guard --recorder "$BIN/kvbm-recorder"
