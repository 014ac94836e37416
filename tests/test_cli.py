"""The command line: every user mistake is one `pddgw: error: ...` line naming the key, file or
address, with exit status 2 (what the user gave) or 1 (what the deployment met), never a traceback;
--version, --help; `pddgw keys` writes a secret, a CA and node certificates a TLS link accepts."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import socket
import ssl
import subprocess
import sys
import threading
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from aiohttp import web

from pddgw import cli
from pddgw.config import TlsConfig, load_config
from pddgw.harness.ports import free_port
from pddgw.deploy.keys import config_lines, write_keys
from pddgw.net.tls import client_context, front_door_context, server_context

ROOT = Path(__file__).resolve().parents[1]
HF_DIR = "(expected a Hugging Face model directory: config.json, *.safetensors, tokenizer.json)"


def pddgw(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pddgw", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def assert_error(r: subprocess.CompletedProcess, message: str, code: int) -> None:
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == f"pddgw: error: {message}", r.stderr
    assert r.returncode == code, (r.returncode, r.stderr)


def nodes_config(tmp_path: Path, net: str = "", rld_device: str = "cpu") -> Path:
    """config.local.toml with the [net] section replaced by `net` and rld0's device by `rld_device`."""
    text = (ROOT / "config.local.toml").read_text()
    head, rest = text.split("[net]\n", 1)
    rest = rest[rest.index("[[net.links]]"):]
    text = head + (net or '[net]\nsecret = "0123456789abcdef0123"\n') + "\n" + rest
    text = text.replace('[nodes.engine]                 # a small relay: fewer blocks, smaller batches\n'
                        'device = "cpu"', f'[nodes.engine]\ndevice = "{rld_device}"')
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


# ---- --version, --help ---------------------------------------------------------------------


def test_version_is_the_package_metadata():
    r = pddgw("--version")
    assert r.returncode == 0 and r.stdout == f"pddgw {version('pddgw')}\n"


def test_help_lists_every_command_with_one_line():
    r = pddgw("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for name, line in cli.COMMANDS:
        assert f"{name} {line}" in text, name
    assert [n for n, _ in cli.COMMANDS] == ["serve", "chat", "keys", "generate", "export-model", "sim", "plan"]


# ---- what the user gave: exit 2 -------------------------------------------------------------


def test_bad_model_path_serve_and_generate(tmp_path):
    missing = tmp_path / "no-such-model"
    assert_error(pddgw("serve", "--model", str(missing)), f"--model: {missing}: no such directory {HF_DIR}", 2)
    assert_error(pddgw("generate", "--prompt", "hi", "--model", str(missing)),
                 f"--model: {missing}: no such directory {HF_DIR}", 2)
    (tmp_path / "file").write_text("x")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "file"}"\n')
    assert_error(pddgw("serve", "--config", str(cfg)), f"model.path: {tmp_path / 'file'}: not a directory {HF_DIR}", 2)
    (tmp_path / "empty").mkdir()
    assert_error(pddgw("serve", "--model", str(tmp_path / "empty")),
                 f"--model: {tmp_path / 'empty'}: no config.json (expected a Hugging Face model directory)", 2)


