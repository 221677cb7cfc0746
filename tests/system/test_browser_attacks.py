"""A hostile web page against the proxy, in a real browser (headless Debian Chromium via Playwright).

slotproxy injects provider keys and usually runs beside the developer's browser,
so any page that browser opens can aim requests at 127.0.0.1 (SPEC, "Safe beside a
browser"). An attacker page served from ``localhost`` (another site than
``127.0.0.1``) tries what such a page can: a no-CORS POST and a form POST that
would spend the key, CORS fetches that try to read an answer the upstream marks
``Access-Control-Allow-Origin: *``, an admin write, and reads of status and
metrics. A DNS-rebinding page (``evil.example`` mapped to 127.0.0.1 in Chromium)
tries the same through a name the proxy must not answer to, including from the
rebound origin itself, where its requests are same-origin and only the Host rule
stands in the way. Each refusal is checked three ways: what the page could read,
the status of every request the browser sent (preflights included, through the
DevTools protocol), and a recording upstream that must see nothing, so no
provider key is ever sent. Controls prove the attacks are real: with the page's
origin or host allowed in the config, the same requests go through. A
cross-site navigation opens the dashboard and nothing else; the user's own
navigation is served, without the upstream's CORS headers. And the dashboard
still works, opened by a link from that page, including its Restore button
behind the admin token.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from yarl import URL

from ..admin.test_dashboard import ARTIFACTS, TOKEN, auto_reduce, chromium_page
from ..conftest import Proxy, provider_yaml, serve_app, wait_until

try:
    from playwright.async_api import Page, Response, expect
except ImportError:  # reported by the `page` fixture as a failure, with the fix
    pass

pytestmark = pytest.mark.asyncio

KEY_ENV = "SLOTPROXY_TEST_BROWSER_KEY"
REBOUND = "evil.example"
REBIND_ARGS = [f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"]
OPEN_CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "*",
    "Access-Control-Allow-Headers": "*",
}
REPLY = {"id": "chatcmpl-recorded", "object": "chat.completion", "choices": []}
LIMIT = 3
ATTACKS = ("no-cors-post", "cors-simple-post", "cors-json-post", "put-limit", "status", "metrics")
COMPLETIONS = "/openai/chat/completions"
LIMIT_PATH = "/_slotproxy/providers/openai/limit"
SENT = sorted([
    ("POST", COMPLETIONS),  # no-cors fetch
    ("POST", COMPLETIONS),  # CORS fetch with a CORS-safelisted content type: no preflight
    ("OPTIONS", COMPLETIONS),  # the JSON fetch's preflight: refused, so the POST itself is never sent
    ("OPTIONS", LIMIT_PATH),  # the same for the PUT
    ("GET", "/_slotproxy/status"),
    ("GET", "/metrics"),
    ("POST", COMPLETIONS),  # the form
])

ATTACKER_PAGE = """<!doctype html>
<meta charset="utf-8"><title>Free prizes</title>
<a id="dashboard">a link to the proxy's dashboard</a>
<iframe name="sink"></iframe>
<form id="csrf" method="post" enctype="text/plain" target="sink">
  <input name='{"model":"fake","messages":[],"x":"' value='"}'>
</form>
<script>
const target = new URLSearchParams(location.search).get("target");
const chat = JSON.stringify({model: "fake", stream: false, messages: [{role: "user", content: "hi"}]});
const completions = "/openai/chat/completions";
window.outcomes = {};
window.done = false;

async function attempt(name, path, init) {
  try {
    const response = await fetch(target + path, {cache: "no-store", ...init});
    window.outcomes[name] = {type: response.type, status: response.status, body: await response.text()};
  } catch (error) {
    window.outcomes[name] = {error: error.name};
  }
}

function submitForm() {
  return new Promise(resolve => {
    const sink = document.querySelector("iframe[name=sink]");
    sink.addEventListener("load", resolve, {once: true});
    const form = document.getElementById("csrf");
    form.action = target + completions;
    form.submit();
  });
}

async function attack() {
  const text = {"Content-Type": "text/plain"};
  const json = {"Content-Type": "application/json"};
  await attempt("no-cors-post", completions, {method: "POST", mode: "no-cors", headers: text, body: chat});
  await attempt("cors-simple-post", completions, {method: "POST", headers: text, body: chat});
  await attempt("cors-json-post", completions, {method: "POST", headers: json, body: chat});
  await attempt("put-limit", "/_slotproxy/providers/openai/limit",
                {method: "PUT", headers: json, body: JSON.stringify({limit: 1})});
  await attempt("status", "/_slotproxy/status", {mode: "no-cors"});
  await attempt("metrics", "/metrics", {mode: "no-cors"});
  await submitForm();
  window.done = true;
}

