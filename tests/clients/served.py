"""`pddgw serve --model tiny` on a free loopback port, for the real clients' tests.

`serve_tiny(dir)` exports the tiny model as a Hugging Face folder (`pddgw export-model`:
the tokenizer the clients load, the same weights the server builds), starts the
embedded deployment on it and waits for GET /health; on exit it stops that one
process by its pid (`pddgw.harness.launch.Processes`).  `python -m pddgw` runs from
the interpreter that runs the tests, so the server is always this checkout's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pddgw.harness.launch import Processes
from pddgw.harness.ports import free_port

@dataclass(frozen=True, slots=True)
class Served:
    base: str                 # http://127.0.0.1:PORT
    model: str
    tokenizer_dir: str        # the exported Hugging Face folder
    procs: Processes

    def log(self) -> str:
        return self.procs.log("serve", None)


@contextmanager
def serve_tiny(directory: Path, *extra: str) -> Iterator[Served]:
    hf = directory / "tiny-hf"
    subprocess.run([sys.executable, "-m", "pddgw", "export-model", str(hf), "--model", "tiny"], check=True,
                   capture_output=True, timeout=300)
    port = free_port()
    procs = Processes(directory)
    procs.add("serve", ["serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port), *extra], port)
    procs.start(timeout_s=300)        # a loaded 2-core machine: import + warm-up can take a while
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        yield Served(base, model, str(hf), procs)
    finally:
        procs.stop()