def test_unknown_device_names_node_and_key(tmp_path):
    cfg = nodes_config(tmp_path, rld_device="gpu")
    assert_error(pddgw("serve", "--config", str(cfg), "--role", "rld", "--node", "rld0"),
                 'nodes[2].engine.device: "gpu" is not a device torch knows (node rld0); use "cpu", "cuda" or "cuda:N"',
                 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_cpu_machine_says_use_cpu(tmp_path):
    cfg = nodes_config(tmp_path, rld_device="cuda")
    assert_error(pddgw("serve", "--config", str(cfg), "--role", "rld", "--node", "rld0"),
                 'nodes[2].engine.device: "cuda", but this machine has no CUDA device that torch can use '
                 '(node rld0); use device = "cpu"', 2)
    emb = tmp_path / "e.toml"
    emb.write_text('[engine]\ndevice = "cuda"\n')
    assert_error(pddgw("serve", "--config", str(emb)),
                 'engine.device: "cuda", but this machine has no CUDA device that torch can use; use device = "cpu"',
                 2)


def test_device_checks_in_process():
    cli.check_device("engine.device", "cpu")
    with pytest.raises(cli.ConfigError, match=r'^x: "tpu" is not a device torch knows; use "cpu"'):
        cli.check_device("x", "tpu")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        cli.check_device("x", "cuda:0")
        with pytest.raises(cli.ConfigError, match=rf'^x: "cuda:{n}", but this machine has {n} CUDA device\(s\): '):
            cli.check_device("x", f"cuda:{n}")


def test_the_embedded_default_sends_p_s_first_token_early_and_a_config_says_for_itself(tmp_path):
    """No config: `policy.first_token_from_p` on (P's first token straight to the client); a config
    file's own setting, else the default (off), is kept."""
    parse = cli.build_parser().parse_args
    assert cli._config_with_overrides(parse(["serve"])).policy.first_token_from_p is True
    for text, want in (("", False), ("[policy]\nfirst_token_from_p = true\n", True)):
        path = tmp_path / "c.toml"
        path.write_text(text)
        assert cli._config_with_overrides(parse(["serve", "--config", str(path)])).policy.first_token_from_p is want


def test_unreadable_secret_file(tmp_path):
    secret = tmp_path / "etc" / "link-secret"
    cfg = nodes_config(tmp_path, net=f'[net]\nsecret_file = "{secret}"\n')
    assert_error(pddgw("serve", "--config", str(cfg), "--role", "md", "--node", "md0"),
                 f"net.secret_file: cannot read {secret}: No such file or directory", 2)


def test_missing_secret(tmp_path):
    cfg = nodes_config(tmp_path, net="[net]\nstripes = 1\n")
    assert_error(pddgw("serve", "--config", str(cfg), "--role", "prefill", "--node", "p0"),
                 "net.secret: node links need a shared secret: set net.secret_file "
                 "(`pddgw keys DIR --config CFG` writes one) or net.secret", 2)


def test_unreadable_certificates_name_key_and_file(tmp_path):
    keys = tmp_path / "keys"
    tls = (f'[net]\nsecret = "0123456789abcdef0123"\n[net.tls]\nenabled = true\nmutual = true\n'
           f'cert_file = "{keys}/{{node}}.crt"\nkey_file = "{keys}/{{node}}.key"\nca_file = "{keys}/ca.crt"\n')
    cfg = nodes_config(tmp_path, net=tls)
    assert_error(pddgw("serve", "--config", str(cfg), "--role", "md", "--node", "md0"),
                 f"net.tls.ca_file: cannot read {keys}/ca.crt: No such file or directory", 2)
    write_keys(keys, load_config(cfg))
    (keys / "md0.key").unlink()
    assert_error(pddgw("serve", "--config", str(cfg), "--role", "md", "--node", "md0"),
                 f"net.tls.key_file: cannot read {keys}/md0.key: No such file or directory", 2)
    (keys / "md0.key").write_text("not a key\n")
    r = pddgw("serve", "--config", str(cfg), "--role", "md", "--node", "md0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"pddgw: error: net.tls.cert_file: {keys}/md0.crt with net.tls.key_file "
                               f"{keys}/md0.key: not a PEM certificate and its private key ("), r.stderr


def test_config_errors_use_the_same_prefix(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[engine]\nblock_sise = 16\n")
    r = pddgw("serve", "--config", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"pddgw: error: {p}: engine.block_sise: unknown key (known keys here: ")
    assert_error(pddgw("serve", "--config", str(tmp_path / "nope.toml")),
                 f"{tmp_path / 'nope.toml'}: cannot read config: No such file or directory", 2)
    assert_error(pddgw("serve", "--config", str(ROOT / "config.local.toml"), "--role", "rld", "--node", "md0"),
                 "--role rld: pick one node with --node (nodes of that role: rld0)", 2)


# ---- what the deployment met: exit 1 ----------------------------------------------------------


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_error(pddgw("serve", "--model", "tiny", "--port", str(port)),
                     f"cannot listen on 127.0.0.1:{port}: address already in use", 1)


def test_worker_port_in_use(tmp_path):
    cfg = nodes_config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_error(pddgw("serve", "--config", str(cfg), "--role", "md", "--node", "md0", "--port", str(port)),
                     f"cannot listen on 127.0.0.1:{port}: address already in use", 1)


def test_chat_cannot_connect():
    url = f"ws://127.0.0.1:{free_port()}/v1/responses"
    assert_error(pddgw("chat", "hi", "--url", url),
                 f"cannot connect to {url}: connection refused (is the router running? `pddgw serve` starts one)", 1)


class FakeRouter:
    """A front door that refuses like pddgw's (401 before the upgrade without the key) in a thread."""

    KEY = "right-key"

    def __init__(self, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.port = free_port()
        self.ssl_ctx = ssl_ctx
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.KEY}":
            return web.json_response({"error": {"type": "invalid_api_key", "message":
                                                "invalid or missing API key (Authorization: Bearer KEY)"}},
                                     status=401)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        await ws.send_str('{"type": "error", "error": {"code": "overloaded", "message": "too many requests"}}')
        await ws.close()
        return ws

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/responses", self._responses)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port,
                                                  ssl_context=self.ssl_ctx).start())
        ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fake_router():
    r = FakeRouter()
    yield r
    r.close()


