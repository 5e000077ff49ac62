#!/usr/bin/env python3
"""Fails when a relative link in README.md or docs/ does not resolve.

Every Markdown link and reference definition in README.md and in the
Markdown files under docs/ is checked, except those with a scheme
(https:, mailto:, ...) and those inside code (fenced blocks, inline code
spans). A link's path, relative to the file it is in, must exist (a file
or a directory); a `#anchor` on a Markdown file (or on its own file, `#x`
alone) must name one of its headings, slugged as GitHub does: lowercase,
punctuation removed (letters, digits, spaces, '-' and '_' kept), each
space a '-', and a heading repeated in a file suffixed -1, -2, ... An
explicit `<a id="x">` or `<a name="x">` is an anchor too.

Usage: python3 .ci/check-links.py [FILE.md ...]   (default: README.md docs/)
Exit status: 0 when every link resolves, 1 otherwise (each broken link is
listed as FILE:LINE: TARGET: why).
"""

import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```+|~~~+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the text may hold one level of [..].
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def slug(text: str) -> str:
    """GitHub's heading slug for the heading's text as written."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def lines_outside_code(text: str):
    """(line number, line) for each line not inside a fenced code block."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark[0] * len(mark)
                continue
            if mark.startswith(fence):
                fence = None
                continue
        if fence is None:
            yield n, line


_anchor_cache: dict = {}


def anchors(path: Path) -> set:
    if path in _anchor_cache:
        return _anchor_cache[path]
    seen: dict = {}
    found = set()
    prev = None
    for _, line in lines_outside_code(path.read_text(encoding="utf-8")):
        text = None
        m = HEADING.match(line)
        if m:
            text = m.group(2)
        elif prev and prev.strip() and SETEXT.match(line) and not HEADING.match(prev):
            text = prev.strip()
        if text is not None:
            base = slug(text)
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
        for a in HTML_ANCHOR.findall(line):
            found.add(a)
        prev = line
    _anchor_cache[path] = found
    return found


def targets(path: Path):
    """(line number, target) for every link in a Markdown file."""
    for n, line in lines_outside_code(path.read_text(encoding="utf-8")):
        bare = CODE_SPAN.sub("", line)
        for m in INLINE.finditer(bare):
            yield n, m.group(1)
        m = REFDEF.match(bare)
        if m:
            yield n, m.group(1)


def check(path: Path) -> list:
    problems = []
    for n, target in targets(path):
        target = target.strip("<>")
        if not target or SCHEME.match(target):
            continue
        where, _, frag = target.partition("#")
        where = unquote(where)
        if where.startswith("/"):
            dest = ROOT / where.lstrip("/")
        elif where:
            dest = (path.parent / where).resolve()
        else:
            dest = path
        rel = path.relative_to(ROOT)
        if not dest.exists():
            problems.append(f"{rel}:{n}: {target}: no such file or directory")
            continue
        if frag:
            if dest.is_dir() or dest.suffix.lower() != ".md":
                # GitHub's line anchors (#L10) on source files: not checked.
                if not re.fullmatch(r"L\d+(-L\d+)?", frag):
                    problems.append(f"{rel}:{n}: {target}: an anchor on a file that is not Markdown")
                continue
            if unquote(frag) not in anchors(dest):
                problems.append(f"{rel}:{n}: {target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return problems


def main(argv: list) -> int:
    if argv:
        files = [Path(a).resolve() for a in argv]
    else:
        files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    problems = []
    checked = 0
    for f in files:
        if not f.exists():
            problems.append(f"{f}: missing")
            continue
        checked += 1
        problems.extend(check(f))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} broken relative link(s) in {checked} file(s)", file=sys.stderr)
        return 1
    print(f"relative links resolve in {checked} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
