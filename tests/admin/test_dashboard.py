"""The dashboard in a real browser: headless Debian Chromium driven by Playwright.

Needs the ``playwright`` Python package (``pip install playwright``) and Debian's
``chromium`` package at /usr/bin/chromium; Playwright's own browser downloads are
never used. When either is missing these tests fail with the install command,
they do not skip. Screenshots of each key step go to ``test-artifacts/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest

from proxy.admin import history
from proxy.limiter import Priority

from ..conftest import chat, provider_yaml, wait_until

try:
    from playwright.async_api import Page, async_playwright, expect
except ImportError:  # reported by the `page` fixture as a failure, with the fix
    async_playwright = None  # type: ignore[assignment]

pytestmark = pytest.mark.asyncio

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TIMEOUT_MS = 5000  # the page polls every second; this is a generous bound, not a sleep
TOKEN = "dashboard-test-token"
NOTICE = "Concurrency limit auto-reduced to 2 after a 429 — restore manually when ready."


@contextlib.asynccontextmanager
async def chromium_page(extra_args: tuple[str, ...] = ()) -> AsyncIterator[Page]:
    """A tab in Debian's headless Chromium; an uncaught error in the page fails the test."""
    if async_playwright is None:
        pytest.fail("the playwright Python package is missing: pip install playwright "
                    "(only the package; the tests use Debian's chromium, not `playwright install`)")
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get update && apt-get install -y chromium")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=[*CHROMIUM_ARGS, *extra_args])
        context = await browser.new_context(viewport={"width": 1100, "height": 800})
        context.set_default_timeout(TIMEOUT_MS)
        tab = await context.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            yield tab
        finally:
            await browser.close()
        assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
async def page() -> AsyncIterator[Page]:
    async with chromium_page() as tab:
        yield tab


Shot = Callable[[str], Awaitable[None]]


@pytest.fixture
def shot(page: Page, request: pytest.FixtureRequest) -> Shot:
    ARTIFACTS.mkdir(exist_ok=True)
    name = request.node.name.removeprefix("test_")

    async def take(step: str) -> None:
        await page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}-{step}.png"), full_page=True)

    return take


async def open_dashboard(page: Page, proxy: Any, query: str = "") -> None:
    response = await page.goto(f"{proxy.url}/_slotproxy/{query}")
    assert response is not None and response.status == 200
    await expect(page.locator("#connection")).to_have_attribute("data-state", "live")


async def most_at_once(page: Page, pattern: str, *, delay: float, what: str) -> int:
    """Answer the page's requests for ``pattern`` ``delay`` seconds late until two were answered; how many
    were in flight at once at the most (1: the page waits for each before it asks again)."""
    active = peak = answered = 0

    async def slow(route: Any) -> None:
        nonlocal active, peak, answered
        active += 1
        peak = max(peak, active)
        try:
            await asyncio.sleep(delay)
            await route.continue_()
        finally:
            active -= 1
            answered += 1

    await page.route(pattern, slow)
    await wait_until(lambda: answered >= 2, timeout=6, what=what)
    await page.unroute(pattern, slow)
    return peak


async def auto_reduce(proxy: Any, client: Any) -> None:
    """One 429 from upstream: the proxy relays it, pauses and lowers the limit from 3 to 2."""
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                           headers={"x-fake-status": "429"}) as resp:
        assert resp.status == 429
        await resp.read()
    assert proxy.status()["limit"] == 2


async def test_restore_button_restores_an_auto_reduced_limit(start_upstream, start_proxy, client, page, shot) -> None:
    upstream = await start_upstream(retry_after=0.3)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await expect(card.locator('[data-field="limit"]')).to_have_text("3")
    await expect(card.locator('[data-field="notice"]')).to_be_hidden()
    await shot("1-healthy")

    await auto_reduce(proxy, client)
    await expect(card.locator('[data-field="notice"]')).to_have_text(NOTICE)
    await expect(card.locator('[data-field="limit"]')).to_have_text("2")
    await expect(card.locator('[data-field="configured-limit"]')).to_have_text("3")
    button = card.locator('[data-action="restore"]')
    await expect(button).to_have_text("Restore to 3")
    await shot("2-auto-reduced")

    await button.click()
    await expect(card.locator('[data-field="limit"]')).to_have_text("3")
    await expect(card.locator('[data-field="notice"]')).to_be_hidden()
    await expect(button).to_be_hidden()
    status = proxy.status()
    assert status["limit"] == 3 and status["auto_reduced"] is False and status["notice"] is None
    await expect(page.locator("#token-form")).to_be_hidden()
    await shot("3-restored")


async def test_restore_asks_for_the_admin_token_and_retries_with_it(
    start_upstream, start_proxy, client, page, shot, monkeypatch
) -> None:
    monkeypatch.setenv("SLOTPROXY_ADMIN_TOKEN", TOKEN)
    upstream = await start_upstream(retry_after=3)  # a pause long enough to watch its countdown
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0))
    puts: list[tuple[int, str | None]] = []
    page.on("response", lambda r: puts.append((r.status, r.request.headers.get("authorization")))
            if r.request.method == "PUT" else None)
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await auto_reduce(proxy, client)
    button = card.locator('[data-action="restore"]')
    await expect(button).to_have_text("Restore to 3")
    pause = card.locator('[data-field="pause"]')
    await expect(pause).to_have_text(re.compile(r"resumes in [0-2]\.\d s$"))
    first = await pause.text_content()
    await expect(pause).not_to_have_text(first or "")  # counts down between polls

    await button.click()
    form = page.locator("#token-form")
    await expect(form).to_be_visible()
    await expect(page.locator("#token-input")).to_be_focused()
    assert proxy.status()["limit"] == 2
    await shot("1-token-asked")

    # A wrong token: 403, and the proxy's own error message is shown in the form.
    await page.get_by_label("Admin token").fill("not-the-token")
    await page.locator("#token-form button[type=submit]").click()
    await expect(page.locator("#token-error")).to_have_text("The admin token was not accepted: the admin token is wrong")
    await expect(form).to_be_visible()
    assert proxy.status()["limit"] == 2
    await shot("2-token-wrong")

    await page.get_by_label("Admin token").fill(TOKEN)
    await page.locator("#token-form button[type=submit]").click()
    await expect(form).to_be_hidden()
    await expect(card.locator('[data-field="limit"]')).to_have_text("3")
    await expect(card.locator('[data-field="notice"]')).to_be_hidden()
    assert proxy.status()["limit"] == 3 and proxy.status()["auto_reduced"] is False
    assert await page.evaluate("sessionStorage.getItem('slotproxy.adminToken')") == TOKEN
    assert [status for status, _ in puts] == [401, 403, 200]
    assert puts[0][1] is None and puts[2][1] == f"Bearer {TOKEN}"
    await shot("3-restored")


CLOCK_24H = r"\d\d:\d\d:\d\d"  # `slotproxy status`'s clock: 24-hour, no AM or PM


