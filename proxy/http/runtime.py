"""What a running proxy shares across requests, each job in a part of its own.

``ProxyState`` swaps the config whole on reload and hands each part its share:

- the backend (slots, queues, limits), built once;
- ``Upstreams``: pooled sessions, timeouts, the provider keys to inject;
- ``StarOverrides`` and ``StateWriter``: runtime stars and the state file;
- ``GatePollers``: the concurrency gates' poll loops (the ``usage:`` blocks);
- ``BrowserGuard`` and ``ConnectionGuard``: who may call, and how slowly;
- ``OpenSockets``: the WebSockets open now (status, metrics, shutdown);
- the request count that graceful shutdown waits on.

The relay, the status document (``admin.status``) and the metrics read these
parts; none of them imports the relay, and nothing here imports the admin routes
(the failed admin logins are counted by ``admin.api`` itself).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ..aio import cancel_and_wait
from ..backends import Backend, MemoryBackend
from ..config import Config, ProviderSettings, beside_config
from ..config.model import Backend as BackendSettings
from ..errors import SpendLimitReached
from ..ledger.prices import DAY_MS, PriceTable, warm_up
from ..ledger.spend import DailySpend, SpendUnread, spend_query
from ..ledger.store import Ledger, LedgerWriteError
from ..limiter import (
    KeySettings,
    LimiterSettings,
    ModelCap,
    ProviderStatus,
    SlotLease,
    policy,
)
from ..logs import ThrottledLog
from ..providers.concurrency_gate import GatePollers
from ..telemetry import TelemetryNotInstalled, check_installed, telemetry_settings
from ..telemetry import start as start_telemetry
from .access import ClientKeys
from .accounting import Account
from .connections import ConnectionGuard, ConnectionSettings
from .guard import BrowserGuard
from .headers import InvalidHeaderLog, PriorityHeaders
from .idle import IdleWatch
from .metrics import Metrics
from .state import ManualLimits, StarOverrides, StateStore, StateWriter
from .upstreams import Upstreams
from .windows import Windowing

if TYPE_CHECKING:
    from ..backends.redis import RedisTarget
    from ..telemetry.sdk import Telemetry

__all__ = ["OpenSocket", "OpenSockets", "ProxyState", "limiter_settings", "make_backend", "redis_target"]

log = logging.getLogger("slotproxy")

_SPEND_READ_EVERY = 1.0
"""Seconds between reads of the day's spend (the fleet's, or the host's workers')."""
_RETIRED_TELEMETRY_WAIT = 600.0
"""How long telemetry a reload replaced waits for the requests it traced (a long stream) before it closes."""


def limiter_settings(settings: ProviderSettings, environ: Mapping[str, str] | None = None, *,
                     max_share: float | None = None) -> LimiterSettings:
    """The limiter's view of one provider; a pool key whose variable is unset or empty in ``environ``
    (the process environment by default) is not available."""
    environ = os.environ if environ is None else environ
    return LimiterSettings(
        limit=settings.limit,
        release_cooldown=settings.release_cooldown,
        default_pause=settings.default_pause,
        overload_pause=settings.overload_pause,
        slot_timeout=settings.slot_timeout,
        queue_timeout=settings.queue_timeout,
        max_queue=settings.max_queue,
        recovery_after=settings.recovery.after if settings.recovery is not None else None,
        keys=tuple(KeySettings(key.name, key.limit, available=bool(environ.get(key.api_key_env)))
                   for key in settings.keys),
        models=tuple(ModelCap(pattern, cap.limit) for pattern, cap in settings.models.items()),
        max_share=max_share,
        budgets=settings.budgets,
        windows=settings.window_settings(),
    )


class OpenSocket(Protocol):
    provider: str

    def shutdown(self) -> None:
        """Close now if no response is in flight, else once the last one ends."""


class OpenSockets:
    """The relayed WebSockets open now, by provider."""

    def __init__(self) -> None:
        self._open: dict[str, set[OpenSocket]] = {}

    def opened(self, socket: OpenSocket) -> None:
        self._open.setdefault(socket.provider, set()).add(socket)

    def closed(self, socket: OpenSocket) -> None:
        sockets = self._open.get(socket.provider)
        if sockets is not None:
            sockets.discard(socket)

    def count(self, provider: str) -> int:
        return len(self._open.get(provider, ()))

    def shutdown(self) -> int:
        """Ask every socket to close (graceful shutdown); returns how many were open."""
        sockets = [socket for group in self._open.values() for socket in group]
        for socket in sockets:
            socket.shutdown()
        return len(sockets)


class ProxyState:
    """The running proxy's parts, and the config they were last given."""

    _warned: frozenset[str] = frozenset()
    """The config warnings in force at the last ``apply``: a reload logs only those that are new."""

    def __init__(self, config: Config, *, config_path: str | None = None, backend: Backend | None = None,
                 worker: int | None = None) -> None:
        """``worker``: this process is worker N of ``serve --workers``. It writes the host's one ledger with
        the other workers, its metrics go to the host's files, and it keeps no state file: the workers share
        their state through Redis, and a file several processes rewrite whole would keep only the last
        writer's view."""
        self.config_path = config_path
        self.worker = worker
        self.config_error: str | None = None
        self.config_missing_since: float | None = None
        """When the config file was found gone (epoch seconds), None while it is there."""
        self.header_refusals = InvalidHeaderLog()
        """Kept across reloads, so a reload does not restart its once a minute."""
        self.backend: Backend = backend or make_backend(config)
        self.open_sockets = OpenSockets()
        self.metrics = Metrics(lambda: self.backend.statistics(queue_detail=False), self.backend.backend_status,
                               self.open_sockets.count, worker=worker)
        self.telemetry: Telemetry | None = start_telemetry(config.telemetry, os.environ,
                                                           self.metrics.telemetry_dropped.inc)
        """Traces and GenAI metrics, when an OTLP endpoint is configured (a reload may change it)."""
        self._retiring: dict[asyncio.Task[None], Telemetry] = {}
        """Telemetry a reload replaced, exporting the spans of the requests it traced until they end."""
        self.upstreams = Upstreams()
        self.idle_watch = IdleWatch()
        """The idle_timeout deadlines of the upstream exchanges in flight."""
        self.stars = StarOverrides()
        self.manual_limits = ManualLimits()
        """The limits set by hand through the admin API, and when."""
        state_path = None if worker is not None else beside_config(config.state.path, config_path)
        self.state_file = StateWriter(StateStore(state_path), self._runtime_state)
        ledger_path = beside_config(config.ledger.path, config_path)
        self.ledger = Ledger(ledger_path, config.ledger.retention, on_dropped=self.metrics.ledger_dropped.inc)
        self.pollers = GatePollers()
        self.prices = PriceTable()
        self.spend = DailySpend()
        """Each workspace's spend today against its cap (``workspaces.spend_per_day_usd``)."""
        self._spend_task: asyncio.Task[None] | None = None
        self._spend_unread = ThrottledLog(log, logging.WARNING, "the day's spend could not be read (%s); the "
                                          "spend caps count what was read last and this replica's own requests",
                                          interval=60.0)
        self._windowing: dict[str, Windowing] = {}
        self.listen_host = config.server.host
        self.connections = ConnectionGuard()
        self.shutting_down = False
        self.active_requests = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.config = config
        restored = self.state_file.store.load()
        if restored is not None:
            self.stars.load(restored.get("star_overrides"), config.workspaces.starred)
            self.manual_limits.load(restored.get("manual_limits"))
        self.apply(config)
        if restored is not None:
            for name, entry in (restored.get("providers") or {}).items():
                if isinstance(entry, dict) and self.backend.has_provider(name):
                    self.backend.restore_state(name, entry)
            log.info("runtime state restored from %s", self.state_file.store.path)
        self.backend.on_change = self.state_file.schedule

    def apply(self, config: Config) -> None:
        """Swap in a validated config; the backend keeps everything queued and in flight."""
        providers = {name: config.provider(name) for name in config.provider_names()}
        self.upstreams.configure(providers)
        self.client_keys = ClientKeys.from_env(config.access.keys_env, os.environ)
        warnings = config.warnings(os.environ)
        for warning in warnings:
            if warning not in self._warned:  # said once; again only if it went away and came back
                log.warning("%s", warning)
        self._warned = frozenset(warnings)
        names = config.headers
        self.priority_headers = PriorityHeaders(
            workspace=names.workspace, starred=names.starred, prompt_started_at=names.prompt_started_at,
            conversation=names.conversation, max_prompt_age=names.max_prompt_age, refusals=self.header_refusals,
        )
        self.strip_headers = self.priority_headers.names()
        server = config.server
        self.browser = BrowserGuard.for_listener(self.listen_host, server.allowed_hosts, server.allowed_origins)
        self.connections.configure(ConnectionSettings(
            header_timeout=server.header_timeout, write_timeout=server.write_timeout,
            max_connections=server.max_connections))
        self.stars.yaml_changed(self.config.workspaces.starred, config.workspaces.starred)
        self.backend.configure(
            {name: limiter_settings(settings, max_share=config.workspaces.max_share)
             for name, settings in providers.items()},
            self.stars.effective(config.workspaces.starred),
        )
        self._providers = providers
        self.prices.configure(config.prices, {name: (settings.upstream, settings.dialect)
                                              for name, settings in providers.items()})
        self.spend.configure(config.workspaces.spend_per_day_usd)
        self._refuse_queued(self.spend.newly_capped())
        self._retarget_telemetry(config)
        self._windowing = self._windowings(providers)
        self._model_patterns = {name: tuple(settings.models) for name, settings in providers.items()
                                if settings.models}
        self.config = config
        self.loaded_at = time.time()
        self.pollers.sync(providers, self.backend, self.upstreams.session_for)

    @staticmethod
    def telemetry_refusal(config: Config) -> str | None:
        """Why ``config``'s telemetry cannot run here (the ``otel`` extra is missing), else None: a reload
        asking for it is refused whole, as an invalid file is."""
        settings = telemetry_settings(config.telemetry, os.environ)
        if settings is None:
            return None
        try:
            check_installed(settings)
        except TelemetryNotInstalled as exc:
            return str(exc)
        return None

    def _retarget_telemetry(self, config: Config) -> None:
        """A reload that changed where or how requests are traced: the next requests are traced by new
        telemetry; the old one exports the spans of the requests it traced as they end, then closes."""
        current = self.telemetry
        wanted = telemetry_settings(config.telemetry, os.environ)
        if wanted == (None if current is None else current.settings) or self._spend_task is None:
            return  # unchanged, or not started yet (``start`` starts what ``__init__`` made)
        self.telemetry = start_telemetry(config.telemetry, os.environ, self.metrics.telemetry_dropped.inc)
        if self.telemetry is not None:
            self.telemetry.start(self._gauges)
        log.info("telemetry %s", "off" if wanted is None else
                 f"now exports to {wanted.shown_endpoint} (sample {wanted.sample:g})")
        if current is not None:
            task = asyncio.get_running_loop().create_task(current.retire(_RETIRED_TELEMETRY_WAIT))
            self._retiring[task] = current
            task.add_done_callback(self._retiring.pop)

    def _gauges(self) -> list[ProviderStatus]:
        return self.backend.statistics(queue_detail=False)

    def listen_on(self, host: str) -> None:
        """The address the server is bound to decides the Host rule (loopback or not)."""
        self.listen_host = host
        server = self.config.server
        self.browser = BrowserGuard.for_listener(host, server.allowed_hosts, server.allowed_origins)

    def set_star(self, workspace: str, starred: bool) -> frozenset[str]:
        """Star or unstar at runtime (``TooManyStars`` past the cap); returns the starred set now in force."""
        self.stars.set(workspace, starred, self.config.workspaces.starred)
        stars = self.stars.effective(self.config.workspaces.starred)
        self.backend.set_starred(stars)
        log.info("workspace=%s %s via the admin API", workspace, "starred" if starred else "unstarred")
        self.state_file.schedule()
        return stars

    def _runtime_state(self) -> dict[str, object]:
        return {"providers": self.backend.export_state(), "star_overrides": self.stars.as_dict(),
                "manual_limits": self.manual_limits.as_dict()}

    def request_started(self) -> None:
        self.active_requests += 1
        if self.active_requests == 1:
            self.idle.clear()

    def request_finished(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self.idle.set()

    def provider(self, name: str) -> ProviderSettings | None:
        return self._providers.get(name)

    def provider_names(self) -> list[str]:
        return list(self._providers)

    def windowing(self, name: str) -> Windowing | None:
        """The provider's token windows as the relay sees them; None when it holds none."""
        return self._windowing.get(name)

    def _windowings(self, providers: Mapping[str, ProviderSettings]) -> dict[str, Windowing]:
        """One per provider with ``windows:`` written; a provider's estimator (what it learned) and the drift
        of its estimates outlive a reload."""
        built = {}
        for name, settings in providers.items():
            windows = settings.window_settings()
            if windows is None:
                continue
            known = self._windowing.get(name)
            built[name] = Windowing(name, settings.dialect, patterns=tuple(settings.models),
                                    keys=tuple(key.name for key in settings.keys), learn=windows.learn,
                                    headroom=windows.headroom,
                                    estimator=None if known is None else known.estimator,
                                    drift=None if known is None else known.drift)
        return built

    def observe_grant(self, provider: str, lease: SlotLease) -> None:
        self.metrics.observe_wait(provider, lease.queue_wait)
        if lease.queue_wait >= self.config.logging.slow_grant:
            log.info(
                "provider=%s granted a slot after %.1fs in the queue (workspace=%s conversation=%s)",
                provider, lease.queue_wait, lease.priority.workspace, lease.priority.conversation or "-",
            )

    async def start(self) -> None:
        """Connect the backend (Redis) and open the ledger before the first request is served; with spend
        caps, read the day's spend so far before too (a restart does not start the day again)."""
        warm_up()
        await self.backend.start()
        await self.ledger.start()
        if self.telemetry is not None:
            self.telemetry.start(self._gauges)
        await self.read_spend()
        self._spend_task = asyncio.get_running_loop().create_task(self._read_spend_every(_SPEND_READ_EVERY))

    async def read_spend(self) -> None:
        """The day's spend per workspace, from the fleet's totals (Redis) or the ledger; kept as it was when
        neither can be read."""
        spend = self.spend
        if not spend.caps:
            return
        taken = spend.read_started()
        day = spend.day
        try:
            totals = await self.backend.fleet_spend(day * DAY_MS)
            if totals is None and not self.ledger.enabled:  # only what this process counted
                spend.read_failed(taken, day)
                return
            if totals is None:
                totals = dict(await self.ledger.read(*spend_query(day * DAY_MS)))
        except (LedgerWriteError, SpendUnread) as exc:
            spend.read_failed(taken, day)
            self._spend_unread.event(str(exc))
            return
        spend.read_done(totals, day)
        self._refuse_queued(spend.newly_capped())

    async def _read_spend_every(self, seconds: float) -> None:
        """Other replicas' (or workers') spend, read again and again: a cap holds for the whole fleet."""
        while True:
            await asyncio.sleep(seconds)
            await self.read_spend()

    async def close(self) -> None:
        await cancel_and_wait(self._spend_task)
        await self.pollers.close()
        await self.upstreams.close()
        await self.ledger.close()
        await self.backend.close()
        if self.telemetry is not None:
            await self.telemetry.close()
        for retiring in list(self._retiring.values()):
            retiring.hurry()
        await asyncio.gather(*self._retiring, return_exceptions=True)

    def account(self, account: Account) -> None:
        """A request ended: its ledger row, the fleet's aggregates, the token counters, its spans."""
        trace = account.trace
        if trace is not None:
            trace.end(account)
        row = account.row(self.prices)
        self.ledger.record(row)
        self.backend.record_usage(row)
        if row.input_tokens is not None:
            patterns = self._model_patterns.get(row.provider)
            model = policy.model_pattern(row.model, patterns) if patterns else None
            self.metrics.count_tokens(row, model or "other")
            if row.cost_usd is not None:
                self.spend.add(row.workspace, row.cost_usd, row.ended_at)
                if self.spend.caps and self.spend.reached(row.workspace):
                    self._refuse_queued([row.workspace])

    def spend_refusal(self, workspace: str, settings: ProviderSettings) -> SpendLimitReached | None:
        """The refusal of a new request of ``workspace`` whose spend today reached its cap, else None."""
        return self.spend.refusal(workspace, settings.name, settings.dialect) if self.spend.caps else None

    def _refuse_queued(self, workspaces: list[str]) -> None:
        """Workspaces whose spend has just reached their cap: their requests queued in this process are refused
        now, each in its provider's shape, rather than when a slot comes; those in flight finish."""
        for workspace in workspaces:
            for name, settings in self._providers.items():
                refusal = self.spend.refusal(workspace, name, settings.dialect)
                if refusal is not None:
                    refused = self.backend.reject_waiters(name, workspace, refusal)
                    if refused:
                        log.info("provider=%s refused %d queued request(s) of workspace=%s: its spend today "
                                 "reached its cap", name, refused, workspace)


def redis_target(backend: BackendSettings, environ: Mapping[str, str] | None = None) -> RedisTarget:
    """How to reach Redis, from the config's ``backend`` (passwords read from the variables it names)."""
    from ..backends.redis import RedisTarget

    environ = os.environ if environ is None else environ

    def addresses(entries: tuple[str, ...] | None) -> tuple[tuple[str, int], ...]:
        return tuple((host.strip("[]"), int(port)) for host, _, port in (entry.rpartition(":") for entry in entries or ()))

    tls = backend.tls
    return RedisTarget(
        url=backend.url if backend.topology == "single" else None,
        sentinels=addresses(backend.sentinels), service=backend.service, cluster=addresses(backend.cluster),
        username=backend.username,
        password=environ.get(backend.password_env) or None if backend.password_env else None,
        sentinel_password=environ.get(backend.sentinel_password_env) or None if backend.sentinel_password_env else None,
        tls=tls is not None or backend.url.startswith("rediss://"),
        ca_file=tls.ca_file if tls else None, cert_file=tls.cert_file if tls else None,
        key_file=tls.key_file if tls else None)


def make_backend(config: Config) -> Backend:
    if config.backend.kind == "redis":
        from ..backends.redis import RedisBackend

        return RedisBackend(
            redis_target(config.backend),
            key_prefix=config.backend.key_prefix,
            lease_ttl=config.backend.lease_ttl,
            on_backend_error=config.backend.on_backend_error,
            local_limit=config.backend.local_limit,
            usage_retention=config.ledger.retention,
        )
    return MemoryBackend()
