#!/usr/bin/env python3
"""The engines' real KV-event publishers, for kvix's ingest tests.

Each release's own kv_events.py is taken unmodified from its wheel on the Python
package index (checked against the wheel's RECORD hash) and loaded under its real
module name; only the modules it imports from the rest of the engine are stubbed
(a logger, its config class, two network helpers). What reaches kvix is what that
release's ZmqEventPublisher sends, over pyzmq.

    python3 scripts/engines.py setup
        Downloads the wheels once into the cache ($KVIX_ENGINE_CACHE, default
        $KVIX_CACHE/engines as scripts/testenv.py places it; a second run downloads
        nothing) and extracts the publisher modules, under testenv's lock. Prints "ready".
        Runs on the tests' environment (`$(python3 scripts/testenv.py ensure)
        scripts/engines.py ...`), which has pyzmq and msgspec.

    python3 scripts/engines.py publish RELEASE --endpoint EP [--replay EP] [--rank N]
                                       [--topic T] [--buffer N]
        Runs RELEASE's ZmqEventPublisher and prints "ready" (or "address in use: ..."
        and exits when a port is taken). Then reads one JSON command
        per line on stdin and answers one line on stdout:
          {"op": "publish", "events": [EVENT, ...]}  -> "published SEQ" once sent
          {"op": "offload", ...}                     -> "published SEQ" (vllm-0.34.0)
          {"op": "stop"}                             -> "stopped", and exits
        EVENT is {"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", FIELD:
        VALUE ...} with the release's own field names; fields the release does not have
        are dropped (and named on stderr), missing ones without a default are null. A
        hash written {"bytes": "HEX"} is sent as raw bytes.

        "offload" runs vLLM 0.34's own offloading-connector event tracker
        (kv_connector/v1/offloading/events.py, OffloadingEventsTracker) on one request
        and publishes the events it builds as one batch:
          {"op": "offload", "self_describing": BOOL, "block_size": N,
           "block_hashes": [INT, ...], "token_ids": [INT, ...],
           "store": [CHUNK, ...] | "remove": [CHUNK, ...], "medium": "CPU" | "STORAGE"}
        A chunk is one block (its index in the request). Self-describing: the tracker
        captured the request at store time, so its BlockStored carries the tokens;
        otherwise it emits the legacy placeholder (one hash, no tokens, block size 0).

RELEASE is one of: vllm-0.9.2, vllm-0.34.0, sglang-0.5.23.
"""

import ast
import base64
import glob
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testenv  # noqa: E402  (the cache and its lock, beside this script)

CACHE = os.environ.get("KVIX_ENGINE_CACHE") or os.path.join(testenv.cache_dir(), "engines")

# ---------------------------------------------------------------------------
# stubs: only what the real modules import at load time (and call at run time)
# ---------------------------------------------------------------------------
LOGGER = """import logging
def init_logger(name):
    return logging.getLogger(name)
"""

