#!/usr/bin/env python3
"""Runs every fenced command of the newcomer docs as a newcomer would, and checks what
each prints against what the docs say it prints. CI runs it last (.ci/run).

    python3 scripts/docs-commands.py [FILE ...]

FILE defaults to README.md, client/python/README.md and examples/*/README.md. The
commands of one file run in order in one bash session (so `cd`, `export` and an
activated virtual environment carry over), from the repository's root.

Blocks:
  ```sh       commands, run
  ```console  `$ COMMAND` lines, run; the lines after each, up to the next `$`, are
              what it must print
  ```python   run with the session's python3
  ```text     run nothing: output, or text
An HTML comment on the line before a block says more:
  <!-- docs: background "TEXT" -->  run it in the background until its output shows
                                    TEXT; stopped when the file is done
  <!-- docs: ci -->                 the tests: checked to be the command .ci/run runs
                                    (CI runs it itself, before this script)
  <!-- docs: prints -->             (on a text block) what the runnable block before it
                                    must print
Expected output is matched line by line, in order, other lines allowed between; spaces
count as one; `...` alone on a line stands for anything; `{A..B}` stands for a number
from A to B. A command that fails, or output that does not match, fails the run,
naming the file, the block's line and what was missing.
"""

import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RANGE = re.compile(r"\{(-?[0-9.]+)\.\.(-?[0-9.]+)\}")
NUMBER = r"(-?[0-9]+(?:\.[0-9]+)?)"
# How long a background command may take to say it is ready (a first release build).
READY_WAIT_S = 1800


class Block:
    def __init__(self, path, line, lang, text, directive):
        self.path, self.line, self.lang, self.text = path, line, lang, text
        self.directive = directive
        self.expect = []  # (command index within the block, expected lines)

    def where(self):
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def blocks_of(path):
    """The fenced blocks of a Markdown file, with the directive before each."""
    out, lines = [], open(path).read().split("\n")
    i, directive = 0, ""
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*<!--\s*docs:\s*(.*?)\s*-->\s*$", line)
        if m:
            directive = m.group(1)
            i += 1
            continue
        m = re.match(r"^(\s*)```(\w*)\s*$", line)
        if m:
            indent, lang, start = len(m.group(1)), m.group(2), i + 1
            body = []
            i += 1
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i][indent:])
                i += 1
            out.append(Block(path, start, lang, "\n".join(body), directive))
            directive = ""
        elif line.strip():
            directive = ""
        i += 1
    return out


def plan(blocks):
    """The steps to run: (block, command text, expected lines or None), in order."""
    steps = []
    for b in blocks:
        if b.directive.startswith("prints"):
            if not steps:
                raise SystemExit(f"{b.where()}: 'prints' with no command before it")
            blk, cmd, _ = steps[-1]
            steps[-1] = (blk, cmd, b.text.split("\n"))
        elif b.lang == "sh":
            steps.append((b, b.text, None))
        elif b.lang == "console":
            cmd, expect = None, []
            for line in b.text.split("\n"):
                if line.startswith("$ "):
                    if cmd is not None:
                        steps.append((b, cmd, expect))
                    cmd, expect = line[2:], []
                elif cmd is not None:
                    expect.append(line)
            if cmd is not None:
                steps.append((b, cmd, expect))
        elif b.lang == "python":
            steps.append((b, "python3 - <<'KVIX_DOCS_PY'\n" + b.text + "\nKVIX_DOCS_PY", None))
    return steps


def ci_command(cmd, where):
    """The ci directive: the README's test command must be what .ci/run runs."""
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    if not re.search(r"(^|\s)" + re.escape(cmd.strip()) + r"(;|\s|$)", ci, re.M):
        raise SystemExit(f"{where}: .ci/run does not run the README's test command `{cmd.strip()}`")
    print(f"{where}: `{cmd.strip()}` is what .ci/run runs (not run again here)", flush=True)


