"""The web chat page (api/webchat.py, api/static/) in a real headless Chromium.

An embedded deployment (tiny model, float64) serves its front door and the
page on a real 127.0.0.1 port; Playwright drives the system's Chromium
(`executable_path`: Playwright's own browser download needs the internet).
The test reads the WebSocket frames the page exchanges and checks the page
against them: the text of the answer, one span per delta coloured by the
delta's role (P / RLD / MD, as the legend shows), the timeline under each
answer, and a second turn that sends the whole conversation as `input`.
A screenshot goes to tmp_path (and to $PDDGW_SCREENSHOT_DIR when set).

Skips when the `playwright` package or a Chromium binary is missing
($PDDGW_CHROMIUM names one; else `chromium` / `chromium-browser` /
`google-chrome` on PATH).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from pddgw.api.server import build_app
from pddgw.api.webchat import add_webchat_routes
from pddgw.cli import DEFAULT_SYSTEM
from pddgw.config import Config, EngineConfig, ModelConfig, NetConfig, PolicyConfig, ServerConfig, ShapingConfig
from pddgw.deploy.serve import Embedded


def _chromium() -> str | None:
    if os.environ.get("PDDGW_CHROMIUM"):
        return os.environ["PDDGW_CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def _cfg(api_keys: tuple[str, ...] = ()) -> Config:
    # A WAN (0.5 Gbps, 20 ms one way) slow enough that a forced P-RLD-MD streams RLD tokens while the
    # page's default instructions' KV (~1,200 tokens, 1.2 MB) crosses; forcing needs allow_request_steering.
    return Config(model=ModelConfig(dtype="float64"),
                  engine=EngineConfig(num_blocks=256, block_size=16, max_num_batched_tokens=256),
                  net=NetConfig(links=(ShapingConfig(name="wan", gbps=0.5, latency_ms=20.0),)),
                  policy=PolicyConfig(first_token_from_p=True),     # the embedded default's: P's colour too
                  server=ServerConfig(max_streams_per_connection=4, api_keys=api_keys,
                                      allow_request_steering=True))


def _browser_or_skip() -> tuple[Any, str]:
    """-> (playwright.async_api, the Chromium binary), or skip saying which is missing."""
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (apt-get install chromium, or set PDDGW_CHROMIUM)")
    async_api = pytest.importorskip("playwright.async_api", reason="the playwright package is not installed")
    return async_api, chromium


# ---- the routes themselves (no browser) ------------------------------------------------


async def test_page_and_static_files_are_served_from_the_package(aiohttp_client):
    app = web.Application()
    add_webchat_routes(app)
    client = await aiohttp_client(app)
    r = await client.get("/")
    assert r.status == 200 and r.content_type == "text/html"
    html = await r.text()
    assert 'src="static/app.js"' in html and 'href="static/style.css"' in html
    assert "connect-src 'self'" in r.headers["Content-Security-Policy"]
    for name, ctype in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = await client.get(f"/static/{name}")
        assert (r.status, r.content_type) == (200, ctype), name
        assert r.headers["X-Content-Type-Options"] == "nosniff"
    for path in ("/static/index.html", "/static/nope.js", "/static/..%2Fwebchat.py", "/static/%2e%2e/server.py"):
        assert (await client.get(path)).status == 404, path


# ---- the page in Chromium --------------------------------------------------------------


@pytest.fixture
async def webchat(request):
    """-> (base URL, RouterSide): the front door plus the page on a free 127.0.0.1 port.

    Parametrize indirectly with api_keys to set `[server] api_keys`."""
    emb = Embedded(_cfg(getattr(request, "param", ())))
    side = await emb.start()
    app = build_app(side.door)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/", side
    finally:
        await runner.cleanup()
        await side.router.drain()
        state = await side.state()
        await emb.stop()
    for name, st in state["nodes"].items():
        assert st["kv_blocks_in_use"] == 0, (name, st)


class Frames:
    """The page's WebSocket traffic, decoded: what it sent and what it received."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        self.urls: list[str] = []

    def attach(self, ws: Any) -> None:
        self.urls.append(ws.url)
        ws.on("framesent", lambda payload: self.sent.append(orjson.loads(payload)))
        ws.on("framereceived", lambda payload: self.received.append(orjson.loads(payload)))

    def of(self, stream_id: str) -> list[dict[str, Any]]:
        return [e for e in self.received if e.get("stream_id") == stream_id]