STUBS = {
    "vllm-0.9.2": {
        "vllm/__init__.py": "",
        "vllm/logger.py": LOGGER,
        "vllm/distributed/__init__.py": "",
        # 0.9.2: vllm/config.py is one 4k-line module; only KVEventsConfig is used
        # (in EventPublisherFactory.create). Same fields/defaults as the real class
        # (drive.py checks the field list against the wheel's vllm/config.py).
        "vllm/config.py": '''from dataclasses import dataclass
from typing import Optional

@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
''',
    },
    "vllm-0.34.0": {
        "vllm/__init__.py": "",
        "vllm/logger.py": LOGGER,
        "vllm/distributed/__init__.py": "",
        # the REAL vllm/config/kv_events.py is loaded too; it only needs `config`
        # (a pydantic dataclass decorator in vLLM; a stdlib dataclass is enough)
        "vllm/config/__init__.py": "",
        "vllm/config/utils.py": '''from dataclasses import dataclass

def config(cls=None, *, config=None, **kwargs):
    def deco(c):
        return dataclass(c, **kwargs)
    return deco if cls is None else deco(cls)
''',
        "vllm/utils/__init__.py": "",
        # used only by ZmqEventPublisher._bind for "tcp://*:0"
        "vllm/utils/network_utils.py": '''import ipaddress, os
from urllib.parse import urlsplit

def get_ip():
    return os.environ.get("VLLM_HOST_IP", "127.0.0.1")

def is_valid_ipv6_address(address):
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False

def get_tcp_uri(ip, port):
    return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"

def split_zmq_path(path):
    u = urlsplit(path)
    return u.scheme, u.hostname or "", "" if u.port is None else str(u.port)
''',
        "vllm/v1/__init__.py": "",
        "vllm/v1/core/__init__.py": "",
        "vllm/v1/core/kv_cache_utils.py": '''from typing import TypeAlias
ExternalBlockHash: TypeAlias = bytes | int
''',
    },
    "sglang-0.5.23": {
        "sglang/__init__.py": "",
        "sglang/srt/__init__.py": "",
        "sglang/srt/disaggregation/__init__.py": "",
        # used only by is_kv_publisher_rank (scheduler side, not the publisher)
        "sglang/srt/runtime_context.py": '''from types import SimpleNamespace
_PARALLEL = SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0,
                            attn_dp_size=1, attn_dp_rank=0, dp_rank=None)
def get_parallel():
    return _PARALLEL
''',
        "sglang/srt/utils/__init__.py": "",
        # the real one imports psutil; only NetworkAddress is used (parse helpers and
        # describe_local_source), same semantics as sglang/srt/utils/network.py
        "sglang/srt/utils/network.py": '''import ipaddress
from dataclasses import dataclass

def _is_ipv6(h):
    try:
        ipaddress.IPv6Address(h)
        return True
    except ValueError:
        return False

@dataclass(frozen=True)
class NetworkAddress:
    host: str
    port: int
    def __post_init__(self):
        if self.host.startswith("[") and self.host.endswith("]"):
            object.__setattr__(self, "host", self.host[1:-1])
    @property
    def is_ipv6(self):
        return _is_ipv6(self.host)
    def to_tcp(self):
        h = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"tcp://{h}:{self.port}"
    @staticmethod
    def parse(addr):
        if not addr:
            raise ValueError("Empty address string")
        if addr.startswith("["):
            close = addr.find("]")
            if close == -1 or not addr[close + 1:].startswith(":"):
                raise ValueError(addr)
            return NetworkAddress(addr[1:close], int(addr[close + 2:]))
        if ":" not in addr:
            raise ValueError(addr)
        host, port = addr.rsplit(":", 1)
        if not host or (":" in host and _is_ipv6(host)):
            raise ValueError(addr)
        p = int(port)
        if not 0 <= p <= 65535:
            raise ValueError(addr)
        return NetworkAddress(host, p)
''',
        # kv_events.py does `from pydantic import BaseModel` for KVEventsConfig only
        # (used by EventPublisherFactory.create). Enough of BaseModel for that.
        "pydantic/__init__.py": '''import json

class BaseModel:
    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        names = {}
        for klass in reversed(cls.__mro__):
            names.update(getattr(klass, "__annotations__", {}))
        cls.__fields = [n for n in names if not n.startswith("_")]
    def __init__(self, **kw):
        for n in type(self)._BaseModel__fields:
            setattr(self, n, kw.pop(n, getattr(type(self), n, None)))
        if kw:
            raise TypeError(f"extra fields: {sorted(kw)}")
    @classmethod
    def model_validate_json(cls, s):
        return cls(**json.loads(s))
    def model_dump(self):
        return {n: getattr(self, n) for n in type(self)._BaseModel__fields}
''',
    },
}

# vLLM 0.34's offloading connector's event tracker, loaded as it is; what it imports
# from the rest of vLLM (which needs torch) is stubbed. The definitions it uses from
# vllm/v1/kv_offload/base.py are taken from the wheel's own file (OFFLOAD_BASE_NAMES).
OFFLOAD_EVENTS = ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.events",
                  "vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py",
                  "offloading_events.py")
OFFLOAD_BASE = "vllm/v1/kv_offload/base.py"
OFFLOAD_BASE_NAMES = ["OffloadKey", "make_offload_key", "get_offload_block_hash",
                      "get_offload_group_idx", "_T", "Medium", "Locality", "TierMatcher",
                      "TierFilter", "ReqContext", "OffloadingEvent", "OffloadingKVEventsConfig"]
