#!/usr/bin/env python3
"""Fails when the server crate's modules depend on each other in a cycle, or a module
imports from a layer above its own (the layers below, bottom first; every module must
be in one, so a new module is placed on purpose).

A module depends on another when its code (not its comments or its `mod tests`) names a
path into it: `crate::a::b`, `super::x`, `use crate::{a, b}`. A module containing
another (`mod x;`) is not a dependency. Prints each cycle's modules and the edges that
close it. Usage: python3 scripts/module-cycles.py [SRC_DIR] (default server/src).
"""
import os
import re
import sys


def modules(root):
    found = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            found["::".join(parts) or "crate"] = path
    return found


def code_of(path):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"#\[cfg\(test\)\]\s*mod tests\s*\{.*", "", text, flags=re.S)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def longest_module(segments, mods):
    for k in range(len(segments), 0, -1):
        name = "::".join(segments[:k])
        if name in mods:
            return name
    return None


def edges_of(mods):
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        code = code_of(path)
        here = [] if m == "crate" else m.split("::")
        # `super` of a file module is its folder's module; of a folder module, its parent.
        parent = here[:-1]
        targets = set()
        for hit in re.finditer(r"\bcrate::\{([^}]*)\}", code):
            for item in hit.group(1).split(","):
                targets.add(longest_module(item.strip().split("::"), mods))
        for hit in re.finditer(r"\bcrate::((?:\w+::)*\w+)", code):
            targets.add(longest_module(hit.group(1).split("::"), mods))
        for hit in re.finditer(r"\bsuper::((?:\w+::)*\w+|\{)", code):
            rest = [] if hit.group(1) == "{" else hit.group(1).split("::")
            targets.add(longest_module(parent + rest, mods) or ("::".join(parent) or "crate"))
        edges[m] = {t for t in targets if t and t != m and t in mods}
    return edges


def cycles(edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# The layers of server/src, bottom first (docs/design.md, "Module layers"): a module
# matches the entry naming it or, failing that, its closest enclosing module's.
LAYERS = [
    ("formats", ["write::record", "durable::wal::format", "exposition", "clock", "latch",
                 "loud", "rlimit", "auth", "tls"]),
    ("state and ingest", ["ingest", "durable", "failure", "config", "error", "listener",
                          "steering", "mesh", "metrics", "query", "reuse"]),
    ("one executor", ["executor", "write::job"]),
    ("on an executor", ["write", "handler", "conn", "admit", "http", "http_api",
                        "checkpoint"]),
    ("the process", ["lifecycle", "check", "crate"]),
]


def layer_of(module):
    parts = module.split("::")
    for k in range(len(parts), 0, -1):
        name = "::".join(parts[:k])
        for i, (_, members) in enumerate(LAYERS):
            if name in members:
                return i
    return None


def layer_faults(edges):
    faults = []
    for m in sorted(edges):
        lm = layer_of(m)
        if lm is None:
            faults.append(f"{m} is in no layer: add it to LAYERS in scripts/module-cycles.py")
            continue
        for t in sorted(edges[m]):
            lt = layer_of(t)
            if lt is not None and lt > lm:
                faults.append(f"{m} ({LAYERS[lm][0]}) imports {t} ({LAYERS[lt][0]}), a layer above")
    return faults


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "server/src"
    mods = modules(root)
    edges = edges_of(mods)
    faults = layer_faults(edges)
    for f in faults:
        print(f)
    found = cycles(edges)
    for comp in found:
        print(f"import cycle among {len(comp)} modules of {root}: {', '.join(comp)}")
        for m in comp:
            inside = sorted(t for t in edges[m] if t in comp)
            print(f"  {m} -> {', '.join(inside)}")
    if found or faults:
        sys.exit(1)
    print(f"{len(mods)} modules of {root} in {len(LAYERS)} layers, no import cycle, none from a layer above")


if __name__ == "__main__":
    main()
