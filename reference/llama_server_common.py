"""What the llama-server fixture scripts share: the command line, starting the reference server,
HTTP calls and reading server-sent events.

Used by llama_server_fixtures.py, llama_server_endpoints.py, llama_server_grammar_fixtures.py and
llama_server_tools_fixtures.py; each keeps its own requests and the shape of its golden files.
Standard library only.
"""

import hashlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

UPSTREAM = "0c1e57098"  # llama.cpp vendored by llama-cpp-python 0.3.36 (see build_llama_cpp.sh)


def add_args(ap):
    """The options every fixture script takes: --out, --models-dir, --llama-dest."""
    ap.add_argument("--out", type=Path, required=True, help="the golden/ directory")
    ap.add_argument("--models-dir", type=Path, default=Path.home() / ".cache/specula/models")
    ap.add_argument("--llama-dest", type=Path, default=os.environ.get("SPECULA_LLAMA_DEST", "/work/llama"),
                    help="DEST of reference/build_llama_cpp.sh (llama-server in DEST/build/bin)")


def inputs(tag, args, models):
    """The llama-server binary and the model paths, or None (after saying why) when one is missing:
    the committed files are then left alone."""
    binary = Path(args.llama_dest) / "build/bin/llama-server"
    if not binary.exists():
        print(f"{tag}: skipped, no {binary} (build the llama-server target)")
        return None
    paths = [args.models_dir / m for m in models]
    for p in paths:
        if not p.exists():
            print(f"{tag}: skipped, no {p} (cargo xtask fetch-models)")
            return None
    return binary, paths


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port, method, path, data, headers=None, timeout=300):
    """One request to 127.0.0.1:port; (status, body text), HTTP errors included."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, raw.decode()


def sse(text):
    """The events of a server-sent-event answer in order: (name of its `event:` line or None,
    its `data:` payload as text)."""
    events, name = [], None
    for line in text.split("\n"):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, line[len("data: "):]))
            name = None
    return events


class LlamaServer:
    """`with LlamaServer(tag, binary, model, args) as port:` runs llama-server on a free port
    until the block ends; raises SystemExit when it does not become healthy in `tries` × 0.2 s."""

    def __init__(self, tag, binary, model, args, cwd=None, tries=900):
        self.tag, self.cwd, self.tries = tag, cwd, tries
        self.port = free_port()
        self.cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = None

    def __enter__(self):
        log = open(os.devnull, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, cwd=self.cwd)
        for _ in range(self.tries):
            try:
                if http(self.port, "GET", "/health", None)[0] == 200:
                    return self.port
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise SystemExit(f"{self.tag}: llama-server did not become healthy")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return False