async def test_a_limit_set_by_hand_says_so_and_restore_goes_back_to_the_configured_one(
    start_upstream, start_proxy, client, page, shot, monkeypatch
) -> None:
    monkeypatch.setenv("SP_DASH_KEY_A", "key-a")
    upstream = await start_upstream()
    proxy = await start_proxy(POOL_YAML.format(upstream=upstream.url))
    admin = f"{proxy.url}/_slotproxy/providers/openai"
    async with client.put(f"{admin}/limit", json={"limit": 6}) as resp:
        assert resp.status == 200
    async with client.put(f"{admin}/models/{quote('gpt-big-*', safe='')}/limit", json={"limit": 1}) as resp:
        assert resp.status == 200
    methods: list[str] = []
    page.on("request", lambda r: methods.append(r.method) if "/limit" in r.url else None)
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await expect(card.locator('[data-field="limit"]')).to_have_text("6")
    await expect(card.locator('[data-field="manual-badge"]')).to_be_visible()
    await expect(card.locator('[data-field="notice"]')).to_have_text(
        re.compile(rf"^Limit 6 set by hand at {CLOCK_24H}; configured unlimited\.$"))
    model = card.locator('[data-model="gpt-big-*"]')
    await expect(model.locator('[data-field="model-manual"]')).to_be_visible()
    await expect(model.locator('[data-field="model-manual"]')).to_have_attribute(
        "title", re.compile(rf"^Limit 1 set by hand at {CLOCK_24H}; configured 2\.$"))
    await shot("1-set-by-hand")

    button = card.locator('[data-action="restore"]')
    await expect(button).to_have_text("Restore to unlimited")
    await button.click()
    await expect(card.locator('[data-field="limit"]')).to_have_text("unlimited")
    await expect(button).to_be_hidden()
    await expect(card.locator('[data-field="manual-badge"]')).to_be_hidden()
    await model.locator('[data-action="restore-model"]').click()
    await expect(model.locator('[data-field="model-limit"]')).to_have_text("2")
    await expect(model.locator('[data-field="model-manual"]')).to_be_hidden()
    status = proxy.status()
    assert (status["limit"], status["manual"], status["models"][0]["limit"], status["models"][0]["manual"]) == \
        (None, False, 2, False)
    assert methods == ["DELETE", "DELETE"]
    await shot("2-restored")


async def test_times_are_24_hour_the_pause_counts_down_and_relayed_429s_are_counted(
    start_upstream, start_proxy, client, page, shot
) -> None:
    upstream = await start_upstream(retry_after=30)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    relayed = card.locator('[data-field="relayed-429"]')
    await expect(relayed).to_have_text("0 upstream 429s relayed to clients")
    await auto_reduce(proxy, client)
    pause = card.locator('[data-field="pause"]')
    await expect(pause).to_have_text(re.compile(rf"^Paused after a rate limit until {CLOCK_24H} — resumes in 2\d s$"))
    first = await pause.text_content()
    await expect(pause).not_to_have_text(first or "", timeout=2500)  # a second later, a second fewer
    assert first is not None and first.rsplit(" until ", 1)[1][:8] == time.strftime(
        "%H:%M:%S", time.localtime(proxy.status()["paused_until"] / 1000))
    await expect(relayed).to_have_text("1 upstream 429 relayed to clients")
    await expect(page.locator("#config-loaded")).to_have_text(re.compile(rf"^{CLOCK_24H}$"))
    await shot("1-paused")


async def test_queue_table_lists_waiters_in_admission_order(start_upstream, start_proxy, client, page, shot) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai/chat/completions"
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await expect(card.locator('[data-field="queue-empty"]')).to_be_visible()

    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "1500"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1, what="the holder to take the slot")
    # Workspace ids come from request headers: this one must show as text, never run.
    hostile = '<img src=x onerror="window.__pwned=1">'
    plain = asyncio.create_task(client.post(url, json=chat(), headers={"X-Workspace-Id": hostile}))
    await wait_until(lambda: proxy.status()["queued"] == 1, what="the first waiter")
    starred = asyncio.create_task(client.post(url, json=chat(), headers={
        "X-Workspace-Id": "release-team", "X-Workspace-Starred": "1", "X-Conversation-Id": "conv-7"}))
    await wait_until(lambda: proxy.status()["queued"] == 2, what="the second waiter")

    rows = card.locator('tbody[data-field="queue"] tr')
    await expect(rows).to_have_count(2)
    # The queue lives only while the holder stalls (1.5 s): read the card once, then assert.
    await shot("1-queued")
    seen = await card.evaluate("""card => ({
        queued: card.querySelector('[data-field="queued"]').textContent,
        inFlight: card.querySelector('[data-field="in-flight"]').textContent,
        images: card.querySelectorAll('img').length,
        rows: [...card.querySelectorAll('tbody[data-field="queue"] tr')].map(
            tr => [...tr.cells].map(td => td.textContent)),
    })""")
    assert (seen["queued"], seen["inFlight"], seen["images"]) == ("2", "1", 0)
    # Starred first although it arrived second: the proxy's admission order.
    (first, second) = seen["rows"]
    position, workspace, star, age, waited, via, conversation = first
    assert (position, workspace, via, conversation) == ("1", "release-team", "HTTP", "conv-7")
    assert "★" in star
    assert re.fullmatch(r"\d\.\d s", age) and re.fullmatch(r"\d\.\d s", waited), (age, waited)
    assert second[:3] == ["2", hostile, ""] and second[5:] == ["HTTP", "—"]
    assert await page.evaluate("window.__pwned") is None

    for response in await asyncio.gather(holder, plain, starred):
        assert response.status == 200
        await response.read()
        response.release()
    await expect(rows).to_have_count(0)
    await expect(card.locator('[data-field="queue-empty"]')).to_be_visible()
    await shot("2-drained")


async def test_config_error_banner_shows_and_clears(start_upstream, start_proxy, page, shot) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    await open_dashboard(page, proxy)
    banner = page.locator("#config-error")
    await expect(banner).to_be_hidden()

    message = "providers.openai.limit: must be a positive integer or null <b>(got 0)</b>"
    proxy.state.config_error = message
    await expect(banner).to_be_visible()
    await expect(banner).to_contain_text(message)
    assert await banner.locator("b").count() == 0
    await shot("1-banner")
    await page.emulate_media(color_scheme="dark")
    await shot("2-banner-dark")

    proxy.state.config_error = None
    await expect(banner).to_be_hidden()


async def test_disconnected_indicator_and_no_overlapping_polls(start_upstream, start_proxy, page, shot) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    await open_dashboard(page, proxy)
    indicator = page.locator("#connection")

    async def refuse(route: Any) -> None:
        await route.abort()

    await page.route("**/_slotproxy/status", refuse)
    await expect(indicator).to_have_attribute("data-state", "disconnected")
    await expect(indicator).to_contain_text("Disconnected")
    await shot("1-disconnected")
    await page.unroute("**/_slotproxy/status", refuse)
    await expect(indicator).to_have_attribute("data-state", "live")

    # A status that takes 1.2 s to answer (longer than the poll interval): polls wait for each other instead of piling up.
    assert await most_at_once(page, "**/_slotproxy/status", delay=1.2, what="two slow polls") == 1
    await expect(indicator).to_have_attribute("data-state", "live")


POOL_YAML = """
state: {{path: null}}
providers:
  openai:
    upstream: {upstream}/v1
    retry_on_429: 0
    budgets: true
    keys:
      - {{name: team-a, api_key_env: SP_DASH_KEY_A, limit: 2}}
      - {{name: team-b, api_key_env: SP_DASH_KEY_B, limit: 2}}
      - {{name: team-c, api_key_env: SP_DASH_KEY_C, limit: 2}}
    models:
      "gpt-big-*": {{limit: 2}}
"""
KEY_NOTICE = "Concurrency limit auto-reduced to 1 after a 429 — restore manually when ready."


@pytest.fixture
def pool_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys team-a and team-b are set; team-c's variable is not."""
    monkeypatch.setenv("SP_DASH_KEY_A", "key-a")
    monkeypatch.setenv("SP_DASH_KEY_B", "key-b")
    monkeypatch.delenv("SP_DASH_KEY_C", raising=False)


@pytest.fixture
def fast_history(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history, "SAMPLE_INTERVAL", 0.05)


def key_status(proxy: Any, name: str) -> dict[str, Any]:
    (entry,) = [k for k in proxy.status()["keys"] if k["name"] == name]
    return entry


async def rate_limited(proxy: Any, client: Any) -> str:
    """One 429 from upstream on whichever key the pool picks; that key's name."""
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                           headers={"x-fake-status": "429"}) as resp:
        assert resp.status == 429
        await resp.read()
    (name,) = [k["name"] for k in proxy.status()["keys"] if k["auto_reduced"]]
    return name


