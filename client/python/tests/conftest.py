"""Fixtures: real kvix-server processes on loopback.

The server binary is $KVIX_SERVER_BIN (server/tests/python.rs, which runs this suite
from `cargo test`, sets it), else target/{debug,release}/kvix-server of this checkout.
Without one the suite skips with the reason, except under CI=true, where it fails.
"""

import os
import signal
import subprocess
import threading
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _server_bin():
    given = os.environ.get("KVIX_SERVER_BIN")
    if given:
        return given
    for profile in ("debug", "release"):
        p = os.path.join(ROOT, "target", profile, "kvix-server")
        if os.path.exists(p):
            return p
    _missing("no kvix-server binary: run `cargo build -p kvix-server` or set KVIX_SERVER_BIN")


def _missing(reason):
    """A part the suite needs is missing: skipped with the reason, failed under CI."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def _all_threads_stopped(pid):
    """Whether every thread of process `pid` is stopped (state T in /proc)."""
    task = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task)
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"{task}/{tid}/stat") as f:
                state = f.read().rsplit(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue  # a thread that ended
        if state != "T":
            return False
    return True


class Server:
    """One kvix-server on an ephemeral loopback port; `addr` is "host:port"."""

    def __init__(self, binary, *args):
        self.proc = subprocess.Popen(
            [binary, "--listen", "127.0.0.1:0", "--unix", "", "--metrics", "", "--cores", "1",
             "--pin", "false", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "KVIX_LOG": "warn"},
        )
        self.addr = None
        for line in self.proc.stdout:
            if "listening on tcp://" in line:
                self.addr = line.split("listening on tcp://")[1].split()[0]
                break
        if self.addr is None:
            raise RuntimeError(f"kvix-server did not start: {self.proc.stderr.read()}")
        # Keep draining its output so it never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def pause(self):
        """SIGSTOP: the server keeps its connections but answers nothing. Returns once
        every thread has stopped (kill(2) returns before: one may still answer a query
        sent right after)."""
        self.proc.send_signal(signal.SIGSTOP)
        for _ in range(30_000):
            if _all_threads_stopped(self.proc.pid):
                return
            time.sleep(0.001)
        raise AssertionError(f"server {self.proc.pid} never stopped")

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def start_server():
    """A factory: start_server(*extra_args) -> Server; all are killed afterwards."""
    binary = _server_bin()
    started = []

    def start(*args):
        s = Server(binary, *args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.fixture
def server(start_server):
    return start_server()


@pytest.fixture
def dead_addr():
    """A loopback address nothing listens on: bound, never listening, so connections
    are refused and no other process can take the port during the test."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield "127.0.0.1:%d" % s.getsockname()[1]


@pytest.fixture
def tls_dir():
    """Certificates made by server/tests/python.rs (rcgen): ca.pem, other-ca.pem,
    server.pem, server.key (for 127.0.0.1)."""
    d = os.environ.get("KVIX_TLS_DIR")
    if not d:
        _missing("no KVIX_TLS_DIR: run the suite through `cargo test -p kvix-server --test python`")
    return d
