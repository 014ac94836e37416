"""pddgw command line: generate (one request on a local engine), serve, chat, sim."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import orjson

from pddgw.config import Config, ConfigError, load_config


def _parse_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _config_with_overrides(args: argparse.Namespace) -> Config:
    import dataclasses

    cfg = load_config(args.config)
    if args.model:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=args.model))
    if args.dtype:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=args.dtype))
    return cfg


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from pddgw.engines.base import create_engine
    from pddgw.engines.types import EngineRequest, RequestError, SamplingParams

    engine, tokenizer = create_engine(_config_with_overrides(args))
    ids = args.prompt_ids if args.prompt_ids is not None else tuple(tokenizer.encode(args.prompt))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        engine.add_request(EngineRequest("cli", ids, params))
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out: list[int] = []
    with torch.inference_mode():
        while engine.has_work():
            for o in engine.step():
                out += o.new_token_ids
                if not args.json and o.new_token_ids:
                    print(tokenizer.decode(list(o.new_token_ids)), end="", flush=True)
    text = tokenizer.decode(out)
    if args.json:
        sys.stdout.write(orjson.dumps({"token_ids": out, "text": text}).decode() + "\n")
    else:
        print()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from pddgw.pipeline import deploy

    from pddgw.logs import setup_logging

    cfg = _config_with_overrides(args)
    setup_logging(cfg.log.level, json=args.log_json or cfg.log.json)   # the config's [log], now that it is read
    if args.api_key:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_keys=tuple(args.api_key)))
    if args.role == "all":
        if args.node:
            raise ConfigError("--node names one node of a multi-node config; --role all runs them all")
        main = deploy.run_embedded(cfg, args.host, args.port)
    else:
        if not cfg.nodes:
            raise ConfigError(f"--role {args.role} needs a config with [[nodes]] (or use --role all)")
        candidates = [n for n in cfg.nodes if n.role == args.role and (not args.node or n.name == args.node)]
        if len(candidates) != 1:
            names = ", ".join(n.name for n in cfg.nodes if n.role == args.role) or "none"
            raise ConfigError(f"--role {args.role}: pick one node with --node (nodes of that role: {names})")
        me = candidates[0]
        runner = deploy.run_router if me.role == "router" else deploy.run_worker
        main = runner(cfg, me, args.host, args.port)
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)
    except KeyboardInterrupt:
        pass
    return 0


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
    """A streaming chat client: RLD's eager tokens in one colour, MD's in another."""
    import asyncio

    import aiohttp

    colour = {"rld": "\x1b[33m", "md": "\x1b[36m"} if sys.stdout.isatty() and not args.json else {}
    reset = "\x1b[0m" if colour else ""

    async def turn(ws, history: list[dict]) -> str:
        await ws.send_str(orjson.dumps({"type": "response.create", "input": history,
                                        "instructions": args.system, "max_output_tokens": args.max_tokens,
                                        "temperature": args.temperature}).decode())
        while True:
            ev = orjson.loads((await ws.receive()).data)
            if ev["type"] == "response.output_text.delta" and not args.json:
                print(colour.get(ev["pddgw"]["role"], "") + ev["delta"] + reset, end="", flush=True)
            elif ev["type"] == "error":
                raise SystemExit(f"error: {ev['error']['message']}")
            elif ev["type"] == "response.completed":
                tl = ev["response"]["pddgw"]
                if args.json:
                    print(orjson.dumps(ev["response"]).decode())
                else:
                    print(f"\n[{tl['pipeline']}, ttft {tl['ttft_ms']:.0f} ms, rld {tl['tokens_by_role'].get('rld', 0)}"
                          f" / md {tl['tokens_by_role'].get('md', 0)} tokens, handoff at {tl['handoff_position']},"
                          f" stall {tl['handoff_stall_ms']} ms, wan {tl['wan_kv_bytes']} B]")
                return ev["response"]["output"][0]["content"][0]["text"]

    async def main() -> None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with aiohttp.ClientSession() as s, s.ws_connect(args.url, headers=headers) as ws:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pddgw", description=__doc__)
    p.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="run one request on a local engine and print the output")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--config", help="config.toml (model and engine sections are used)")
    g.add_argument("--model", help="Hugging Face model directory (default: built-in tiny model)")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"])
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print {token_ids, text} as JSON")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="run a node (or, with --role all, the whole deployment)")
    s.add_argument("--role", choices=["router", "prefill", "rld", "md", "all"], default="all")
    s.add_argument("--config", help="config.toml (default: the embedded deployment)")
    s.add_argument("--node", help="which node of the config this process is")
    s.add_argument("--host", help="listen address (default: the config's)")
    s.add_argument("--port", type=int, help="listen port (default: the config's; 8000 for the front door)")
    s.add_argument("--model", help="Hugging Face model directory for every role (default: tiny)")
    s.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"])
    s.add_argument("--api-key", action="append", help="accept this API key (repeatable)")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="stream a chat against a running router (RLD tokens yellow, MD cyan)")
    c.add_argument("message", nargs="*", help="user turns to send (none: read turns from stdin)")
    c.add_argument("--url", default="ws://127.0.0.1:8000/v1/responses")
    c.add_argument("--api-key")
    c.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt (default: a long agent prompt)")
    c.add_argument("--max-tokens", type=int, default=400)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--json", action="store_true", help="print each completed response as JSON")
    c.set_defaults(func=cmd_chat)
    sub.add_parser("sim", help="simulate deployments of a scenario on a virtual clock "
                   "(pddgw sim --scenario FILE.toml [--trace T.jsonl] [--json] [--plots DIR])")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        # The simulator has its own options (pddgw.sim.run); `pddgw sim --help` lists them.
        from pddgw.sim.run import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    from pddgw.logs import setup_logging

    setup_logging(json=args.log_json)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