document.getElementById("dashboard").href = target + "/_slotproxy/";
attack();
</script>
"""

SAME_ORIGIN_JS = """async () => {
  const json = {"Content-Type": "application/json"};
  const body = JSON.stringify({model: "fake", stream: false, messages: [{role: "user", content: "hi"}]});
  const requests = {
    chat: ["/openai/chat/completions", {method: "POST", headers: json, body}],
    "put-limit": ["/_slotproxy/providers/openai/limit", {method: "PUT", headers: json, body: '{"limit": 1}'}],
    status: ["/_slotproxy/status", {}],
  };
  const outcomes = {};
  for (const [name, [path, init]] of Object.entries(requests)) {
    const response = await fetch(path, {cache: "no-store", ...init});
    outcomes[name] = {status: response.status, body: await response.text()};
  }
  return outcomes;
}"""


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Recorder:
    """An upstream that records every request and lets any web page read every answer."""

    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        return app

    async def _answer(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen.append(Seen(request.method, request.path_qs, {k.lower(): v for k, v in request.headers.items()}))
        if request.method == "OPTIONS":
            return web.Response(status=204, headers=OPEN_CORS)
        return web.json_response(REPLY, headers=OPEN_CORS)

    def carrying(self, secret: str) -> list[Seen]:
        return [seen for seen in self.seen if any(secret in value for value in seen.headers.values())]


class NetworkLog:
    """What the browser sent to one port and the status each got, CORS preflights and answers hidden
    from the page included: Chromium's DevTools protocol sees them, Playwright's page events do not."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._sent: dict[str, tuple[str, str]] = {}
        self._status: dict[str, int] = {}

    @classmethod
    async def attach(cls, page: Page, port: int) -> NetworkLog:
        log = cls(port)
        cdp = await page.context.new_cdp_session(page)
        cdp.on("Network.requestWillBeSent", log._on_sent)
        cdp.on("Network.responseReceivedExtraInfo", log._on_status)
        await cdp.send("Network.enable")
        return log

    def _on_sent(self, event: dict[str, Any]) -> None:
        url = URL(event["request"]["url"])
        if url.port == self.port:
            self._sent[event["requestId"]] = (event["request"]["method"], url.path)

    def _on_status(self, event: dict[str, Any]) -> None:
        self._status[event["requestId"]] = event["statusCode"]

    def answers(self) -> list[tuple[str, str, int]]:
        return sorted((*sent, self._status[key]) for key, sent in self._sent.items() if key in self._status)

    async def settled(self, count: int) -> list[tuple[str, str, int]]:
        await wait_until(lambda: len(self.answers()) >= count, what=f"{count} answers from port {self.port}")
        return self.answers()


@dataclass
class Scene:
    proxy: Proxy
    recorder: Recorder
    secret: str
    attacker_port: int

    def attacker_url(self, host: str, target_host: str) -> str:
        target = f"http://{target_host}:{self.proxy.port}"
        return f"http://{host}:{self.attacker_port}/?target={target}"


Stage = Callable[..., Awaitable[Scene]]
Shot = Callable[[str], Awaitable[None]]


@pytest.fixture
async def page() -> AsyncIterator[Page]:
    async with chromium_page(tuple(REBIND_ARGS)) as tab:
        yield tab