async def test_pool_keys_show_bars_and_a_rate_limited_key_restores(
    start_upstream, start_proxy, client, page, shot, pool_env
) -> None:
    upstream = await start_upstream(retry_after=3)
    proxy = await start_proxy(POOL_YAML.format(upstream=upstream.url))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    holder = asyncio.create_task(client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                                             headers={"x-fake-stall-ms": "2500"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1, what="a request to hold a key's slot")
    (busy,) = [k["name"] for k in proxy.status()["keys"] if k["in_flight"] == 1]
    for name in ("team-a", "team-b"):
        row = card.locator(f'[data-key="{name}"]')
        bar = row.locator('[data-field="key-bar"]')
        await expect(row).to_have_attribute("data-available", "true")
        await expect(bar).to_have_attribute("aria-valuemax", "2")
        await expect(bar).to_have_attribute("aria-valuenow", "1" if name == busy else "0")
        await expect(row.locator('[data-field="key-in-flight"]')).to_have_text("1" if name == busy else "0")
        await expect(row.locator('[data-field="key-limit"]')).to_have_text("2")
    unset = card.locator('[data-key="team-c"]')
    await expect(unset).to_have_attribute("data-available", "false")
    await expect(unset.locator('[data-field="key-unset"]')).to_have_text("not set")
    assert key_status(proxy, "team-c")["available"] is False
    await shot("1-keys")

    reduced = await rate_limited(proxy, client)
    row = card.locator(f'[data-key="{reduced}"]')
    await expect(row.locator('[data-field="key-notice"]')).to_have_text(KEY_NOTICE)
    await expect(row.locator('[data-field="key-limit"]')).to_have_text("1")
    pause = row.locator('[data-field="key-pause"]')
    await expect(pause).to_have_text(re.compile(r"resumes in [0-2]\.\d s$"))
    first = await pause.text_content()
    await expect(pause).not_to_have_text(first or "")
    await expect(card.locator('[data-field="notice"]')).to_be_hidden()
    button = row.locator('[data-action="restore-key"]')
    await expect(button).to_have_text("Restore to 2")
    await shot("2-key-rate-limited")

    await button.click()
    await expect(row.locator('[data-field="key-limit"]')).to_have_text("2")
    await expect(row.locator('[data-field="key-notice"]')).to_be_hidden()
    await expect(button).to_be_hidden()
    restored = key_status(proxy, reduced)
    assert (restored["limit"], restored["auto_reduced"], restored["notice"]) == (2, False, None)
    await shot("3-key-restored")
    response = await holder
    assert response.status == 200
    response.release()


async def test_a_model_cap_restores_and_a_budget_hold_is_shown_as_a_hold(
    start_upstream, start_proxy, client, page, shot, pool_env, fast_history, monkeypatch
) -> None:
    monkeypatch.setenv("SLOTPROXY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("SP_DASH_KEY_B")
    upstream = await start_upstream(window_requests=1, window_seconds=30)
    proxy = await start_proxy(POOL_YAML.format(upstream=upstream.url))
    async with client.put(f"{proxy.url}/_slotproxy/providers/openai/models/{quote('gpt-big-*', safe='')}/limit",
                          json={"limit": 1}, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status == 200
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    model = card.locator('[data-model="gpt-big-*"]')
    await expect(model.locator('[data-field="model-limit"]')).to_have_text("1")
    await expect(model.locator('[data-field="model-configured-limit"]')).to_have_text("2")

    big = {**chat(stream=False), "model": "gpt-big-1"}
    request = asyncio.create_task(client.post(f"{proxy.url}/openai/chat/completions", json=big,
                                              headers={"x-fake-stall-ms": "1500"}))
    await expect(model.locator('[data-field="model-in-flight"]')).to_have_text("1")
    await expect(model.locator('[data-field="model-bar"]')).to_have_attribute("aria-valuetext", "1 of 1 slots in use")
    await shot("1-model-cap-full")
    response = await request
    assert response.status == 200
    response.release()

    # team-a's one request of the window is spent: it is held until the reset, which is not a pause.
    key = card.locator('[data-key="team-a"]')
    hold = key.locator('[data-field="key-hold"]')
    await expect(hold).to_contain_text("held until")
    await expect(key.locator('[data-field="key-budget"]')).to_contain_text("0 requests left")
    await expect(key.locator('[data-field="key-pause"]')).to_be_hidden()
    await expect(card.locator('[data-field="hold"]')).to_contain_text("Every key is held by its budget — held until")
    await expect(card.locator('[data-field="pause"]')).to_be_hidden()
    await expect(key.locator('rect[data-mark="held"]')).not_to_have_count(0)
    assert proxy.status()["keys"][0]["budget"]["held_until"] is not None
    await shot("2-budget-held")

    button = model.locator('[data-action="restore-model"]')
    await expect(button).to_have_text("Restore to 2")
    await button.click()
    await expect(page.locator("#token-form")).to_be_visible()
    await page.get_by_label("Admin token").fill(TOKEN)
    await page.locator("#token-form button[type=submit]").click()
    await expect(model.locator('[data-field="model-limit"]')).to_have_text("2")
    await expect(button).to_be_hidden()
    assert proxy.status()["models"] == [{"pattern": "gpt-big-*", "limit": 2, "configured_limit": 2, "in_flight": 0,
                                         "manual": False, "manual_set_at": None}]
    await shot("3-model-restored")


async def test_history_charts_draw_the_last_minutes_and_fetch_one_at_a_time(
    start_upstream, start_proxy, client, page, shot, pool_env, fast_history
) -> None:
    upstream = await start_upstream(retry_after=3)
    proxy = await start_proxy(POOL_YAML.format(upstream=upstream.url))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    chart = card.locator('svg[data-chart="provider"]')
    for series in ("in-flight", "queued"):
        await expect(chart.locator(f'path[data-series="{series}"]')).to_have_attribute("d", re.compile(r"^M.+H"))
    reduced = await rate_limited(proxy, client)
    key_chart = card.locator(f'[data-key="{reduced}"] svg[data-chart="key"]')
    await expect(key_chart.locator('path[data-series="limit"]')).to_have_count(1)
    await expect(key_chart.locator('rect[data-mark="paused"]')).not_to_have_count(0)
    await expect(key_chart.locator('line[data-mark="reduced"]')).to_have_count(1)
    await expect(chart.locator('line[data-mark="reduced"]')).to_have_count(1)
    await expect(card.locator('[data-key="team-c"] svg[data-chart="key"]')).to_be_hidden()
    await expect(card.locator(".legend")).to_contain_text("budget hold")
    await shot("1-charts")

    assert await most_at_once(page, "**/_slotproxy/history", delay=0.6, what="two slow history fetches") == 1


RESPONSE_CREATE = json.dumps({"type": "response.create", "model": "m"})
TERMINAL = {"response.completed", "response.failed", "response.incomplete", "error"}


async def response_events(ws: Any) -> list[str]:
    """The event types of one response on a socket, up to its terminal event."""
    types: list[str] = []
    while not types or types[-1] not in TERMINAL:
        message = await asyncio.wait_for(ws.receive(), timeout=10)
        assert message.type == aiohttp.WSMsgType.TEXT, message
        types.append(json.loads(message.data)["type"])
    return types


async def test_open_websockets_show_on_the_card_and_go_when_closed(
    start_upstream, start_proxy, client, page, shot
) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=3))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    sockets = card.locator('[data-field="websockets"]')
    await expect(card.locator('[data-field="in-flight"]')).to_have_text("0")
    await expect(sockets).to_be_hidden()
    assert proxy.status()["websockets"] == 0

    url = f"{proxy.url}/openai/responses"
    first = await client.ws_connect(url)
    second = await client.ws_connect(url)
    try:
        await first.send_str(RESPONSE_CREATE)  # a real response on one of them, relayed whole
        assert (await response_events(first))[-1] == "response.completed"
        await wait_until(lambda: proxy.status()["websockets"] == 2, what="two sockets open")
        await expect(sockets).to_be_visible()
        await expect(sockets).to_have_text("2 WebSockets open")
        await expect(card.locator('[data-field="in-flight"]')).to_have_text("0")
        await shot("1-two-open")

        await first.close()
        await wait_until(lambda: proxy.status()["websockets"] == 1, what="one socket closed")
        await expect(sockets).to_have_text("1 WebSocket open")
    finally:
        await first.close()
        await second.close()
    await wait_until(lambda: proxy.status()["websockets"] == 0, what="both sockets closed")
    await expect(sockets).to_be_hidden()
    assert "WebSocket" not in (await card.inner_text())
    await shot("2-closed")


async def test_queue_table_shows_whether_each_waiter_came_by_http_or_websocket(
    start_upstream, start_proxy, client, page, shot
) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai"
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')

    # A long HTTP stream holds the one slot; a response.create on a socket and an HTTP request wait behind it.
    holder = asyncio.create_task(client.post(f"{url}/chat/completions", json=chat(),
                                             headers={"x-fake-stall-ms": "2500"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1, what="the holder to take the slot")
    ws = await client.ws_connect(f"{url}/responses", headers={"X-Workspace-Id": "codex-session"})
    try:
        await ws.send_str(RESPONSE_CREATE)
        await wait_until(lambda: proxy.status()["queued"] == 1, what="the socket's response to wait")
        waiter = asyncio.create_task(client.post(f"{url}/chat/completions", json=chat(),
                                                 headers={"X-Workspace-Id": "http-client"}))
        await wait_until(lambda: proxy.status()["queued"] == 2, what="the HTTP request to wait")
        assert sorted(w["transport"] for w in proxy.status()["queue"]) == ["http", "websocket"]

        rows = card.locator('tbody[data-field="queue"] tr')
        await expect(rows).to_have_count(2)
        await expect(card.locator('[data-field="websockets"]')).to_have_text("1 WebSocket open")
        await shot("1-queued")
        seen = await card.evaluate("""card => [...card.querySelectorAll('tbody[data-field="queue"] tr')].map(tr => [
            tr.querySelector('[data-field="workspace"]').textContent,
            tr.querySelector('[data-field="transport"]').textContent])""")
        assert sorted(seen) == [["codex-session", "WebSocket"], ["http-client", "HTTP"]]
        assert await card.locator("thead th").nth(5).text_content() == "Via"

        # The holder ends: the socket's response and then the HTTP request get the slot and finish.
        assert (await response_events(ws))[-1] == "response.completed"
        for response in await asyncio.gather(holder, waiter):
            assert response.status == 200
            await response.read()
            response.release()
        await expect(rows).to_have_count(0)
        await expect(card.locator('[data-field="queue-empty"]')).to_be_visible()
    finally:
        await ws.close()
    await expect(card.locator('[data-field="websockets"]')).to_be_hidden()
    await shot("2-drained")


async def test_an_older_proxy_without_socket_fields_shows_no_sockets_and_a_dash(
    start_upstream, start_proxy, page
) -> None:
    """A status without ``websockets`` or ``transport`` (a proxy before the WebSocket relay)."""
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=1))

    async def older(route: Any) -> None:
        response = await route.fetch()
        body = await response.json()
        for provider in body["providers"]:
            provider.pop("websockets", None)
            provider["queued"] = 1
            provider["queue"] = [{"workspace": "old-client", "starred": False, "conversation": None,
                                  "prompt_started_at": int(time.time() * 1000), "waited_ms": 100}]
        await route.fulfill(response=response, json=body)

    await page.route("**/_slotproxy/status", older)
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await expect(card.locator('tbody[data-field="queue"] tr')).to_have_count(1)
    await expect(card.locator('[data-field="transport"]')).to_have_text("—")
    await expect(card.locator('[data-field="workspace"]')).to_have_text("old-client")
    await expect(card.locator('[data-field="websockets"]')).to_be_hidden()


# ----- who holds the slots ------------------------------------------------------------------

HOLDER_CELLS = """card => [...card.querySelectorAll('tbody[data-field="holders"] tr')].map(tr => Object.fromEntries(
    [...tr.cells].map(td => [td.dataset.field, td.textContent])))"""


async def test_holders_table_lists_who_holds_each_slot_and_for_how_long(
    start_upstream, start_proxy, client, page, shot
) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    url = f"{proxy.url}/openai"
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await expect(card.locator('[data-field="holders-empty"]')).to_have_text("No request holds a slot.")

    # An HTTP request and a response on a WebSocket hold both slots; a third request waits behind them.
    http = asyncio.create_task(client.post(
        f"{url}/chat/completions", json={**chat(), "model": "gpt-4o-mini"},
        headers={"x-fake-stall-ms": "6000", "X-Workspace-Id": "release-team", "X-Workspace-Starred": "1",
                 "X-Conversation-Id": "conv-9"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1, what="the HTTP request to take a slot")
    ws = await client.ws_connect(f"{url}/responses", headers={"X-Workspace-Id": "codex-session"})
    try:
        await ws.send_str(json.dumps({"type": "response.create", "model": "gpt-5-codex",
                                      "x_fake": {"stall-ms": 6000}}))
        await wait_until(lambda: proxy.status()["in_flight"] == 2, what="the socket's response to take a slot")
        waiter = asyncio.create_task(client.post(f"{url}/chat/completions", json=chat(),
                                                 headers={"X-Workspace-Id": "waiting-team"}))
        await wait_until(lambda: proxy.status()["queued"] == 1, what="a third request to wait")

        rows = card.locator('tbody[data-field="holders"] tr')
        await expect(rows).to_have_count(2)
        await expect(card.locator('tbody[data-field="queue"] tr')).to_have_count(1)
        await expect(rows.nth(1).locator('[data-field="held"]')).to_have_text(re.compile(r"^[1-9] s$"))
        await shot("1-holding")
        first = await card.evaluate(HOLDER_CELLS)
        # Longest held first: the HTTP request came first.
        assert [{k: v for k, v in row.items() if k != "held"} for row in first] == [
            {"workspace": "release-team", "starred": "★starred", "conversation": "conv-9", "model": "gpt-4o-mini",
             "transport": "HTTP"},
            {"workspace": "codex-session", "starred": "", "conversation": "—", "model": "gpt-5-codex",
             "transport": "WebSocket"},
        ]
        assert all(re.fullmatch(r"\d s", row["held"]) for row in first), first
        # No key pool: no Key column.
        await expect(card.locator('th[data-column="key"]')).to_be_hidden()
        assert await card.locator('tbody[data-field="holders"] [data-field="key"]').count() == 0
        heads = await card.locator('[data-field="holding"] thead th').evaluate_all(
            "ths => ths.filter(th => !th.hidden).map(th => th.textContent)")
        assert heads == ["Workspace", "★Starred", "Conversation", "Model", "Via", "Held for"]

        # The held time grows between polls and ticks, from the server's count.
        held = rows.first.locator('[data-field="held"]')
        before = int((await held.text_content() or "").split()[0])
        await expect(held).to_have_text(f"{before + 1} s", timeout=3000)
        assert (await held.get_attribute("title") or "").startswith("holding since ")

        assert (await response_events(ws))[-1] == "response.completed"
        for response in await asyncio.gather(http, waiter):
            assert response.status == 200
            await response.read()
            response.release()
    finally:
        await ws.close()
    await expect(rows).to_have_count(0)
    await expect(card.locator('[data-field="holders-empty"]')).to_be_visible()
    await shot("2-released")


async def test_holders_table_has_a_key_column_with_a_key_pool(
    start_upstream, start_proxy, client, page, shot, pool_env
) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(POOL_YAML.format(upstream=upstream.url))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    holder = asyncio.create_task(client.post(f"{proxy.url}/openai/chat/completions",
                                             json={**chat(stream=False), "model": "gpt-big-1"},
                                             headers={"x-fake-stall-ms": "2500", "X-Workspace-Id": "pool-user"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1, what="a request to hold a key's slot")
    (busy,) = [k["name"] for k in proxy.status()["keys"] if k["in_flight"] == 1]
    row = card.locator('tbody[data-field="holders"] tr')
    await expect(row).to_have_count(1)
    await expect(card.locator('th[data-column="key"]')).to_be_visible()
    await expect(row.locator('[data-field="key"]')).to_have_text(busy)
    await expect(row.locator('[data-field="model"]')).to_have_text("gpt-big-1")
    await expect(row.locator('[data-field="workspace"]')).to_have_text("pool-user")
    await shot("1-key-column")
    response = await holder
    assert response.status == 200
    response.release()
    await expect(row).to_have_count(0)


async def test_holders_table_is_capped_like_the_queue_and_hidden_for_older_proxies(
    start_upstream, start_proxy, page, shot
) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=None))
    now = int(time.time() * 1000)
    holders: list[dict[str, Any]] | None = [
        {"workspace": f"ws-{i}", "starred": False, "conversation": None, "model": None, "key": None,
         "transport": "http", "granted_at": now - 60_000 * (205 - i), "held_ms": 60_000 * (205 - i)}
        for i in range(205)
    ]

    async def listed(route: Any) -> None:
        response = await route.fetch()
        body = await response.json()
        for provider in body["providers"]:
            if holders is None:
                provider.pop("holders", None)
            else:
                provider["holders"] = holders
                provider["in_flight"] = len(holders)
        await route.fulfill(response=response, json=body)

    await page.route("**/_slotproxy/status", listed)
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    rows = card.locator('tbody[data-field="holders"] tr')
    await expect(rows).to_have_count(200)
    await expect(card.locator('[data-field="holders-more"]')).to_have_text("…and 5 more holding a slot.")
    first = rows.first
    await expect(first.locator('[data-field="held"]')).to_have_text("3 h 25 min")
    await expect(first.locator('[data-field="model"]')).to_have_text("—")
    await expect(rows.nth(199).locator('[data-field="held"]')).to_have_text("6 min")
    await shot("1-capped")

    holders = None  # a proxy from before the holders list
    await expect(card.locator('[data-field="holding"]')).to_be_hidden()
    await expect(card.locator('[data-field="queue-empty"]')).to_be_visible()


# ----- the chart's span and its limit line ---------------------------------------------------

def synthetic_history(storm_ago: float = 150.0) -> dict[str, Any]:
    """An hour of samples every 5 s ending now: 2 in flight of a limit of 8, then a 30-second storm
    ``storm_ago`` seconds ago (paused, queued, the limit reduced to 3), after which 3 are in flight of 3."""
    now = time.time()
    provider_samples, key_samples = [], []
    for i in range(720):
        t = now - (719 - i) * 5
        ago = now - t
        storming = storm_ago - 30 < ago <= storm_ago
        after = ago <= storm_ago
        flags = (history.PAUSED if storming else 0) | (
            history.REDUCED if storming and ago > storm_ago - 5 else 0)
        limit = 3 if after else 8
        in_flight = 3 if after else 2
        provider_samples.append([int(t * 1000), in_flight, 6 if storming else 0, limit, flags])
        key_samples.append([int(t * 1000), min(in_flight, 2), 2, 0])
    return {"interval_ms": 5000, "window_ms": 3_600_000,
            "providers": [{"provider": "openai", "samples": provider_samples,
                           "keys": [{"name": "team-a", "samples": key_samples}]}]}


AXIS_LABELS = "svg => [...svg.querySelectorAll('text[data-axis=\"x\"]')].map(t => t.textContent)"
LINE_END = """(svg, series) => {
    const path = svg.querySelector(`path[data-series="${series}"]`);
    const end = path.getPointAtLength(path.getTotalLength());
    return [Math.round(end.x), Math.round(end.y)];
}"""


async def test_chart_span_buttons_switch_between_5_minutes_15_minutes_and_an_hour(
    start_upstream, start_proxy, page, shot, pool_env
) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(POOL_YAML.format(upstream=upstream.url))

    async def synthetic(route: Any) -> None:
        await route.fulfill(json=synthetic_history())

    await page.route("**/_slotproxy/history", synthetic)
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    chart = card.locator('svg[data-chart="provider"]')
    key_chart = card.locator('[data-key="team-a"] svg[data-chart="key"]')
    storm = chart.locator('rect[data-mark="paused"]')
    buttons = card.locator('[data-field="spans"] button')
    await expect(buttons).to_have_text(["5 min", "15 min", "1 h"])

    widths = {}
    for label, span, head, axis in [
        ("15 min", 900_000, "Last 15 minutes", ["−15 min", "−10 min", "−5 min", "now"]),
        ("5 min", 300_000, "Last 5 minutes", ["−5 min", "−4 min", "−3 min", "−2 min", "−1 min", "now"]),
        ("1 h", 3_600_000, "Last hour", ["−1 h", "−45 min", "−30 min", "−15 min", "now"]),
    ]:
        button = card.get_by_role("button", name=label, exact=True)
        if label != "15 min":  # 15 minutes is the default
            await button.click()
        await expect(button).to_have_attribute("aria-pressed", "true")
        await expect(card.locator('[aria-pressed="true"]')).to_have_count(1)
        await expect(chart).to_have_attribute("data-span-ms", str(span))
        await expect(key_chart).to_have_attribute("data-span-ms", str(span))
        await expect(card.locator('[data-field="history"] h3')).to_have_text(head)
        await expect(chart).to_have_attribute("aria-label", f"{head} of openai: in flight, queued and limit")
        assert await chart.evaluate(AXIS_LABELS) == axis
        await expect(storm).to_have_count(1)
        widths[label] = float(await storm.get_attribute("width") or 0)
        await shot(f"span-{label.replace(' ', '')}")
    # The 30-second storm is a band a tenth of the 5-minute chart wide, a sliver at an hour.
    assert widths["5 min"] > 50 and widths["1 h"] < 6
    assert widths["5 min"] > 2.5 * widths["15 min"] > 2.5 * 2.5 * widths["1 h"]

    # The choice is kept for the tab.
    await page.reload()
    await expect(page.locator('[data-provider="openai"] svg[data-chart="provider"]')).to_have_attribute(
        "data-span-ms", "3600000")


async def test_chart_span_is_limited_to_what_an_older_proxy_keeps(start_upstream, start_proxy, page) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))

    async def fifteen_minutes(route: Any) -> None:
        body = synthetic_history()
        body["window_ms"] = 900_000
        await route.fulfill(json=body)

    await page.route("**/_slotproxy/history", fifteen_minutes)
    await page.goto(f"{proxy.url}/_slotproxy/")
    await page.evaluate("sessionStorage.setItem('slotproxy.chartSpan', '3600000')")
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await expect(card.get_by_role("button", name="1 h", exact=True)).to_be_disabled()
    await expect(card.get_by_role("button", name="15 min", exact=True)).to_have_attribute("aria-pressed", "true")
    await expect(card.locator('svg[data-chart="provider"]')).to_have_attribute("data-span-ms", "900000")


async def test_the_limit_line_stays_visible_over_in_flight_after_a_reduction(
    start_upstream, start_proxy, client, page, shot, fast_history
) -> None:
    upstream = await start_upstream(retry_after=0.3)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await auto_reduce(proxy, client)
    await wait_until(lambda: not proxy.status()["paused"], what="the pause to end")
    # Two requests hold both slots of the reduced limit: in flight == limit == 2.
    holders = [asyncio.create_task(client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                                               headers={"x-fake-stall-ms": "2500"})) for _ in range(2)]
    await wait_until(lambda: proxy.status()["in_flight"] == 2, what="both slots held")
    chart = card.locator('svg[data-chart="provider"]')
    await expect(chart.locator('line[data-mark="reduced"]')).to_have_count(1)
    await expect(card.locator('[data-field="in-flight"]')).to_have_text("2")
    # The newest sample drawn has both at 2: the lines end at the same height.
    await page.wait_for_function(
        """svg => { const end = s => { const p = svg.querySelector(`path[data-series="${s}"]`);
                                       return p ? p.getPointAtLength(p.getTotalLength()).y : NaN; };
                    return Math.abs(end("in-flight") - end("limit")) < 0.5; }""",
        arg=await chart.element_handle())
    in_flight_end, limit_end = await chart.evaluate(LINE_END, "in-flight"), await chart.evaluate(LINE_END, "limit")
    assert in_flight_end == limit_end
    # The limit is drawn after (over) the in-flight line and its area, dashed in another colour.
    order = await chart.evaluate("svg => [...svg.querySelectorAll('path[data-series]')].map(p => p.dataset.series)")
    assert order == ["in-flight-area", "queued", "in-flight", "limit"]
    look = await chart.evaluate("""svg => {
        const style = s => getComputedStyle(svg.querySelector(`path[data-series="${s}"]`));
        return [style("limit").stroke, style("limit").strokeDasharray, style("in-flight").stroke,
                style("in-flight-area").fill, style("in-flight-area").fillOpacity];
    }""")
    limit_stroke, dashes, in_flight_stroke, area_fill, area_opacity = look
    assert dashes not in ("none", "") and limit_stroke != in_flight_stroke
    assert area_fill == in_flight_stroke and 0 < float(area_opacity) < 1
    # The limit's top (3) before the reduction sits below the frame's top edge, not on it.
    frame_top = float(await chart.locator("rect.frame").get_attribute("y") or 0)
    limit_top = await chart.evaluate("svg => svg.querySelector('path[data-series=\"limit\"]').getBBox().y")
    assert limit_top > frame_top + 2
    await card.locator('[data-field="history"]').screenshot(path=str(ARTIFACTS / "dashboard-limit-over-in-flight.png"))
    await shot("1-full-after-reduction")
    for response in await asyncio.gather(*holders):
        assert response.status == 200
        response.release()


