#!/usr/bin/env python3
"""The workspace's dependency rules (docs/ARCHITECTURE.md), checked.

- Libraries below, programs on top: each library links only the workspace
  crates its layer allows (normal dependencies; tests may use more).
- The block manager links no server, socket, CLI or terminal crate; the
  console links no server; the vLLM connector (kvbm-py) links no
  simulator, plotting, CLI or ZMQ crate, and at most MAX_PY crates.
- Tiers are assembled in one place: only kvbm_core::assembly calls the
  unsafe TierLink::new (kvbm-core's own tests and benches aside).

Exits 1 naming each rule broken, with what broke it.
"""

import pathlib
import subprocess
import sys

# Workspace crates each one may link (normal dependencies).
ALLOWED = {
    "kvbm-events": set(),
    "kvbm-schema": {"kvbm-events"},
    "kvbm-core": {"kvbm-events", "kvbm-schema"},
    "kvbm-recorder": {"kvbm-events", "kvbm-schema"},
    "kvbm-attach": {"kvbm-events", "kvbm-schema"},
    "kvbm-ingest": {"kvbm-events", "kvbm-schema"},
    "kvbm-sim": {"kvbm-events", "kvbm-schema", "kvbm-core", "kvbm-attach"},
    "kvbm-testkit": set(),
}
# Crates a package must not reach at all (its whole normal tree).
FORBIDDEN = {
    "kvbm-core": {"axum", "hyper", "zeromq", "tokio-tungstenite", "clap", "ratatui"},
    "kvbm-console": {"axum"},
    "kvbm-py": {"kvbm-sim", "kvbm-ingest", "kvbm-cli", "plotters", "clap", "zeromq", "ratatui"},
}
MAX_PY = 150
# The one place that assembles tiers: outside kvbm-core's own tests and
# benches, only kvbm_core::assembly may call the unsafe TierLink::new.
ASSEMBLY = "kvbm-core/src/assembly.rs"
LINK_ALLOWED_UNDER = ("kvbm-core/tests/", "kvbm-core/benches/", "kvbm-core/src/link.rs")


def tree(package, *extra):
    out = subprocess.run(
        ["cargo", "tree", "-p", package, "-e", "normal", "--prefix", "none", *extra],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # (name, version): two versions of a crate are two crates to build.
    return {tuple(line.split()[:2]) for line in out.splitlines() if line.strip()}


def direct(package):
    out = subprocess.run(
        ["cargo", "tree", "-p", package, "-e", "normal", "--prefix", "none", "--depth", "1"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if n.startswith("kvbm-") and n != package}


def main():
    broken = []
    for package, allowed in ALLOWED.items():
        extra = direct(package) - allowed
        if extra:
            broken.append(f"{package} links {sorted(extra)}; its layer allows {sorted(allowed)}")
    for package, banned in FORBIDDEN.items():
        extra = ["--features", "python"] if package == "kvbm-py" else []
        found = {name for name, _ in tree(package, *extra)} & banned
        if found:
            broken.append(f"{package} reaches {sorted(found)}, which it must not")
    root = pathlib.Path(__file__).resolve().parent.parent
    for f in sorted(root.glob("*/**/*.rs")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith("target/") or rel == ASSEMBLY or rel.startswith(LINK_ALLOWED_UNDER):
            continue
        if "TierLink::new(" in f.read_text(errors="replace"):
            broken.append(f"{rel} calls TierLink::new: build tiers with kvbm_core::assembly")
    py = tree("kvbm-py", "--features", "python")
    print(f"kvbm-py (--features python) builds {len(py)} crates (at most {MAX_PY})")
    if len(py) > MAX_PY:
        broken.append(f"kvbm-py builds {len(py)} crates, more than {MAX_PY}")
    for b in broken:
        print(f"dependency rule broken: {b}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