def test_chat_refused(fake_router):
    url = f"ws://127.0.0.1:{fake_router.port}/v1/responses"
    assert_error(pddgw("chat", "hi", "--url", url),
                 f"{url}: 401 Unauthorized: the router needs an API key: pass --api-key KEY "
                 "(one of the router config's [server] api_keys)", 1)
    assert_error(pddgw("chat", "hi", "--url", url, "--api-key", "wrong"),
                 f"{url}: 401 Unauthorized: the router refused the API key: pass --api-key KEY "
                 "(one of the router config's [server] api_keys)", 1)
    bad = f"ws://127.0.0.1:{fake_router.port}/v1/chat"
    assert_error(pddgw("chat", "hi", "--url", bad, "--api-key", FakeRouter.KEY),
                 f"{bad}: 404 Not Found: wrong URL path; the router's chat endpoint is ws://HOST:PORT/v1/responses", 1)
    assert_error(pddgw("chat", "hi", "--url", url, "--api-key", FakeRouter.KEY),
                 "the router answered with an error (overloaded): too many requests", 1)


def test_chat_to_a_tls_front_door(tmp_path):
    from pddgw.config import Config

    write_keys(tmp_path / "k", Config())
    router = FakeRouter(front_door_context(TlsConfig(front_door=True, cert_file=f"{tmp_path}/k/router.crt",
                                                     key_file=f"{tmp_path}/k/router.key")))
    try:
        wss, ws = (f"{scheme}://127.0.0.1:{router.port}/v1/responses" for scheme in ("wss", "ws"))
        assert_error(pddgw("chat", "hi", "--url", wss),
                     f"cannot connect to {wss}: TLS failed (CERTIFICATE_VERIFY_FAILED); pass the CA that signed "
                     "the router's certificate with --ca-file", 1)
        assert_error(pddgw("chat", "hi", "--url", ws),
                     f"{ws}: the server closed the connection before the WebSocket handshake: a router with "
                     "[net.tls] front_door = true needs wss:// (and --ca-file)", 1)
        assert_error(pddgw("chat", "hi", "--url", wss, "--ca-file", f"{tmp_path}/k/ca.crt"),
                     f"{wss}: 401 Unauthorized: the router needs an API key: pass --api-key KEY "
                     "(one of the router config's [server] api_keys)", 1)
        assert_error(pddgw("chat", "hi", "--url", wss, "--ca-file", f"{tmp_path}/nope.crt"),
                     f"--ca-file: cannot read {tmp_path}/nope.crt: No such file or directory", 1)
    finally:
        router.close()


# ---- pddgw keys ------------------------------------------------------------------------------