# ----- the usage panel ------------------------------------------------------------------------

FAST_USAGE = "?usage_poll_ms=200"  # the page's own knob: the panel polls every 200 ms instead of every 10 s
USAGE_ROWS = """panel => [...panel.querySelectorAll('[data-field="usage-workspaces"] > [data-workspace]')].map(row => {
    const bar = row.querySelector('[data-field="usage-bar"]');
    const width = part => { const seg = bar.querySelector(`[data-part="${part}"]`);
                            return seg ? seg.getBoundingClientRect().width : 0; };
    const left = part => { const seg = bar.querySelector(`[data-part="${part}"]`);
                           return seg ? seg.getBoundingClientRect().left : NaN; };
    const colour = part => { const seg = bar.querySelector(`[data-part="${part}"]`);
                             return seg ? getComputedStyle(seg).backgroundColor : null; };
    return {
        workspace: row.dataset.workspace,
        data: [row.dataset.input, row.dataset.cached, row.dataset.output, row.dataset.requests, row.dataset.unknown].map(Number),
        numbers: [...row.querySelectorAll('[data-field="usage-numbers"] > span')].map(s => s.textContent),
        track: bar.getBoundingClientRect().width,
        widths: { cached: width("cached"), in: width("in"), out: width("out") },
        lefts: { cached: left("cached"), in: left("in"), out: left("out") },
        colours: { cached: colour("cached"), in: colour("in"), out: colour("out") },
    };
})"""
CONVERSATION_ROWS = """panel => [...panel.querySelectorAll('tbody[data-field="usage-conversations"] tr')].map(tr => [
    tr.dataset.conversation, ...[...tr.cells].map(td => td.textContent),
    Number(tr.dataset.input), Number(tr.dataset.output), Number(tr.dataset.requests), Number(tr.dataset.errors)])"""


