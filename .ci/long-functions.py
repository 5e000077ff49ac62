#!/usr/bin/env python3
"""No Rust function in the workspace is longer than MAX_LINES, counted from
its `fn` line to its closing brace (generated code aside). A long function
is split into ones that each do one thing; a match over every event kind
hands each kind's work to a function of its own.

Exits 1 naming each function over the limit, with its file and line.
"""

import pathlib
import re
import sys

MAX_LINES = 150
ROOT = pathlib.Path(__file__).resolve().parent.parent
FN = re.compile(r"\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")


def code(line):
    """The line without string and char literals and comments, for counting braces."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split("//")[0]


def functions(path):
    lines = path.read_text(errors="replace").splitlines()
    i = 0
    while i < len(lines):
        m = FN.match(lines[i])
        if m:
            depth, started, j = 0, False, i
            while j < len(lines):
                text = code(lines[j])
                for ch in text:
                    if ch == "{":
                        depth += 1
                        started = True
                    elif ch == "}":
                        depth -= 1
                if started and depth <= 0:
                    break
                if not started and text.rstrip().endswith(";"):
                    break
                j += 1
            yield m.group(6), i + 1, j - i + 1
        i += 1


def main():
    long = []
    for path in sorted(ROOT.glob("*/**/*.rs")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "target" or "generated" in rel.parts:
            continue
        for name, line, n in functions(path):
            if n > MAX_LINES:
                long.append(f"{rel}:{line}: fn {name} is {n} lines (at most {MAX_LINES})")
    for x in long:
        print(x, file=sys.stderr)
    print(f"functions over {MAX_LINES} lines: {len(long)}")
    return 1 if long else 0


if __name__ == "__main__":
    sys.exit(main())
