#!/usr/bin/env bash
# bench-fleet-slow-disk.sh — the fleet bench (kvbm-recorder/benches/fleet.rs)
# with the recorder's writes to disk throttled, as on a slower device than
# this machine's: what its fsyncs cost when the device, not the CPU, is the
# bound.
#
# Only the recorder process is throttled (a block-I/O cgroup it moves
# itself into before it starts), so publishing, `nats-server` and the
# counting consumer run as usual. The throttle applies to the writes its
# fsyncs issue: the bench's 236.5 MB take at least 236.5 / MBPS seconds to
# reach the device, a ceiling on what a durable recorder can keep up with.
#
# Needs root and a cgroup block-I/O controller: cgroup v1 `blkio`
# (blkio.throttle.write_bps_device) or cgroup v2 `io` (io.max).
#
# Usage: bash bench/bench-fleet-slow-disk.sh [MBPS]   (default 400)
# Environment: KVBM_NATS_SERVER (else scripts/setup-nats.sh installs it),
# and the bench's own knobs (KVBM_FLEET_PER_ENGINE, …).
set -Eeuo pipefail

MBPS="${1:-400}"
[[ "$MBPS" =~ ^[1-9][0-9]*$ ]] || { echo "MBPS must be a positive integer, not '$MBPS'" >&2; exit 2; }
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

die() { printf '[slow-disk] ERROR: %s\n' "$*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "needs root (a cgroup's I/O throttle)"

# The device the recorder's temporary directory lives on.
TMP="${TMPDIR:-/tmp}"
DEV="$(findmnt -n -o SOURCE --target "$TMP")"
[[ -b "$DEV" ]] || die "$TMP is on $DEV, not a block device"
# A partition's throttle is its disk's.
DISK="/dev/$(lsblk -n -o PKNAME "$DEV" 2>/dev/null | head -n 1)"
[[ -b "$DISK" ]] || DISK="$DEV"
MAJMIN="$(lsblk -n -d -o MAJ:MIN "$DISK" | tr -d ' ')"
BPS=$((MBPS * 1024 * 1024))

if [[ -d /sys/fs/cgroup/blkio ]]; then
  CG=/sys/fs/cgroup/blkio/kvbm-slow-disk
  mkdir -p "$CG"
  echo "$MAJMIN $BPS" > "$CG/blkio.throttle.write_bps_device"
elif [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw io /sys/fs/cgroup/cgroup.controllers; then
  CG=/sys/fs/cgroup/kvbm-slow-disk
  echo +io > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
  mkdir -p "$CG"
  echo "$MAJMIN wbps=$BPS" > "$CG/io.max"
else
  die "no block-I/O cgroup controller (blkio or io) on this machine"
fi
WRAP=""
trap 'rmdir "$CG" 2>/dev/null || true; [[ -z "$WRAP" ]] || rm -f "$WRAP"' EXIT

export KVBM_NATS_SERVER="${KVBM_NATS_SERVER:-$(bash scripts/setup-nats.sh)}"
cargo build --release -p kvbm-cli --bin kvbm-recorder >&2
WRAP="$(mktemp)"
cat > "$WRAP" <<EOF
#!/usr/bin/env bash
echo \$\$ > "$CG/cgroup.procs"
exec "$ROOT/target/release/kvbm-recorder" "\$@"
EOF
chmod +x "$WRAP"
echo "recorder writes throttled to $MBPS MiB/s on $DISK ($MAJMIN)"
KVBM_BIN_KVBM_RECORDER="$WRAP" cargo bench -p kvbm-cli --bench fleet