async def respond(client: aiohttp.ClientSession, proxy: Any, workspace: str, conversation: str | None,
                  usage: dict[str, int]) -> None:
    """One Responses API request through the proxy; the fake reports ``usage`` as its tokens."""
    headers = {"X-Workspace-Id": workspace, "x-fake-usage": json.dumps(usage)}
    if conversation is not None:
        headers["X-Conversation-Id"] = conversation
    async with client.post(f"{proxy.url}/openai/responses", json={"model": "m", "input": "hi"},
                           headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def test_usage_panel_draws_tokens_by_workspace_and_the_top_conversations(
    start_upstream, start_proxy, client, page, shot
) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=4) + "prices: {m: {input: 1, output: 2}}\n")
    await open_dashboard(page, proxy, FAST_USAGE)
    panel = page.locator('[data-field="usage"]')
    await expect(panel).to_have_attribute("data-state", "empty")
    await expect(panel.locator("h2")).to_have_text("Usage, last 5 hours")
    await expect(panel.locator('[data-field="usage-empty"]')).to_have_text("No requests in the last 5 hours.")
    await expect(panel.locator('[data-field="usage-scope"]')).to_have_text("this replica")
    await expect(panel.locator('[data-field="usage-ledger-off"]')).to_be_hidden()
    # Below the provider cards, once for the page.
    assert await page.evaluate("""() => {
        const cards = document.getElementById('providers'), usage = document.getElementById('usage');
        return !!(cards.compareDocumentPosition(usage) & Node.DOCUMENT_POSITION_FOLLOWING); }""")
    await shot("1-empty")

    for _ in range(2):
        await respond(client, proxy, "alpha", "conv-a1", {"input": 40_000, "cached": 10_000, "output": 2_000})
    async with client.post(f"{proxy.url}/openai/responses", json={"model": "m", "input": "hi"}, headers={
            "X-Workspace-Id": "alpha", "X-Conversation-Id": "conv-a1", "x-fake-status": "500"}) as resp:
        assert resp.status == 500
        await resp.read()
    await respond(client, proxy, "alpha", "conv-a2", {"input": 6_000, "output": 1_000})
    await respond(client, proxy, "beta", "conv-b1", {"input": 9_000, "output": 9_000})
    await respond(client, proxy, "beta", None, {"input": 1_000, "output": 500})
    for i in range(11):  # 14 conversations in all: the panel shows the top 10
        await respond(client, proxy, "gamma", f"conv-g{i:02}", {"input": 100 + i, "output": 1})
    # A chat stream without stream_options.include_usage: the provider never states its tokens.
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"X-Workspace-Id": "beta"}) as resp:
        assert resp.status == 200
        await resp.read()

    await expect(panel).to_have_attribute("data-state", "rows")
    await expect(panel.locator('[data-field="usage-workspaces"] > [data-workspace]')).to_have_count(3)
    await expect(panel.locator('tbody[data-field="usage-conversations"] tr')).to_have_count(10)
    # The stream's row is written as it ends, a moment after its last byte: the next poll brings it.
    await expect(panel.locator('[data-workspace="beta"]')).to_have_attribute("data-unknown", "1")
    await expect(panel.locator('[data-field="usage-empty"]')).to_be_hidden()
    rows = {row["workspace"]: row for row in await panel.evaluate(USAGE_ROWS)}
    assert list(rows) == ["alpha", "beta", "gamma"]  # the API's order: input + output, largest first
    # input, cached, output, requests, unknown usage
    assert rows["alpha"]["data"] == [86_000, 20_000, 5_000, 4, 0]
    assert rows["beta"]["data"] == [10_000, 0, 9_500, 3, 1]
    assert rows["gamma"]["data"] == [1_155, 0, 11, 11, 0]
    # Dollars beside tokens (m costs $1 a million input tokens, $2 a million output tokens).
    assert rows["alpha"]["numbers"] == ["86 k in (20 k cached)", "5 k out", "$0.10", "4 requests", "1 error"]
    assert rows["beta"]["numbers"] == ["10 k in", "9.5 k out", "$0.03", "3 requests", "unknown usage: 1 request"]
    assert rows["gamma"]["numbers"] == ["1.2 k in", "11 out", "$0.0012", "11 requests"]

    # Bar lengths: proportional to input + output, the largest filling the track.
    track = rows["alpha"]["track"]
    assert track > 400 and all(row["track"] == track for row in rows.values())
    for name, row in rows.items():
        inp, _cached, out = row["data"][:3]
        filled = sum(row["widths"].values())
        assert abs(filled - track * (inp + out) / 91_000) < 2.5, (name, filled)
        # Input (its cached part included) and output apart, each proportional to its tokens.
        assert abs(row["widths"]["cached"] + row["widths"]["in"] - track * inp / 91_000) < 1.5, name
        if track * out / 91_000 >= 3:
            assert abs(row["widths"]["out"] - track * out / 91_000) < 1.5, name
        else:  # a sliver of output stays visible: its 2 px divider
            assert 0 < row["widths"]["out"] <= 2.5, name
        assert row["lefts"]["out"] > row["lefts"]["in"]
    alpha = rows["alpha"]
    assert abs(alpha["widths"]["cached"] - track * 20_000 / 91_000) < 1.5
    assert alpha["lefts"]["cached"] < alpha["lefts"]["in"] < alpha["lefts"]["out"]
    assert len(set(alpha["colours"].values())) == 3, alpha["colours"]  # input, cached input, output: three colours
    assert rows["beta"]["widths"]["cached"] == 0
    legend = await panel.locator(".usage-legend li").all_text_contents()
    assert legend == ["input tokens", "of which read from cache", "output tokens"]

    # The top 10 conversations, by input + output; requests with none are summed apart.
    conversations = await panel.evaluate(CONVERSATION_ROWS)
    assert [row[0] for row in conversations] == ["conv-a1", "conv-b1", "conv-a2",
                                                 *[f"conv-g{i:02}" for i in range(10, 3, -1)]]
    # Each with its workspace and its errors (conv-a1's third request was answered 500).
    assert conversations[0] == ["conv-a1", "conv-a1", "alpha", "80 k", "4 k", "3", "1", 80_000, 4_000, 3, 1]
    assert conversations[1] == ["conv-b1", "conv-b1", "beta", "9 k", "9 k", "1", "0", 9_000, 9_000, 1, 0]
    assert conversations[3] == ["conv-g10", "conv-g10", "gamma", "110", "1", "1", "0", 110, 1, 1, 0]
    assert await panel.locator("#usage-conv-table th").all_text_contents() == [
        "Conversation", "Workspace", "Tokens in", "Tokens out", "Requests", "Errors"]
    await expect(panel.locator('[data-field="usage-conversations-scope"]')).to_have_text("this replica")
    await expect(panel.locator('[data-field="usage-no-conversation"]')).to_have_text(
        "Named no conversation: 2 requests, 1 k in · 500 out.")
    await expect(panel.locator('[data-field="usage-error"]')).to_be_hidden()
    await panel.screenshot(path=str(ARTIFACTS / "dashboard-usage-panel.png"))
    await shot("2-usage")
    await page.emulate_media(color_scheme="dark")
    await panel.screenshot(path=str(ARTIFACTS / "dashboard-usage-panel-dark.png"))


