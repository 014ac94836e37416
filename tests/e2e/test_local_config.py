"""End to end: the shipped config.local.toml started by the README's own commands.

The commands come from README.md, the fenced block between the markers
`<!-- local-config:begin -->` and `<!-- local-config:end -->` (the section
on running four processes on one machine).  Each line whose first word is `pddgw` (or
ends in `/pddgw`) runs as `python -m pddgw ...` in a scratch folder holding a
copy of config.local.toml whose ports are rewritten to free ones: `keys` to
the end, `serve ... &` in the background, `chat` with the router's URL
appended.  The chat must complete; every process started here is stopped here,
by its pid.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from pddgw.harness.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- local-config:begin -->", "<!-- local-config:end -->"

def readme_commands(text: str) -> str:
    """The fenced block between the markers."""
    assert BEGIN in text and END in text, f"README.md has no {BEGIN} ... {END} block"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    m = re.search(r"```[a-z]*\n(.*?)```", block, re.S)
    assert m, f"no fenced block between {BEGIN} and {END}"
    return m.group(1)


def parse(block: str) -> list[tuple[list[str], bool]]:
    """(argv after `pddgw`, background?) for each pddgw line of a shell block."""
    out = []
    for line in block.splitlines():
        line = line.split(" #", 1)[0].strip()
        background = line.endswith("&")
        words = shlex.split(line.rstrip("&"))
        if words and (words[0] == "pddgw" or words[0].endswith("/pddgw")):
            out.append((words[1:], background))
    return out


def local_config_with_free_ports(dest: Path) -> int:
    """A copy of config.local.toml with every port replaced by a free one; returns the router's."""
    text = (ROOT / "config.local.toml").read_text()
    ports = {}

    def sub(m: re.Match) -> str:
        ports[m.group(2)] = free_port()
        return f"{m.group(1)}{ports[m.group(2)]}"

    text = re.sub(r"^(port = )(\d+)", sub, text, flags=re.M)
    assert sorted(ports) == ["8000", "9101", "9102", "9201"], ports
    (dest / "config.local.toml").write_text(text)
    return ports["8000"]


def test_block_parses_to_keys_four_servers_and_a_chat():
    cmds = parse(readme_commands((ROOT / "README.md").read_text()))
    assert [c[0][0] for c in cmds] == ["keys", "serve", "serve", "serve", "serve", "chat"]
    assert [c[1] for c in cmds] == [False, True, True, True, True, False]
    nodes = [argv[argv.index("--node") + 1] for argv, _ in cmds if argv[0] == "serve"]
    assert sorted(nodes) == ["md0", "p0", "rld0", "router"]


def test_readme_commands_start_the_local_config_and_chat(tmp_path):
    block = readme_commands((ROOT / "README.md").read_text())
    router_port = local_config_with_free_ports(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        for argv, background in parse(block):
            cmd = [sys.executable, "-m", "pddgw", *argv]
            if argv[0] == "chat":
                cmd += ["--url", f"ws://127.0.0.1:{router_port}/v1/responses", "--max-tokens", "24", "--json"]
            if background:
                name = argv[argv.index("--node") + 1]
                log = open(tmp_path / f"{name}.log", "wb")
                procs.append((name, subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                                     env=env)))
                continue
            done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
            logs = "".join(f"\n--- {n}\n" + (tmp_path / f"{n}.log").read_text()[-3000:] for n, _ in procs)
            assert done.returncode == 0, f"{argv}: {done.stderr}{logs}"
            assert "Traceback" not in done.stderr
            if argv[0] == "keys":
                assert "local-keys/link-secret" in done.stdout
            if argv[0] == "chat":
                resp = orjson.loads(done.stdout.splitlines()[-1])
                assert resp["object"] == "response" and resp["usage"]["output_tokens"] > 0, resp
                assert resp["pddgw"]["pipeline"] in ("P-MD", "P-RLD-MD", "P-RLD"), resp["pddgw"]
        for name, p in procs:
            assert p.poll() is None, f"{name} exited:\n" + (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.terminate()
        for _, p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
    for name, _ in procs:
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text(), name