def test_keys_writes_what_the_local_config_uses(tmp_path):
    r = pddgw("keys", "local-keys", "--config", str(ROOT / "config.local.toml"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    keys = tmp_path / "local-keys"
    names = sorted(p.name for p in keys.iterdir())
    assert names == sorted(["link-secret", "ca.crt", "ca.key"] + [f"{n}.{e}" for n in ("router", "p0", "rld0", "md0")
                                                                  for e in ("crt", "key")])
    assert len((keys / "link-secret").read_text().strip()) == 64
    for private in ("link-secret", "ca.key", "md0.key"):
        assert (keys / private).stat().st_mode & 0o077 == 0, private
    assert "wrote local-keys/md0.crt, local-keys/md0.key  (node md0: 127.0.0.1, md0, localhost)" in r.stdout
    assert r.stdout.endswith(config_lines("local-keys"))
    # config.local.toml's own [net] lines are the ones printed
    local = (ROOT / "config.local.toml").read_text()
    for line in config_lines("local-keys").splitlines():
        if "=" in line:
            key, value = line.split(" = ")
            assert f"{key} = {value}" in local, line
    again = pddgw("keys", "local-keys", "--config", str(ROOT / "config.local.toml"), cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.startswith(
        "pddgw: error: local-keys: would overwrite local-keys/link-secret, local-keys/ca.crt, ")
    assert again.stderr.rstrip().endswith("pass --force to replace them, or pick another directory")
    assert pddgw("keys", "local-keys", "--config", str(ROOT / "config.local.toml"), "--force",
                 cwd=tmp_path).returncode == 0


def test_node_certificates_have_sans_and_the_ca():
    from cryptography import x509

    cfg = load_config(ROOT / "config.toml")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        w = write_keys(d, cfg)
        ca = x509.load_pem_x509_certificate(w.ca_cert.read_bytes())
        for n in cfg.nodes:
            crt, _, names = w.nodes[n.name]
            cert = x509.load_pem_x509_certificate(crt.read_bytes())
            assert cert.issuer == ca.subject
            cert.verify_directly_issued_by(ca)
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            ips = [str(i) for i in san.get_values_for_type(x509.IPAddress)]
            dns = san.get_values_for_type(x509.DNSName)
            assert n.host in ips and "127.0.0.1" in ips and "localhost" in dns and n.name in dns
        # the router's also names the front door's host, unless it is a wildcard (config.toml: 0.0.0.0)
        assert w.nodes["router"][2] == ("10.0.0.10", "router", "localhost", "127.0.0.1")


async def test_keys_make_a_mutual_tls_link(tmp_path):
    """The CA, two node certificates and their contexts: a mutual handshake on 127.0.0.1 succeeds."""
    cfg = load_config(ROOT / "config.local.toml")
    write_keys(tmp_path, cfg)
    base = TlsConfig(enabled=True, mutual=True, cert_file=f"{tmp_path}/{{node}}.crt",
                     key_file=f"{tmp_path}/{{node}}.key", ca_file=f"{tmp_path}/ca.crt")
    srv, cli_ctx = server_context(base.for_node("md0")), client_context(base.for_node("p0"))
    peer: list = []

    async def handle(reader, writer):
        peer.append(writer.get_extra_info("peercert"))
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=srv)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=cli_ctx)
    assert await reader.read() == b"ok"
    writer.close()
    server.close()
    assert dict(x[0] for x in peer[0]["subject"])["commonName"] == "p0"
    # a client without a certificate is refused by a mutual server
    bare = client_context(TlsConfig(enabled=True, ca_file=f"{tmp_path}/ca.crt"))
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=srv)
    port = server.sockets[0].getsockname()[1]
    try:        # TLS 1.3: the server's refusal arrives after the client's side of the handshake
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=bare)
        data = await reader.read()
        writer.close()
    except (ssl.SSLError, ConnectionError):
        data = b""
    server.close()
    assert data == b"" and len(peer) == 1
    assert front_door_context(base.for_node("router")) is None