async def test_usage_panel_says_plainly_when_the_ledger_is_off(start_upstream, start_proxy, client, page, shot) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2) + "ledger: {path: null}\n")
    usage_asks: list[str] = []
    page.on("request", lambda r: usage_asks.append(r.url) if "/_slotproxy/usage" in r.url else None)
    status_polls = 0

    def count_status(r: Any) -> None:
        nonlocal status_polls
        status_polls += "/_slotproxy/status" in r.url

    await respond(client, proxy, "alpha", "conv-1", {"input": 500, "output": 5})
    page.on("response", count_status)
    await open_dashboard(page, proxy)  # the default pace: once on load, then every 10 s
    panel = page.locator('[data-field="usage"]')
    await expect(panel).to_have_attribute("data-state", "ledger-off")
    off = panel.locator('[data-field="usage-ledger-off"]')
    await expect(off).to_be_visible()
    await expect(off).to_contain_text("the ledger is off (ledger.path is null in the config)")
    await expect(panel.locator('[data-field="usage-empty"]')).to_be_hidden()
    await expect(panel.locator('[data-field="usage-workspaces"] > [data-workspace]')).to_have_count(0)
    await expect(panel.locator('[data-field="usage-conversations"]')).to_be_hidden()
    await shot("1-ledger-off")
    # A database query is not polled like the status: after three status polls, still the one usage poll.
    await wait_until(lambda: status_polls >= 3, timeout=6, what="three status polls")
    assert sorted(url.rsplit("by=", 1)[1] for url in usage_asks) == ["conversation,workspace", "workspace"], usage_asks
    assert all("since=5h" in url for url in usage_asks)


