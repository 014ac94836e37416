"""The PDD deployment on loopback: router, p0 and rld0 in cluster A, md0 in cluster B.

One config.toml writer (`ClusterToml`) and the four `pddgw serve --role R
--node N` processes from it (`serve_processes`); with `relay_on_p`, p0 is
also the relay (`relay = true`) and there is no rld0: three processes.  The WAN between the
clusters is shaped by the links themselves (`[[net.links]] name = "wan"`);
md0 may sit behind a fault proxy: the config then names the proxy's port
for md0 (what the others dial) and md0 is told its own with `--port`.

Every table body is TOML lines (what a test passes as an option is pasted
into its table); `toml_lines` writes them from Python values.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pddgw.config import load_config
from pddgw.harness.launch import Processes
from pddgw.harness.ports import free_port

ROLES = {"md0": "md", "rld0": "rld", "p0": "prefill", "router": "router"}   # start order: the router dials last
WORKERS = ("md0", "rld0", "p0")


def toml_lines(**values: object) -> str:
    """`key = value` lines: str quoted, bool as true/false, numbers as Python writes them."""
    def val(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (int, float)):
            return repr(v)
        raise TypeError(f"toml_lines: {type(v).__name__} is not a TOML scalar")
    return "\n".join(f"{k} = {val(v)}" for k, v in values.items())


def free_ports(relay_on_p: bool = False) -> dict[str, int]:
    """A free loopback port for each node of the deployment (no rld0 where P relays)."""
    return {name: free_port() for name in ROLES if not (relay_on_p and name == "rld0")}


@dataclass(frozen=True, slots=True)
class ClusterToml:
    """The config.toml of the deployment; each field is the body of its table."""

    model: str = 'dtype = "float64"'
    engine: str = "num_blocks = 256\nblock_size = 16\nmax_num_batched_tokens = 256"
    server: str = ""            # beside host and port
    log: str = ""               # "" = no [log] table
    net: str = "heartbeat_s = 0.5\nstripes = 2\ndead_after_s = 2.0\nrequest_timeout_s = 10.0"   # beside the secret
    wan: str = "gbps = 0.05\nlatency_ms = 20.0"                      # the "wan" link, beside its name
    policy: str = ""
    p_engine: str = ""          # p0's own [nodes.engine] ("" = none)
    md_engine: str = ""         # md0's own [nodes.engine] ("" = none)
    header: str = ""            # a comment on top
    relay_on_p: bool = False    # p0 relays what it prefills; no rld0

    def render(self, ports: Mapping[str, int], secret: str, md_dialed: int | None = None) -> str:
        """The file for `ports` (by node); the others dial md0 at `md_dialed` (default: its own port)."""
        def table(name: str, body: str) -> str:
            return f"[{name}]\n{body.strip()}\n" if body.strip() else ""

        def node(name: str, cluster: str, engine: str = "", port: int | None = None, relay: bool = False) -> str:
            head = f'[[nodes]]\nname = "{name}"\nrole = "{ROLES[name]}"\ncluster = "{cluster}"\n'
            head += "relay = true\n" if relay else ""
            return head + (f"port = {port}\n" if port is not None else "") + table("nodes.engine", engine)

        md = ports["md0"] if md_dialed is None else md_dialed
        parts = [f"# {self.header}\n" if self.header else "",
                 table("model", self.model), table("engine", self.engine),
                 table("server", f'host = "127.0.0.1"\nport = {ports["router"]}\n{self.server}'),
                 table("log", self.log),
                 table("net", f"{toml_lines(secret=secret)}\n{self.net}"),
                 table("[net.links]", f'name = "wan"\n{self.wan}'),
                 table("policy", self.policy),
                 node("router", "A"), node("p0", "A", self.p_engine, ports["p0"], self.relay_on_p),
                 "" if self.relay_on_p else node("rld0", "A", port=ports["rld0"]),
                 node("md0", "B", self.md_engine, md)]
        return "\n".join(p for p in parts if p)

    def write(self, path: Path, ports: Mapping[str, int], secret: str | None = None,
              md_dialed: int | None = None) -> Path:
        """Write and check the file (a bad option fails here, naming the key, not in four processes)."""
        path.write_text(self.render(ports, secret or secrets.token_urlsafe(32), md_dialed))
        load_config(path)
        return path


def serve_processes(directory: Path, config: Path, ports: Mapping[str, int]) -> Processes:
    """The deployment's `pddgw serve` processes, one per node in `ports` (workers first, the
    router last), not started.

    md0 is given its own port, in case the config names a proxy's for it.
    """
    procs = Processes(directory)
    for name, role in ROLES.items():
        if name not in ports:
            continue
        args = ["serve", "--role", role, "--node", name, "--config", str(config)]
        if name == "md0":
            args += ["--port", str(ports["md0"])]
        procs.add(name, args, ports[name])
    return procs
