"""A real `pddgw serve` process (the embedded default: every role in one process)
on 127.0.0.1, from a config text; started and stopped (by its pid) by the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from pddgw.bench.common import free_port


class Served:
    def __init__(self, tmp: Path, config: str):
        self.tmp = tmp
        self.port = free_port()
        self.config = tmp / "config.toml"
        self.config.write_text(config)
        self.log_path = tmp / "serve.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/responses"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Served:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pddgw", "serve", "--config", str(self.config), "--host", "127.0.0.1",
                 "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pddgw serve exited early:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"pddgw serve did not come up:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    async def state(self) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/debug/state") as r:
            return await r.json()