def workspace_row(name: str, **counts: int) -> dict[str, Any]:
    row: dict[str, Any] = {"workspace": name, "requests": 1, "errors": 0, "input_tokens": 0, "cached_input_tokens": 0,
                           "cache_write_tokens": 0, "output_tokens": 0, "reasoning_tokens": 0, "unknown_usage": 0,
                           "queue_ms_p50": 0, "queue_ms_max": 0}
    row.update(counts)
    return row


async def test_usage_panel_shows_the_fleet_and_keeps_its_last_answer_when_a_poll_fails(
    start_upstream, start_proxy, page, shot
) -> None:
    """Answers as a Redis fleet gives them: workspaces fleet-wide, conversations from this replica's ledger (here off)."""
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    now = int(time.time() * 1000)
    workspaces = [workspace_row("release-team", requests=12, errors=1, input_tokens=1_234_567,
                                cached_input_tokens=600_000, output_tokens=34_000)]
    workspaces += [workspace_row(f"ws-{i:02}", input_tokens=1000 - i, output_tokens=10) for i in range(22)]
    answer: dict[str, Any] = {"status": 200}

    async def fleet(route: Any) -> None:
        if answer["status"] != 200:
            await route.fulfill(status=answer["status"], json={"error": {"message": answer["message"]}})
        elif "by=conversation" in route.request.url:
            await route.fulfill(json={"since": now - 5 * 3_600_000, "until": now, "by": ["conversation"],
                                      "scope": "replica", "rows": [],
                                      "ledger": "off (ledger.path is null): nothing is recorded"})
        else:
            await route.fulfill(json={"since": now - 5 * 3_600_000, "until": now, "by": ["workspace"],
                                      "scope": "fleet", "rows": workspaces})

    await page.route("**/_slotproxy/usage?*", fleet)
    await open_dashboard(page, proxy, FAST_USAGE)
    panel = page.locator('[data-field="usage"]')
    await expect(panel).to_have_attribute("data-scope", "fleet")
    await expect(panel.locator('[data-field="usage-scope"]')).to_have_text("whole fleet")
    rows = panel.locator('[data-field="usage-workspaces"] > [data-workspace]')
    await expect(rows).to_have_count(20)
    await expect(panel.locator('[data-field="usage-more"]')).to_have_text("…and 3 more workspaces, with fewer tokens.")
    first = rows.first
    await expect(first).to_have_attribute("data-workspace", "release-team")
    await expect(first.locator('[data-field="usage-numbers"] > span')).to_have_text(
        ["1.2 M in (600 k cached)", "34 k out", "12 requests", "1 error"])
    await expect(first.locator('[data-field="usage-input"]')).to_have_attribute("title", "1,234,567 input tokens")
    await expect(panel.locator('[data-field="usage-conversations-scope"]')).to_have_text(
        "this replica only: conversations are not kept fleet-wide")
    await expect(panel.locator('[data-field="usage-conversations-off"]')).to_be_visible()
    await expect(panel.locator('[data-field="usage-conversations-empty"]')).to_be_hidden()
    await expect(panel.locator('[data-field="usage-ledger-off"]')).to_be_hidden()
    await shot("1-fleet")

    # A failed poll keeps the last answer on screen, greyed, and says why.
    answer.update(status=500, message="database is locked")
    error = panel.locator('[data-field="usage-error"]')
    await expect(error).to_have_text("Usage could not be read (database is locked); showing the last answer.")
    await expect(panel).to_have_class(re.compile(r"\bstale\b"))
    await expect(rows).to_have_count(20)
    await shot("2-poll-failed")
    answer.update(status=200)
    await expect(error).to_be_hidden()
    await expect(panel).not_to_have_class(re.compile(r"\bstale\b"))

    # A proxy from before the usage route: no panel.
    answer.update(status=404, message="not found")
    await expect(panel).to_be_hidden()


