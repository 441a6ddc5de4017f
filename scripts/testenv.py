#!/usr/bin/env python3
"""The Python environment kvix's tests run in: a virtual environment of their own, never
the system interpreter's site-packages.

    python3 scripts/testenv.py ensure [--requirements FILE]
        Makes the environment if it is missing or was made from other requirements, and
        prints its interpreter's path (the only line on stdout). Every package comes
        from a wheel cache: downloaded there once, installed from there without the
        network (a rerun, or a new environment from the same requirements, downloads
        nothing). The engines' publisher wheels (scripts/engines.py) are fetched into
        the same cache. Safe to run from many processes at once: one installs while
        the others wait on a file lock, then find it made.

    python3 scripts/testenv.py where
        Prints where the environment and the caches are, and their sizes.

FILE defaults to scripts/test-requirements.txt. Locations ($KVIX_CACHE, default
~/.cache/kvix): venv-HASH/ (one per requirements file and interpreter version: two
checkouts with different requirements never undo each other's), wheels/ (every wheel
installed), engines/ (the engines' wheels), lock; $KVIX_VENV names the environment's
directory instead. Needs python3 with its venv module
(Debian: apt-get install python3-venv); nothing is installed outside $KVIX_CACHE.
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIREMENTS = os.path.join(HERE, "test-requirements.txt")


def cache_dir():
    if os.environ.get("KVIX_CACHE"):
        return os.environ["KVIX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvix")


def say(*a):
    print("testenv:", *a, file=sys.stderr, flush=True)


class Locked:
    """An exclusive lock on $KVIX_CACHE/lock, for as long as the block runs: installs
    and downloads into the cache never overlap, whichever process starts them."""

    def __enter__(self):
        os.makedirs(cache_dir(), exist_ok=True)
        self.f = open(os.path.join(cache_dir(), "lock"), "w")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another process is preparing the environment; waiting for it")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def venv_dir(requirements):
    with open(requirements, "rb") as f:
        digest = hashlib.sha256(f.read() + sys.version.encode()).hexdigest()[:12]
    return os.environ.get("KVIX_VENV") or os.path.join(cache_dir(), f"venv-{digest}"), digest


def interpreter(venv):
    return os.path.join(venv, "bin", "python")


def run(cmd, what):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise SystemExit(f"testenv: {what} failed ({' '.join(cmd)}):\n{r.stdout}")
    return r


def pip(python, *args):
    return [python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]


def make(requirements, venv, digest):
    """Makes `venv` from `requirements`; the stamp, written last, says it is whole."""
    if os.path.exists(venv):
        shutil.rmtree(venv)
    say(f"making {venv} from {os.path.relpath(requirements)}")
    try:
        import venv as _  # noqa: F401
    except ImportError:
        raise SystemExit("testenv: python3 has no venv module (Debian: apt-get install python3-venv)")
    run([sys.executable, "-m", "venv", venv], "python3 -m venv")
    python = interpreter(venv)
    wheels = os.path.join(cache_dir(), "wheels")
    offline = pip(python, "install", "--quiet", "--no-index", "--find-links", wheels, "-r", requirements)
    if subprocess.run(offline, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        say(f"downloading the wheels into {wheels} (once; about 200 MB)")
        run(pip(python, "download", "--quiet", "-d", wheels, "-r", requirements), "pip download")
        run(offline, "pip install from the wheel cache")
    with open(os.path.join(venv, ".kvix-requirements"), "w") as f:
        f.write(digest)


def ensure(requirements):
    venv, digest = venv_dir(requirements)
    stamp = os.path.join(venv, ".kvix-requirements")

    def whole():
        try:
            with open(stamp) as f:
                return f.read() == digest and os.path.exists(interpreter(venv))
        except OSError:
            return False

    if not whole():
        with Locked():
            if not whole():
                make(requirements, venv, digest)
    return interpreter(venv)


def size(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    requirements = REQUIREMENTS
    if "--requirements" in args:
        requirements = os.path.abspath(args[args.index("--requirements") + 1])
    if args[0] == "ensure":
        print(ensure(requirements))
    elif args[0] == "where":
        venv, _ = venv_dir(requirements)
        for name, path in [("environment", venv), ("wheels", os.path.join(cache_dir(), "wheels")),
                           ("engine wheels", os.path.join(cache_dir(), "engines"))]:
            print(f"{name:14} {path}  {size(path) / 1e6:.0f} MB")
    else:
        raise SystemExit(f"testenv: unknown command {args[0]!r} (ensure, where)")


if __name__ == "__main__":
    main()
