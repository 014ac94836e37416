"""A real `pddgw serve` process (the embedded default: every role in one process)
on 127.0.0.1, from a config text; started and stopped (by its pid) by the test."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from pddgw.harness.launch import Processes
from pddgw.harness.ports import free_port


class Served:
    def __init__(self, tmp: Path, config: str):
        self.tmp = tmp
        self.port = free_port()
        self.config = tmp / "config.toml"
        self.config.write_text(config)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/responses"
        self.procs = Processes(tmp)
        self.procs.add("serve", ["serve", "--config", str(self.config), "--host", "127.0.0.1",
                                 "--port", str(self.port)], self.port)

    def start(self) -> Served:
        self.procs.start()
        return self

    def log(self) -> str:
        return self.procs.log("serve", None)

    def stop(self) -> None:
        self.procs.stop()

    async def state(self) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/debug/state") as r:
            return await r.json()
