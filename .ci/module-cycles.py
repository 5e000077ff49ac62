#!/usr/bin/env python3
"""Fails when modules of one crate import each other in a cycle.

For every crate's `src/`, each file is a module (`a/b.rs` and `a/b/mod.rs`
are `a::b`). A file that names `crate::x::y` (in a `use` or a path) or
`super::x` depends on the deepest module that path reaches. Edges between
a module and its own ancestors or descendants are ignored (a parent
re-exporting its children, a child using its parent's items); cycles among
the rest are reported. Allowed: the cycles listed in ALLOWED (a block
handle returns itself to its pool).
"""

import re
import sys
from pathlib import Path

ALLOWED = {
    ("kvbm-core", frozenset({"block", "pool"})),
}

PATH = re.compile(r"\b(crate|super)((?:::[a-z_][a-z0-9_]*)+)")
USE = re.compile(r"\buse\s+((?:crate|super)::[^;]*);", re.S)


def expand(tree: str):
    """Every path of a `use` tree: `a::{b, c::{d}}` gives a::b, a::c::d."""
    tree = re.sub(r"\s+", "", tree)
    depth, start = 0, None
    for i, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                prefix, inner, suffix = tree[:start], tree[start + 1 : i], tree[i + 1 :]
                parts, d, cur = [], 0, ""
                for c in inner:
                    if c == "," and d == 0:
                        parts.append(cur)
                        cur = ""
                        continue
                    d += c == "{"
                    d -= c == "}"
                    cur += c
                parts.append(cur)
                out = []
                for part in parts:
                    if part:
                        out += expand(prefix + part + suffix)
                return out
    return [tree]


def modules(src: Path):
    mods = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts = parts[:-1]
        if parts and parts[0] == "bin":
            continue
        mods[tuple(parts)] = f
    return mods


def strip_comments(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def resolve(mods, start, names):
    """The deepest known module reached by walking `names` from `start`."""
    best = None
    cur = list(start)
    for n in names:
        cur = cur + [n]
        if tuple(cur) in mods:
            best = tuple(cur)
        else:
            break
    return best


def related(a, b):
    return a[: len(b)] == b or b[: len(a)] == a


def cycles(crate: Path):
    src = crate / "src"
    mods = modules(src)
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        text = strip_comments(f.read_text())
        found = PATH.findall(text)
        for tree in USE.findall(text):
            for path in expand(tree):
                path = path.split(" as ")[0].replace("::self", "")
                m2 = PATH.match(path)
                if m2:
                    found.append((m2.group(1), m2.group(2)))
        for kind, rest in found:
            names = [n for n in rest.split("::") if n]
            if kind == "crate":
                base = ()
            else:
                # `super` from a/b.rs is `a`; from a/b/mod.rs also `a`.
                base = m[:-1]
                while names and names[0] == "super":
                    base = base[:-1]
                    names = names[1:]
            target = resolve(mods, base, names)
            if target is None or related(m, target):
                continue
            edges[m].add(target)
    # Tarjan's strongly connected components.
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main():
    root = Path(__file__).resolve().parent.parent
    bad = 0
    for toml in sorted(root.glob("*/Cargo.toml")):
        crate = toml.parent
        if not (crate / "src").is_dir():
            continue
        for comp in cycles(crate):
            names = frozenset("::".join(c) for c in comp)
            if (crate.name, names) in ALLOWED:
                continue
            bad += 1
            print(f"{crate.name}: modules import each other: {', '.join(sorted(names))}")
    if bad:
        sys.exit(1)
    print("no import cycles between modules")


if __name__ == "__main__":
    main()