OFFLOAD_BASE_HEADER = """from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, auto
from typing import Any, ClassVar, NamedTuple, NewType, TypeVar
KvHintsEnvelope = object  # a type hint only, here
"""
OFFLOAD_STUBS = {
    "vllm/distributed/kv_transfer/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/__init__.py": "",
    "vllm/v1/kv_offload/__init__.py": "",
    "vllm/v1/request.py": "class Request:\n    pass\n",
    # As vllm/v1/core/kv_cache_utils.py defines them (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    # on, its default; one hash block size).
    "vllm/v1/core/kv_cache_utils.py": '''from typing import Any, NewType, TypeAlias
ExternalBlockHash: TypeAlias = bytes | int
BlockHash = NewType("BlockHash", bytes)

def maybe_convert_block_hash(hash_bytes):
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)

def resolve_block_hashes(block_hashes, hash_block_size, block_size, **kw):
    assert block_size == hash_block_size, "one hash block size in these tests"
    return block_hashes

def to_event_extra_keys(extra_keys):
    if not extra_keys:
        return None
    event_keys = [None if keys is None
                  else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
                  for keys in extra_keys]
    return event_keys or None
''',
    # Full-attention groups only in these tests.
    "vllm/v1/kv_cache_interface.py": '''from enum import Enum
class KVCacheSpec: pass
class MambaSpec(KVCacheSpec): pass
class FullAttentionSpec(KVCacheSpec): pass
class KVCacheGroupSpec:
    def __init__(self, kv_cache_spec):
        self.kv_cache_spec = kv_cache_spec
class _Kind(Enum):
    FULL_ATTENTION = "full_attention"
    MAMBA = "mamba"
def get_kv_cache_spec_kind(spec):
    return _Kind.MAMBA if isinstance(spec, MambaSpec) else _Kind.FULL_ATTENTION
def get_kv_cache_spec_sliding_window(spec):
    return None
''',
}


def top_level(source, names):
    """The source of the top-level definitions of `names` (classes, functions,
    assignments, and assignments to their attributes), in file order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    keep, found = [], set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            name = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = target.value.id if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        else:
            continue
        if name in names:
            found.add(name)
            # From its first decorator (a dataclass's is part of it) to its end.
            first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            keep.append("\n".join(lines[first - 1:node.end_lineno]))
    missing = sorted(set(names) - found)
    if missing:
        raise SystemExit(f"{OFFLOAD_BASE}: no {missing} in this release")
    return "\n\n".join(keep) + "\n"


RELEASES = {
    # release: (pip requirement, extra pip download flags, wheel glob,
    #           [(module name, member in the wheel, file name)])
    "vllm-0.9.2": ("vllm==0.9.2", [], "vllm-0.9.2-*.whl", [
        ("vllm.distributed.kv_events", "vllm/distributed/kv_events.py", "kv_events.py"),
    ]),
    "vllm-0.34.0": ("vllm==0.34.0", [], "vllm-0.34.0-*.whl", [
        ("vllm.config.kv_events", "vllm/config/kv_events.py", "config_kv_events.py"),
        ("vllm.distributed.kv_events", "vllm/distributed/kv_events.py", "kv_events.py"),
    ]),
    # Its only wheel is tagged cp311; the publisher module in it is plain Python.
    "sglang-0.5.23": ("sglang==0.5.23",
                      ["--only-binary=:all:", "--python-version", "3.11",
                       "--platform", "manylinux_2_34_x86_64"],
                      "sglang-0.5.23-*.whl", [
        ("sglang.srt.disaggregation.kv_events", "sglang/srt/disaggregation/kv_events.py", "kv_events.py"),
    ]),
}


def say(*a):
    print(*a, file=sys.stderr, flush=True)


def pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def ensure_modules():
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{e}: run this script with the tests' environment, "
                         "$(python3 scripts/testenv.py ensure) scripts/engines.py ...")


def wheel(release):
    spec, flags, pattern, _ = RELEASES[release]
    found = glob.glob(os.path.join(CACHE, pattern))
    if found:
        return found[0]
    os.makedirs(CACHE, exist_ok=True)
    say(f"downloading {spec} into {CACHE} (once)")
    r = pip("download", "--quiet", "--disable-pip-version-check", "--no-deps", "-d", CACHE, *flags, spec)
    found = glob.glob(os.path.join(CACHE, pattern))
    if r.returncode != 0 or not found:
        raise SystemExit(f"pip download {spec} failed:\n{r.stderr}")
    return found[0]


def record_hash(zf, member):
    record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    for line in zf.read(record).decode().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if path == member:
            return digest
    return None


def sha256_record(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def files_checked(zf, member, path):
    """Writes `member` of the wheel to `path` once it matches the wheel's RECORD."""
    data = zf.read(member)
    if sha256_record(data) != record_hash(zf, member):
        raise SystemExit(f"{member} does not match its RECORD")
    with open(path, "wb") as f:
        f.write(data)