SPANS_JS = """(msg) => {
  const legend = {};
  for (const role of ['prefill', 'rld', 'md']) {
    const s = getComputedStyle(document.getElementById('swatch-' + role));
    legend[role] = [s.color, s.backgroundColor];
  }
  return {
    legend,
    text: msg.querySelector('.answer').textContent,
    dataText: msg.dataset.text,
    spans: [...msg.querySelectorAll('.answer .tok')].map(s => ({
      text: s.textContent, role: s.dataset.role, tail: s.classList.contains('tail'),
      position: s.dataset.position === undefined ? null : Number(s.dataset.position),
      ids: s.dataset.tokenIds ? s.dataset.tokenIds.split(',').map(Number) : [],
      colour: [getComputedStyle(s).color, getComputedStyle(s).backgroundColor]})),
    states: [...msg.querySelectorAll('.timeline .states li .st')].map(s => s.textContent),
    timeline: {pipeline: msg.querySelector('.timeline').dataset.pipeline,
               ttft: msg.querySelector('.timeline').dataset.ttftMs,
               text: msg.querySelector('.timeline').innerText},
  };
}"""


async def finished_turn(page: Any, n: int) -> Any:
    """Wait until the page's n-th answer has ended -> its element; it must have completed."""
    await page.wait_for_function(
        "n => [...document.querySelectorAll('.msg.assistant')].filter(m => m.dataset.status !== 'streaming')"
        ".length >= n", arg=n)
    msg = (await page.query_selector_all(".msg.assistant"))[n - 1]
    status = await msg.get_attribute("data-status")
    assert status == "completed", (status, await msg.inner_text())
    return msg