WINDOWS_YAML = """
state: {{path: null}}
providers:
  anthropic:
    upstream: {upstream}
    auth: x-api-key
    limit: 8
    queue_timeout: 30
    windows: {{input_tokens_per_minute: 6000}}
    models: {{"claude-sonnet-*": {{limit: 4}}}}
  openai:
    upstream: {upstream}/v1
    keys:
      - {{name: team-a, api_key_env: SP_DASH_KEY_A, windows: {{tokens_per_minute: 90000}}}}
"""


async def test_token_windows_show_as_bars_with_their_room_waiters_and_hits(
    start_upstream, start_proxy, client, page, shot, monkeypatch
) -> None:
    monkeypatch.setenv("SP_DASH_KEY_A", "key-a")
    upstream = await start_upstream()
    proxy = await start_proxy(WINDOWS_YAML.format(upstream=upstream.url))
    backend = proxy.state.backend
    # What a relayed request takes when it is sent: a sonnet request's estimated 5,400 input tokens of 6,000,
    # and a gpt-5 request's 30,000 tokens of team-a's 90,000.
    sonnet = await backend.acquire("anthropic", Priority(time.time()), model="claude-sonnet-4-5",
                                   cost={"input_tokens_per_minute": 5400}, group="claude-sonnet-*")
    gpt = await backend.acquire("openai", Priority(time.time()), model="gpt-5",
                                cost={"tokens_per_minute": 30000}, group="gpt-5")
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="anthropic"]')
    windows = card.locator('[data-field="windows"]').first
    row = windows.locator('[data-group="claude-sonnet-*"][data-window="input_tokens_per_minute"]')
    await expect(row).to_contain_text("input tokens per minute")
    await expect(row.locator('[data-field="window-limit"]')).to_have_text("6,000")
    await expect(row.locator('[data-field="window-available"]')).to_have_text(re.compile(r"^[67]\d\d$"))
    await expect(row.locator('[data-field="window-reserved"]')).to_have_text("5,400 reserved")
    await expect(row.locator('[data-field="window-source"]')).to_have_text("limit from the config")
    await expect(row.locator('[data-field="window-held"]')).to_have_text("none waiting")
    await expect(row.locator('[data-field="window-hits"]')).to_have_text("0 hits")
    bar = row.locator('[data-field="window-bar"]')
    await expect(bar).to_have_attribute("aria-valuemax", "6000")
    assert 600 <= int(await bar.get_attribute("aria-valuenow") or 0) < 6000
    width = await bar.locator("span").evaluate("node => node.getBoundingClientRect().width / node.parentNode.getBoundingClientRect().width")
    assert 0.09 < width < 0.3, "the bar is the room left: a tenth and a bit, refilling"
    await shot("1-window-in-use")

    # The next sonnet request asks 2,000: it waits on the window, which the bar says in the waiters' colour.
    held = asyncio.create_task(backend.acquire("anthropic", Priority(time.time()), model="claude-sonnet-4-5",
                                               cost={"input_tokens_per_minute": 2000}, group="claude-sonnet-*"))
    await expect(row.locator('[data-field="window-held"]')).to_have_text("1 waiting on it")
    await expect(bar).to_have_class(re.compile(r"\bheld\b"))
    # A 429 that names the window: a hit, and the window is empty until the provider's wait is over.
    backend.report_window_hit("anthropic", None, "claude-sonnet-*", "input_tokens_per_minute", time.time() + 30)
    await expect(row.locator('[data-field="window-hits"]')).to_have_text("1 hit")
    await expect(row.locator('[data-field="window-available"]')).to_have_text("0")
    await expect(bar).to_have_attribute("aria-valuetext", "0 of 6,000 available")
    await shot("2-window-holds-a-waiter-after-a-hit")
    held.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await held
    await expect(row.locator('[data-field="window-held"]')).to_have_text("none waiting")

    # A pool's windows are on its keys' rows, not on the card.
    pool = page.locator('[data-provider="openai"]')
    await expect(pool.locator('.card > [data-field="windows"], article > [data-field="windows"]')).to_be_hidden()
    key_row = pool.locator('[data-key="team-a"] [data-window="tokens_per_minute"]')
    await expect(key_row.locator('[data-field="window-limit"]')).to_have_text("90,000")
    await expect(key_row.locator('[data-field="window-reserved"]')).to_have_text("30,000 reserved")
    await expect(key_row).to_have_attribute("data-group", "gpt-5")
    await shot("3-key-window")
    sonnet.release()
    gpt.release()
    await expect(key_row.locator('[data-field="window-reserved"]')).to_have_text("0 reserved")


async def test_a_proxy_without_windows_shows_no_window_section(start_upstream, start_proxy, page) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream))
    await open_dashboard(page, proxy)
    card = page.locator('[data-provider="openai"]')
    await expect(card.locator('[data-field="limit"]')).to_have_text("unlimited")
    await expect(card.locator('[data-field="windows"]')).to_be_hidden()


async def test_a_window_shows_its_ratio_estimate_errors_and_where_its_limit_came_from(
    start_upstream, start_proxy, page, monkeypatch
) -> None:
    """The estimator's fields (null until answers come) and a limit learned from the headers, as the status
    says them once requests have been answered."""
    monkeypatch.setenv("SP_DASH_KEY_A", "key-a")
    upstream = await start_upstream()
    proxy = await start_proxy(WINDOWS_YAML.format(upstream=upstream.url))
    lease = await proxy.state.backend.acquire("anthropic", Priority(time.time()), model="claude-sonnet-4-5",
                                              cost={"input_tokens_per_minute": 100}, group="claude-sonnet-*")
    lease.release()

    async def answered(route: Any) -> None:
        response = await route.fetch()
        body = await response.json()
        for provider in body["providers"]:
            for window in provider.get("windows") or []:
                window.update(source="both", ratio=0.3125, estimate_error_p50=-0.04, estimate_error_p90=0.12)
        await route.fulfill(response=response, json=body)

    await page.route("**/_slotproxy/status", answered)
    await open_dashboard(page, proxy)
    row = page.locator('[data-provider="anthropic"] [data-window="input_tokens_per_minute"]')
    await expect(row.locator('[data-field="window-ratio"]')).to_have_text("0.31 tokens/byte")
    await expect(row.locator('[data-field="window-error"]')).to_have_text("estimates off by −4% (p50) +12% (p90)")
    await expect(row.locator('[data-field="window-source"]')).to_have_text(
        "limit: the smaller of the config's and the headers'")


async def test_spend_panel_shows_each_capped_workspace_s_dollars_today_and_its_refusal(
    start_upstream, start_proxy, client, page, shot
) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=4) + "prices: {m: {input: 10000, output: 10000}}\n"
                              "workspaces: {spend_per_day_usd: {'*': 5, web: 0.1}}\n")
    await open_dashboard(page, proxy)
    spend = page.locator('[data-field="spend"]')
    await expect(spend).to_be_hidden()
    await respond(client, proxy, "web", None, {"input": 10, "output": 1})
    await respond(client, proxy, "docs", None, {"input": 1, "output": 1})
    await expect(spend).to_be_visible()
    items = spend.locator("li")
    await expect(items).to_have_count(2)
    await expect(items.nth(0)).to_contain_text("docs: $0.02 of $5.00")
    await expect(items.nth(1)).to_contain_text("web: $0.11 of $0.10 — new requests refused, resets at")
    await expect(items.nth(1)).to_have_class("refused")
    await shot("spend")