@pytest.fixture
def shot(page: Page, request: pytest.FixtureRequest) -> Shot:
    ARTIFACTS.mkdir(exist_ok=True)
    name = request.node.name.removeprefix("test_")

    async def take(step: str) -> None:
        await page.screenshot(path=str(ARTIFACTS / f"browser-attacks-{name}-{step}.png"), full_page=True)

    return take


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[web.Application], Awaitable[int]]]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> int:
        runner, port = await serve_app(app)
        runners.append(runner)
        return port

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def attacker_port(serve) -> int:
    async def index(_: web.Request) -> web.Response:
        return web.Response(text=ATTACKER_PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", index)
    return await serve(app)


@pytest.fixture
def stage(start_proxy, serve, attacker_port, monkeypatch) -> Stage:
    """The recording upstream and a proxy in front of it whose provider key is a fresh secret."""

    async def build(*, allow_attacker: bool = False, allowed_hosts: tuple[str, ...] = ()) -> Scene:
        secret = f"sk-browser-{uuid.uuid4().hex}"
        monkeypatch.setenv(KEY_ENV, secret)
        recorder = Recorder()
        recorder.port = await serve(recorder.app())
        server = {"allowed_hosts": list(allowed_hosts),
                  "allowed_origins": [f"http://localhost:{attacker_port}"] if allow_attacker else []}
        yaml = (f"state: {{path: null}}\nserver: {json.dumps(server)}\n"
                f"providers:\n  openai:\n    upstream: {recorder.url}/v1\n"
                f"    api_key_env: {KEY_ENV}\n    limit: {LIMIT}\n")
        return Scene(await start_proxy(yaml), recorder, secret, attacker_port)

    return build


async def run_attacks(page: Page, url: str) -> dict[str, Any]:
    response = await page.goto(url)
    assert response is not None and response.status == 200
    await page.wait_for_function("window.done === true")
    outcomes: dict[str, Any] = await page.evaluate("window.outcomes")
    assert set(outcomes) == set(ATTACKS)
    return outcomes


async def form_error(page: Page) -> dict[str, Any]:
    """The proxy's answer to the form POST, as the attacker's iframe shows it."""
    frame = page.frame(name="sink")
    assert frame is not None
    error: dict[str, Any] = json.loads(await frame.locator("body").inner_text())["error"]
    return error


def assert_unreadable(outcomes: dict[str, Any]) -> None:
    """No-CORS answers are opaque; every CORS fetch is rejected by the browser (TypeError)."""
    for name in ("no-cors-post", "status", "metrics"):
        assert outcomes[name] == {"type": "opaque", "status": 0, "body": ""}, (name, outcomes[name])
    for name in ("cors-simple-post", "cors-json-post", "put-limit"):
        assert outcomes[name] == {"error": "TypeError"}, (name, outcomes[name])


def assert_untouched(scene: Scene) -> None:
    assert scene.recorder.seen == [], [(s.method, s.path) for s in scene.recorder.seen]
    status = scene.proxy.status()
    assert (status["limit"], status["configured_limit"]) == (LIMIT, LIMIT)


def assert_forbidden(error: dict[str, Any], setting: str) -> None:
    assert (error["type"], error["code"]) == ("slotproxy_error", "forbidden"), error
    assert setting in error["message"], error["message"]


async def test_a_cross_site_page_reaches_no_upstream_and_reads_nothing(stage, page, shot) -> None:
    scene = await stage()
    log = await NetworkLog.attach(page, scene.proxy.port)
    outcomes = await run_attacks(page, scene.attacker_url("localhost", "127.0.0.1"))
    await shot("1-attacked")

    assert_unreadable(outcomes)
    assert await log.settled(len(SENT)) == [(method, path, 403) for method, path in SENT]
    assert_forbidden(await form_error(page), "server.allowed_origins")
    assert_untouched(scene)


async def test_the_same_page_goes_through_when_its_origin_is_allowed(stage, page) -> None:
    scene = await stage(allow_attacker=True)
    log = await NetworkLog.attach(page, scene.proxy.port)
    outcomes = await run_attacks(page, scene.attacker_url("localhost", "127.0.0.1"))

    for name in ("cors-simple-post", "cors-json-post"):
        assert outcomes[name]["status"] == 200 and json.loads(outcomes[name]["body"]) == REPLY, outcomes[name]
    assert outcomes["put-limit"]["status"] == 200
    assert scene.proxy.status()["limit"] == 1
    # A no-CORS GET carries no Origin to match allowed_origins, only Sec-Fetch-Site: cross-site.
    assert await log.settled(len(SENT) + 2) == sorted([
        ("GET", "/_slotproxy/status", 403), ("GET", "/metrics", 403),
        ("OPTIONS", COMPLETIONS, 204), ("OPTIONS", LIMIT_PATH, 204),
        *[("POST", COMPLETIONS, 200)] * 4, ("PUT", LIMIT_PATH, 200)])
    assert [(seen.method, seen.path) for seen in scene.recorder.seen] == [("POST", "/v1/chat/completions")] * 4
    assert len(scene.recorder.carrying(scene.secret)) == 4


async def test_a_rebinding_page_is_refused_by_host_even_from_its_own_origin(stage, page, shot) -> None:
    scene = await stage()
    log = await NetworkLog.attach(page, scene.proxy.port)
    outcomes = await run_attacks(page, scene.attacker_url(REBOUND, REBOUND))
    assert_unreadable(outcomes)
    assert await log.settled(len(SENT)) == [(method, path, 403) for method, path in SENT]
    assert_forbidden(await form_error(page), "server.allowed_hosts")

    response = await page.goto(f"http://{REBOUND}:{scene.proxy.port}/_slotproxy/")
    assert response is not None and response.status == 403
    assert_forbidden((await response.json())["error"], "server.allowed_hosts")
    await shot("1-dashboard-refused")

    same_origin: dict[str, Any] = await page.evaluate(SAME_ORIGIN_JS)
    for name, outcome in same_origin.items():
        assert outcome["status"] == 403, (name, outcome)
        assert_forbidden(json.loads(outcome["body"])["error"], "server.allowed_hosts")
    assert_untouched(scene)


async def test_a_listed_host_is_served_to_the_same_rebound_origin(stage, page) -> None:
    scene = await stage(allowed_hosts=(REBOUND,))
    response = await page.goto(f"http://{REBOUND}:{scene.proxy.port}/_slotproxy/")
    assert response is not None and response.status == 200

    same_origin: dict[str, Any] = await page.evaluate(SAME_ORIGIN_JS)
    assert {name: outcome["status"] for name, outcome in same_origin.items()} == {
        "chat": 200, "put-limit": 200, "status": 200}
    assert json.loads(same_origin["chat"]["body"]) == REPLY
    assert [seen.method for seen in scene.recorder.carrying(scene.secret)] == ["POST"]


async def test_a_cross_site_navigation_opens_the_dashboard_and_nothing_else(stage, page) -> None:
    scene = await stage()
    for path, status in [("/_slotproxy", 200), ("/_slotproxy/", 200), ("/_slotproxy/status", 403),
                         ("/metrics", 403), ("/openai/models", 403)]:
        await run_attacks(page, scene.attacker_url("localhost", "127.0.0.1"))
        async with page.expect_navigation() as navigation:
            await page.evaluate("url => location.assign(url)", f"{scene.proxy.url}{path}")
        response = await navigation.value
        assert response is not None and response.status == status, (path, response and response.status)
        sent = await response.request.all_headers()
        assert sent.get("sec-fetch-site") == "cross-site", (path, sent)
    assert_untouched(scene)


async def test_the_users_own_navigation_is_served_without_the_upstreams_cors_headers(stage, page) -> None:
    scene = await stage()
    response = await page.goto(f"{scene.proxy.url}/openai/models")
    assert response is not None and response.status == 200
    assert json.loads(await response.text()) == REPLY
    headers = await response.all_headers()
    assert [name for name in headers if name.startswith("access-control-")] == [], headers
    assert [(seen.method, seen.path) for seen in scene.recorder.carrying(scene.secret)] == [("GET", "/v1/models")]


async def test_a_link_from_the_page_opens_the_dashboard_and_restore_still_works(
    start_upstream, start_proxy, attacker_port, client, page, shot, monkeypatch
) -> None:
    monkeypatch.setenv("SLOTPROXY_ADMIN_TOKEN", TOKEN)
    upstream = await start_upstream(retry_after=0.3)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0))
    await run_attacks(page, f"http://localhost:{attacker_port}/?target={proxy.url}")
    async with page.expect_navigation() as navigation:
        await page.locator("#dashboard").click()
    opened = await navigation.value
    assert opened is not None and opened.status == 200 and opened.url == f"{proxy.url}/_slotproxy/"
    sent = await opened.request.all_headers()
    assert (sent.get("sec-fetch-site"), sent.get("sec-fetch-mode")) == ("cross-site", "navigate"), sent
    await expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    await shot("1-opened-by-link")

    puts: list[Response] = []
    page.on("response", lambda r: puts.append(r) if r.request.method == "PUT" else None)
    await auto_reduce(proxy, client)
    card = page.locator('[data-provider="openai"]')
    button = card.locator('[data-action="restore"]')
    await expect(button).to_have_text("Restore to 3")
    await button.click()
    await page.get_by_label("Admin token").fill(TOKEN)
    await page.locator("#token-form button[type=submit]").click()
    await expect(card.locator('[data-field="limit"]')).to_have_text("3")
    await expect(button).to_be_hidden()
    sent_from = [(put.status, (await put.request.all_headers()).get("origin")) for put in puts]
    assert sent_from == [(401, proxy.url), (200, proxy.url)]  # the dashboard's own origin is allowed
    status = proxy.status()
    assert status["limit"] == 3 and status["auto_reduced"] is False
    await shot("2-restored")


async def test_another_page_cannot_frame_the_dashboard(stage, serve, page) -> None:
    """A frame navigates too, but sits inside the other page (clickjacking its Restore button): refused."""
    scene = await stage()
    log = await NetworkLog.attach(page, scene.proxy.port)

    async def framing(request: web.Request) -> web.Response:
        return web.Response(text=f'<iframe name="board" src="{scene.proxy.url}/_slotproxy/"></iframe>',
                            content_type="text/html")

    app = web.Application()
    app.router.add_get("/", framing)
    port = await serve(app)
    response = await page.goto(f"http://localhost:{port}/")
    assert response is not None and response.status == 200
    assert await log.settled(1) == [("GET", "/_slotproxy/", 403)]
    assert_untouched(scene)