def check_turn(page_view: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The page shows exactly what the server sent for one response -> its timeline."""
    types = [e["type"] for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    resp = events[-1]["response"]
    text = resp["output"][0]["content"][0]["text"]
    tl = resp["pddgw"]
    # The answer's text is the response's text.
    assert page_view["text"] == text and page_view["dataText"] == text
    # One span per delta, in order, with its text, role, position and token ids.
    streamed = [s for s in page_view["spans"] if not s["tail"]]
    assert [(s["text"], s["role"], s["position"], s["ids"]) for s in streamed] == \
           [(d["delta"], d["pddgw"]["role"], d["pddgw"]["position"], d["pddgw"]["token_ids"]) for d in deltas]
    assert [i for d in deltas for i in d["pddgw"]["token_ids"]] == tl["output_token_ids"]
    # The states panel: one step per state of the timeline the page asked for.
    assert page_view["states"] == [s["state"] for s in tl["states"]] and tl["states"][-1]["state"] == "FINISHED"
    # Each span wears its role's colours, the legend's.
    legend = page_view["legend"]
    assert len({tuple(c) for c in legend.values()}) == 3          # three roles, three colours
    for s in page_view["spans"]:
        assert s["colour"] == legend[s["role"]], s
    # The timeline: the pipeline and the TTFT the server measured, shown under the answer.
    assert page_view["timeline"]["pipeline"] == tl["pipeline"]
    assert float(page_view["timeline"]["ttft"]) == tl["ttft_ms"]
    shown = page_view["timeline"]["text"]
    assert tl["pipeline"] in shown and "TTFT" in shown and "WAN KV" in shown
    if tl["handoff_position"] is not None:
        assert f"at token {tl['handoff_position']}" in shown
    return tl


async def test_web_chat_streams_colours_tokens_by_role_and_shows_the_timeline(webchat, tmp_path):
    async_api, chromium = _browser_or_skip()
    url, side = webchat
    frames = Frames()
    problems: list[str] = []
    async with async_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(60_000)
            page.on("websocket", frames.attach)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type == "error" else None)
            await page.goto(url)
            await page.wait_for_selector("body[data-conn=open]")
            assert frames.urls == [url.replace("http://", "ws://") + "v1/responses"]

            # Turn 1, forced through RLD: its first tokens are RLD's, MD's follow the handoff.
            # The page's default instructions are `pddgw chat`'s agent prompt.
            assert await page.input_value("#instructions") == DEFAULT_SYSTEM
            await page.click("#settings summary")
            await page.fill("#max-tokens", "160")
            await page.select_option("#pipeline", "P-RLD-MD")
            await page.fill("#input", "Plan the refactoring of the payment module.")
            await page.press("#input", "Enter")
            msg = await finished_turn(page, 1)
            tl1 = check_turn(await msg.evaluate(SPANS_JS), frames.of("turn-1"))
            assert tl1["pipeline"] == "P-RLD-MD" and tl1["tokens_by_role"].get("rld", 0) > 0
            text1 = frames.of("turn-1")[-1]["response"]["output"][0]["content"][0]["text"]
            assert frames.sent[0]["input"] == [{"type": "message", "role": "user",
                                                "content": "Plan the refactoring of the payment module."}]
            # It asks for what it shows: the token ids of its spans, the states of its panel.
            assert frames.sent[0]["pddgw"] == {"pipeline": "P-RLD-MD", "states": True}
            assert frames.sent[0]["return_token_ids"] is True
            assert frames.sent[0]["instructions"] == DEFAULT_SYSTEM

            # Turn 2, the router's choice: the whole conversation goes as input messages.
            await page.select_option("#pipeline", "")
            await page.fill("#input", "Start with the tests.")
            await page.click("#send")
            msg = await finished_turn(page, 2)
            assert len(await page.query_selector_all(".msg.assistant")) == 2
            tl2 = check_turn(await msg.evaluate(SPANS_JS), frames.of("turn-2"))
            assert frames.sent[1]["input"] == [
                {"type": "message", "role": "user", "content": "Plan the refactoring of the payment module."},
                {"type": "message", "role": "assistant", "content": text1},
                {"type": "message", "role": "user", "content": "Start with the tests."}]
            assert frames.sent[1]["pddgw"] == {"states": True} and frames.sent[1]["instructions"] == DEFAULT_SYSTEM
            # Every role's colours were checked across the two turns.
            roles = {r for tl in (tl1, tl2) for r, n in tl["tokens_by_role"].items() if n}
            assert roles == {"prefill", "rld", "md"}, (tl1["tokens_by_role"], tl2["tokens_by_role"])

            # The two answers, their colours and timelines.
            shot = tmp_path / "webchat.png"
            await page.screenshot(path=str(shot))
            if out := os.environ.get("PDDGW_SCREENSHOT_DIR"):
                Path(out).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(out) / "webchat.png")

            # Turn 3, stopped: response.cancel, the turn ends with the error, the history is unchanged.
            await page.fill("#max-tokens", "4000")
            await page.fill("#input", "A long one, please.")
            await page.press("#input", "Enter")
            await page.click("#stop")
            await page.wait_for_selector(".msg.assistant[data-status=error]")
            rid = frames.of("turn-3")[0]["response"]["id"]
            assert frames.sent[3] == {"type": "response.cancel", "response_id": rid}
            assert frames.of("turn-3")[-1]["error"]["code"] == "cancelled"
            assert "cancelled" in await page.inner_text(".msg.assistant[data-status=error] .error")

            # Turn 4: the stopped question is not in the history.
            await page.fill("#max-tokens", "8")
            await page.fill("#input", "Thanks.")
            await page.press("#input", "Enter")
            await finished_turn(page, 4)
            assert [m["content"] for m in frames.sent[4]["input"]] == [
                "Plan the refactoring of the payment module.", text1, "Start with the tests.",
                frames.of("turn-2")[-1]["response"]["output"][0]["content"][0]["text"], "Thanks."]
        finally:
            await browser.close()
    assert problems == []


@pytest.mark.parametrize("webchat", [("secret-key",)], indirect=True, ids=["api_keys"])
async def test_with_api_keys_the_page_connects_once_given_a_key(webchat):
    """Browsers cannot set Authorization on a WebSocket: the page sends the key as the
    subprotocol pddgw.key.<base64url(key)>, which the front door accepts."""
    async_api, chromium = _browser_or_skip()
    url, _ = webchat
    async with async_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = await browser.new_page()
            page.set_default_timeout(30_000)
            await page.goto(url)              # the page itself needs no key
            await page.wait_for_selector("body[data-conn=closed]")
            assert "Settings" in await page.inner_text("#conn-text")
            assert await page.is_disabled("#send")
            await page.click("#settings summary")
            await page.fill("#api-key", "wrong-key")
            await page.dispatch_event("#api-key", "change")
            await page.wait_for_selector("body[data-conn=closed]")
            await page.fill("#api-key", "secret-key")
            await page.dispatch_event("#api-key", "change")
            await page.wait_for_selector("body[data-conn=open]")
            assert not await page.is_disabled("#send")
        finally:
            await browser.close()