def extract(release, out, marker):
    """Takes the real files out of the wheel (checked against its RECORD); the marker,
    written last, says they are whole."""
    _, _, _, files = RELEASES[release]
    os.makedirs(out, exist_ok=True)
    with zipfile.ZipFile(wheel(release)) as zf:
        for _, member, name in files:
            data = zf.read(member)
            got = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            want = record_hash(zf, member)
            if got != want:
                raise SystemExit(f"{release}: {member} does not match its RECORD ({got} != {want})")
            with open(os.path.join(out, name), "wb") as f:
                f.write(data)
        if release == "vllm-0.34.0":
            _, member, name = OFFLOAD_EVENTS
            files_checked(zf, member, os.path.join(out, name))
            base = zf.read(OFFLOAD_BASE)
            if sha256_record(base) != record_hash(zf, OFFLOAD_BASE):
                raise SystemExit(f"{release}: {OFFLOAD_BASE} does not match its RECORD")
            with open(os.path.join(out, "offload_base.py"), "w") as f:
                f.write(OFFLOAD_BASE_HEADER + top_level(base.decode(), OFFLOAD_BASE_NAMES))
        if release == "vllm-0.9.2":  # the stub KVEventsConfig mirrors the real one
            tree = ast.parse(zf.read("vllm/config.py"))
            cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVEventsConfig")
            real = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)]
            stub = ast.parse(STUBS[release]["vllm/config.py"])
            mine = [s.target.id for s in stub.body[-1].body if isinstance(s, ast.AnnAssign)]
            if real != mine:
                raise SystemExit(f"{release}: KVEventsConfig fields changed: {real}")
    open(marker, "w").close()


def prepare(release):
    """Extracts the real files (checked against the wheel's RECORD) and writes the stubs;
    returns (directory of the real files, stub directory)."""
    out = os.path.join(CACHE, "extracted", release)
    stubs = os.path.join(out, "stubs")
    # -2: the offloading tracker's files are extracted too.
    marker = os.path.join(out, ".verified-3")
    if not os.path.exists(marker):
        # Downloaded and extracted once, under testenv's lock: publishers of several
        # processes starting at once wait for the first.
        with testenv.Locked():
            if not os.path.exists(marker):
                extract(release, out, marker)
    extra = OFFLOAD_STUBS if release == "vllm-0.34.0" else {}
    for rel, text in {**STUBS[release], **extra}.items():
        p = os.path.join(stubs, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        try:
            with open(p) as f:
                if f.read() == text:
                    continue
        except OSError:
            pass
        # Written aside and renamed: a publisher starting meanwhile reads a whole file.
        tmp = f"{p}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, p)
    return out, stubs


def load_real(release):
    out, stubs = prepare(release)
    sys.path.insert(0, stubs)
    mod = None
    for name, _, fname in RELEASES[release][3]:
        spec = importlib.util.spec_from_file_location(name, os.path.join(out, fname))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


def load_offloading(release):
    """vLLM 0.34's OffloadingEventsTracker and what it needs, over the loaded publisher."""
    if release != "vllm-0.34.0":
        raise SystemExit(f"offload: {release} has no offloading connector events")
    out, _ = prepare(release)
    mods = {}
    for name, fname in [("vllm.v1.kv_offload.base", "offload_base.py"),
                        (OFFLOAD_EVENTS[0], OFFLOAD_EVENTS[2])]:
        spec = importlib.util.spec_from_file_location(name, os.path.join(out, fname))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["vllm.v1.kv_offload.base"], mods[OFFLOAD_EVENTS[0]], {}


def offload_events(base, events_mod, trackers, cmd):
    """The events vLLM's tracker builds for storing (or removing) blocks of one request
    in an offloading tier: one tracker per mode, kept across commands as the connector
    keeps its own."""
    from types import SimpleNamespace as NS
    bs = cmd["block_size"]
    hashes = [h.to_bytes(8, "big") for h in cmd["block_hashes"]]
    sd = cmd.get("self_describing", True)
    if sd not in trackers:
        config = base.OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                               self_describing_kv_events=sd)
        trackers[sd] = events_mod.OffloadingEventsTracker(config)
    tracker = trackers[sd]
    spec = sys.modules["vllm.v1.kv_cache_interface"].FullAttentionSpec()
    group = NS(group_idx=0, hashes_per_chunk=1, tokens_per_chunk=bs, tokens_per_block=bs,
               sliding_window_size_in_chunks=None, kv_cache_spec=spec,
               kv_event_group_spec=events_mod.OffloadingEventGroupSpec("full_attention", None))
    req = NS(block_hashes=hashes, all_token_ids=cmd["token_ids"], lora_request=None,
             resumable=False, kv_transfer_params=None)
    medium = base.Medium[cmd.get("medium", "CPU")]
    removed = "remove" in cmd
    chunks = cmd["remove"] if removed else cmd["store"]
    keys = [base.make_offload_key(hashes[c], 0) for c in chunks]
    if not removed:
        for c, key in zip(chunks, keys):
            tracker.record_store(req, group, c, key)
    ev = base.OffloadingEvent(keys=keys, medium=medium, removed=removed,
                              locality=base.Locality.LOCAL, removal_expected=True)
    return list(tracker.take_events([ev]))


