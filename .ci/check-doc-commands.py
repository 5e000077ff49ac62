#!/usr/bin/env python3
"""Every `cargo run -p PACKAGE -- ARGS` in README.md and docs/ names a
package, binary or example that exists, a subcommand the binary has and
flags that subcommand takes (each checked against its `--help`).

Run after `cargo build --workspace --bins` (the debug binaries); exits 1
naming each stale command with its file and line.
"""

import json
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN_DIR = ROOT / "target" / "debug"


def targets():
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version", "1"],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout
    )
    out = {}
    for p in meta["packages"]:
        kinds = {"bin": [], "example": []}
        for t in p["targets"]:
            for k in t["kind"]:
                if k in kinds:
                    kinds[k].append(t["name"])
        out[p["name"]] = kinds
    return out


def commands():
    """(file, line number, the command's words), for each `cargo run`."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for f in files:
        lines = f.read_text().splitlines()
        i = 0
        while i < len(lines):
            line, start = lines[i], i + 1
            # A command continued with a trailing backslash.
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            for m in re.finditer(r"cargo run[^`\n\"]*", line):
                text = m.group(0)
                try:
                    words = shlex.split(text, comments=True)
                except ValueError:
                    words = text.split("#")[0].split()
                yield f.relative_to(ROOT), start, words


def help_text(binary, sub=None):
    args = [str(binary)] + ([sub] if sub else []) + ["--help"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout + r.stderr


def subcommands(text):
    subs, on = set(), False
    for line in text.splitlines():
        if line.strip() == "Commands:":
            on = True
            continue
        if on:
            if not line.startswith("  "):
                break
            subs.add(line.split()[0])
    return subs


def main():
    known = targets()
    problems, checked = [], 0
    for f, n, words in commands():
        where = f"{f}:{n}: {' '.join(words)}"
        if "-p" not in words:
            continue
        pkg = words[words.index("-p") + 1] if words.index("-p") + 1 < len(words) else ""
        if not re.fullmatch(r"[A-Za-z0-9_-]+", pkg):
            # Prose about commands (`cargo run -p …`), not a command.
            continue
        if pkg not in known:
            problems.append(f"{where}: no package {pkg}")
            continue
        if "--example" in words:
            ex = words[words.index("--example") + 1]
            if ex not in known[pkg]["example"]:
                problems.append(f"{where}: {pkg} has no example {ex}")
            checked += 1
            continue
        bins = known[pkg]["bin"]
        if "--bin" in words:
            b = words[words.index("--bin") + 1]
        elif len(bins) == 1:
            b = bins[0]
        elif not bins:
            problems.append(f"{where}: {pkg} is a library (no binary)")
            continue
        else:
            problems.append(f"{where}: {pkg} has binaries {bins}: say which with --bin")
            continue
        if b not in bins:
            problems.append(f"{where}: {pkg} has no binary {b}")
            continue
        args = words[words.index("--") + 1 :] if "--" in words else []
        binary = BIN_DIR / b
        if not binary.exists():
            problems.append(f"{where}: {binary} is not built (run cargo build --workspace --bins)")
            continue
        rc, top = help_text(binary)
        sub = None
        subs = subcommands(top)
        if subs and args and not args[0].startswith("-"):
            if args[0] not in subs:
                problems.append(f"{where}: {b} has no command {args[0]} (it has {sorted(subs)})")
                continue
            sub = args[0]
        rc, text = help_text(binary, sub) if sub else (rc, top)
        if rc != 0:
            problems.append(f"{where}: {b} {sub or ''} --help failed")
            continue
        for w in args:
            if w.startswith("--"):
                flag = w.split("=")[0]
                if not re.search(re.escape(flag) + r"\b", text):
                    problems.append(f"{where}: {b} {sub or ''} takes no {flag}")
        checked += 1
    for p in problems:
        print(f"stale command: {p}", file=sys.stderr)
    print(f"{checked} documented commands checked against their programs' --help")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