def script(steps, work):
    """One bash script running every step, each after a marker line."""
    out = ["set -eo pipefail", f"cd {shlex.quote(ROOT)}", "KVIX_DOCS_BG=''",
           "trap 'for p in $KVIX_DOCS_BG; do kill -TERM -- -$p 2>/dev/null || true; done; wait' EXIT"]
    for n, (b, cmd, _) in enumerate(steps):
        out.append(f"echo '@@kvix-docs {n}@@'")
        m = re.match(r'background\s+"(.*)"', b.directive)
        if m:
            log = os.path.join(work, f"background-{n}.log")
            out += [f"setsid bash -c {shlex.quote(cmd)} > {log} 2>&1 &",
                    "KVIX_DOCS_BG=\"$KVIX_DOCS_BG $!\"",
                    f"for _ in $(seq 1 {READY_WAIT_S * 10}); do "
                    f"grep -qF {shlex.quote(m.group(1))} {log} && break; sleep 0.1; done",
                    f"grep -qF {shlex.quote(m.group(1))} {log} || "
                    f"{{ cat {log}; echo 'never printed: {m.group(1)}'; exit 1; }}",
                    f"cat {log}"]
        else:
            out.append(cmd)
    out.append("echo '@@kvix-docs end@@'")
    return "\n".join(out) + "\n"


def matches(expected, actual):
    """None if every expected line is found in order in `actual`, else the first missing."""
    squash = lambda s: " ".join(s.split())  # noqa: E731
    lines, at = [squash(a) for a in actual], 0
    for e in expected:
        e = squash(e)
        if not e or e == "...":
            continue
        parts = RANGE.split(e)  # literal, lo, hi, literal, lo, hi, ..., literal
        literal = lambda t: re.escape(t).replace(r"\.\.\.", ".*")  # noqa: E731
        pattern = NUMBER.join(literal(t) for t in parts[::3])
        bounds = [(float(lo), float(hi)) for lo, hi in zip(parts[1::3], parts[2::3])]
        while at < len(lines):
            m = re.fullmatch(pattern, lines[at])
            at += 1
            if m and all(lo <= float(v) <= hi for v, (lo, hi) in zip(m.groups(), bounds)):
                break
        else:
            return e
    return None


def run_file(path, work):
    steps = [s for s in plan(blocks_of(path))]
    runnable = []
    for b, cmd, expect in steps:
        if b.directive == "ci":
            ci_command(cmd, b.where())
        else:
            runnable.append((b, cmd, expect))
    if not runnable:
        return
    text = script(runnable, work)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    wheels = os.path.join(os.environ.get("KVIX_CACHE") or os.path.expanduser("~/.cache/kvix"), "wheels")
    if os.path.isdir(wheels):
        env["PIP_FIND_LINKS"] = wheels  # the tests' wheels: fewer downloads, same packages
    print(f"== {os.path.relpath(path, ROOT)}: {len(runnable)} commands", flush=True)
    r = subprocess.run(["bash", "-c", text], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       env=env, text=True)
    outputs, current = {}, None
    for line in r.stdout.split("\n"):
        m = re.fullmatch(r"@@kvix-docs (\d+|end)@@", line.strip())
        if m:
            current = m.group(1)
            outputs[current] = []
        elif current is not None:
            outputs[current].append(line)
    for n, (b, cmd, expect) in enumerate(runnable):
        got = outputs.get(str(n))
        head = cmd.strip().split("\n")[0][:100]
        if got is None or (r.returncode != 0 and "end" not in outputs and str(n + 1) not in outputs):
            tail = "\n".join((got or [])[-40:])
            raise SystemExit(f"{b.where()}: `{head}` failed (exit {r.returncode}):\n{tail}")
        if expect:
            missing = matches(expect, got)
            if missing is not None:
                shown = "\n".join(got[-60:])
                raise SystemExit(f"{b.where()}: `{head}` did not print `{missing}`; it printed:\n{shown}")
        print(f"ok  {b.where()}: {head}", flush=True)
    if r.returncode != 0:
        raise SystemExit(f"{os.path.relpath(path, ROOT)}: the session ended with exit {r.returncode}")


def main():
    files = sys.argv[1:] or (["README.md", "client/python/README.md"]
                             + sorted(glob.glob("examples/*/README.md", root_dir=ROOT)))
    with tempfile.TemporaryDirectory(prefix="kvix-docs-") as work:
        for f in files:
            run_file(os.path.join(ROOT, f), work)
    print("docs-commands: every command ran and printed what the docs say")


if __name__ == "__main__":
    main()