def hash_value(v):
    if isinstance(v, dict) and "bytes" in v:
        return bytes.fromhex(v["bytes"])
    return v


def build_event(mod, ev):
    import msgspec
    kind = ev.pop("type")
    cls = getattr(mod, kind)
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    dropped = sorted(set(ev) - set(fields))
    if dropped:
        say(f"{kind}: this release has no {dropped}; dropped")
    kw = {}
    for name, f in fields.items():
        if name in ev:
            v = ev[name]
            if name in ("block_hashes",):
                v = [hash_value(h) for h in v]
            elif name == "parent_block_hash":
                v = hash_value(v)
            elif name == "token_ids":
                v = [tuple(t) if isinstance(t, list) else t for t in v]
            elif name == "extra_keys" and v is not None:
                v = [None if k is None else tuple(tuple(x) if isinstance(x, list) else x for x in k) for k in v]
            kw[name] = v
        elif f.required:
            kw[name] = None
    return cls(**kw)


def publish(argv):
    import argparse
    p = argparse.ArgumentParser(prog="engines.py publish")
    p.add_argument("release", choices=sorted(RELEASES))
    p.add_argument("--endpoint", required=True)
    p.add_argument("--replay")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--topic", default="")
    p.add_argument("--buffer", type=int, default=10_000)
    a = p.parse_args(argv)
    mod = load_real(a.release)
    offloading = None
    rank = {"attn_dp_rank" if a.release.startswith("sglang") else "data_parallel_rank": a.rank}
    import zmq
    try:
        pub = mod.ZmqEventPublisher(endpoint=a.endpoint, replay_endpoint=a.replay,
                                    topic=a.topic, buffer_steps=a.buffer, **rank)
    except zmq.ZMQError as e:
        if e.errno != zmq.EADDRINUSE:
            raise
        # the caller chose the ports; it may choose again
        print(f"address in use: {e}", flush=True)
        return
    print("ready", flush=True)
    seq = -1
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] in ("publish", "publish_many"):
            # publish_many: one batch per list of events, in order
            batches = cmd["batches"] if cmd["op"] == "publish_many" else [cmd["events"]]
            for evs in batches:
                events = [build_event(mod, dict(e)) for e in evs]
                pub.publish(mod.KVEventBatch(ts=time.time(), events=events))
                pub._event_queue.join()  # task_done() follows the send
                seq += 1
            print(f"published {seq}", flush=True)
        elif cmd["op"] == "offload":
            offloading = offloading or load_offloading(a.release)
            events = offload_events(*offloading, cmd)
            pub.publish(mod.KVEventBatch(ts=time.time(), events=events))
            pub._event_queue.join()
            seq += 1
            print(f"published {seq}", flush=True)
        elif cmd["op"] == "stop":
            break
        else:
            raise SystemExit(f"unknown op {cmd['op']!r}")
    pub.shutdown()
    print("stopped", flush=True)


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if sys.argv[1] == "setup":
        ensure_modules()
        for release in RELEASES:
            prepare(release)
        print("ready", flush=True)
    elif sys.argv[1] == "publish":
        publish(sys.argv[2:])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}; see --help")


if __name__ == "__main__":
    main()