async def test_front_door_tls(tmp_path):
    """`[net.tls] front_door = true`: the embedded deployment's front door speaks https/wss with
    the router's certificate from `pddgw keys`; a client that trusts the CA connects, plain HTTP does not."""
    import aiohttp

    from pddgw.config import Config, NetConfig
    from pddgw.deploy import serve as deploy

    write_keys(tmp_path, Config())
    port = free_port()
    cfg = Config(net=NetConfig(tls=TlsConfig(front_door=True, cert_file=f"{tmp_path}/router.crt",
                                             key_file=f"{tmp_path}/router.key")))
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, port=port))
    ready = asyncio.Event()
    task = asyncio.create_task(deploy.run_embedded(cfg, ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 60)
        ctx = ssl.create_default_context(cafile=f"{tmp_path}/ca.crt")
        async with aiohttp.ClientSession() as s:
            async with s.get(f"https://127.0.0.1:{port}/health", ssl=ctx) as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            ws = await s.ws_connect(f"wss://127.0.0.1:{port}/v1/responses", ssl=ctx)
            await ws.close()
            with pytest.raises(aiohttp.ClientError):
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    await r.read()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_front_door_files_must_be_readable(tmp_path):
    from pddgw.config import ConfigError

    with pytest.raises(ConfigError) as ei:
        front_door_context(TlsConfig(front_door=True, front_cert_file=f"{tmp_path}/door.crt",
                                     front_key_file=f"{tmp_path}/door.key"))
    assert str(ei.value) == f"net.tls.front_cert_file: cannot read {tmp_path}/door.crt: No such file or directory"


async def test_router_without_workers_says_which_node(tmp_path):
    """A router whose workers never answer ends with a StartupError naming the node and its URL."""
    from pddgw.config import StartupError
    from pddgw.deploy import serve as deploy

    cfg = load_config(nodes_config(tmp_path))
    port = free_port()
    cfg = dataclasses.replace(cfg, nodes=tuple(n if n.role == "router" else dataclasses.replace(n, port=port)
                                               for n in cfg.nodes))      # every worker: a port nobody listens on
    with pytest.raises(StartupError) as ei:
        await deploy.run_router(cfg, cfg.node("router"), port=free_port(), dial_wait_s=0.3)
    msg = str(ei.value)
    assert msg.startswith(f"cannot reach prefill node p0 at ws://127.0.0.1:{port}/pddgw/link within 0.3 s: "), msg
    assert msg.endswith("(start every worker node with `pddgw serve --config ... --node NAME`; the router waits "
                        "0.3 s for them; every node needs the same net secret and CA)"), msg


def test_chat_port_and_host_name_the_router(fake_router):
    url = f"ws://127.0.0.1:{fake_router.port}/v1/responses"
    assert_error(pddgw("chat", "hi", "--port", str(fake_router.port)),
                 f"{url}: 401 Unauthorized: the router needs an API key: pass --api-key KEY "
                 "(one of the router config's [server] api_keys)", 1)
    assert_error(pddgw("chat", "hi", "--host", "127.0.0.1", "--port", str(fake_router.port), "--api-key",
                       FakeRouter.KEY), "the router answered with an error (overloaded): too many requests", 1)
    args = cli.build_parser().parse_args(["chat", "--host", "10.1.2.3", "--port", "9"])
    assert (args.host, args.port, args.url) == ("10.1.2.3", 9, None)


@pytest.mark.parametrize("cmd", [["serve"], ["generate", "--prompt", "x"], ["export-model", "DIR"]])
def test_one_default_model_for_serve_generate_and_export(cmd):
    args = cli.build_parser().parse_args(cmd)
    assert cli._config_with_overrides(args).model.path == "smollm2" == cli.DEFAULT_MODEL
    assert cli._model_key(args) == "--model"
    args = cli.build_parser().parse_args([*cmd, "--model", "tiny"])
    assert cli._config_with_overrides(args).model.path == "tiny"
    # A config's own [model] path wins; config.local.toml names none: the tiny model.
    args = cli.build_parser().parse_args([*cmd, "--config", str(ROOT / "config.local.toml")])
    assert cli._config_with_overrides(args).model.path == "" == load_config(str(ROOT / "config.local.toml")).model.path
    assert cli._model_key(args) == "model.path"


async def _frozen(serving, ready: asyncio.Event, cancel_once_frozen: bool = False) -> int:
    """deploy.frozen_once_ready(serving, ready) to its end (cancelled once the heap is frozen, if
    asked) -> the objects frozen then; the test process's heap is unfrozen again after."""
    from pddgw.deploy import serve as deploy

    gc.unfreeze()
    task = asyncio.ensure_future(deploy.frozen_once_ready(serving, ready))
    try:
        for _ in range(1000):
            if task.done() or (cancel_once_frozen and gc.get_freeze_count()):
                break
            await asyncio.sleep(0)
        if cancel_once_frozen:
            task.cancel()
        await task
        return gc.get_freeze_count()
    finally:
        gc.unfreeze()


async def test_the_start_up_heap_is_frozen_once_the_server_answers():
    ready = asyncio.Event()
    seen: list[int] = []

    async def serving() -> None:
        seen.append(gc.get_freeze_count())           # starting: nothing frozen yet
        ready.set()
        for _ in range(100):                          # serving goes on while the heap is frozen
            await asyncio.sleep(0)
            if gc.get_freeze_count():
                break
        seen.append(gc.get_freeze_count())

    assert await _frozen(serving(), ready) > 1000
    assert seen[0] == 0 and seen[1] > 1000          # this process's heap: tens of thousands of objects


async def test_a_server_that_fails_before_answering_freezes_nothing():
    async def serving() -> None:
        raise OSError("cannot listen")

    from pddgw.deploy import serve as deploy

    gc.unfreeze()
    try:
        with pytest.raises(OSError, match="cannot listen"):
            await deploy.frozen_once_ready(serving(), asyncio.Event())
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


async def test_cancelling_a_frozen_server_unwinds_it():
    ready, unwound = asyncio.Event(), asyncio.Event()

    async def serving() -> None:
        ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            unwound.set()

    with pytest.raises(asyncio.CancelledError):
        await _frozen(serving(), ready, cancel_once_frozen=True)
    assert unwound.is_set()
