"""The servers behind the PD proxy (:mod:`ucm_db.tools.proxy`): their URLs,
the proxy's limits, one connection pool per server and the round-robin
order of each side.

Invariants:
    * Every server has its own pool and its own count of requests in
      flight, at most ``max_connections``: streams held open on one server
      never make a request to another server wait, and each server's
      ``/health`` and ``/v1/models`` probes use a small pool of their own, so
      a busy proxy still answers its probes and a server that hangs holds
      up only its own. A server whose count is full is skipped like an
      unreachable one (nothing was sent to it), and reported as the proxy
      being saturated, not as the server being down. All the pools share
      one SSL context, built once.
    * URLs and limits are checked once, at start-up (:func:`parse_urls`,
      :class:`ProxyLimits`): a request never meets a URL httpx refuses, no
      server is named twice on a side, and no URL carries a password (URLs
      appear in clients' error messages and in ``/health``).
    * Servers are reached directly, as named: the environment's
      ``HTTP_PROXY``/``ALL_PROXY`` are not read (an unset ``NO_PROXY`` would
      send every request to a forward proxy).
    * A failure is described by what it means for the request: not sent
      (:func:`unsent`: the next server of the side may take it), or sent
      and then lost (a generation may be running: never sent again).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from ucm_db import ConfigError

MIB = 1 << 20
CONNECT_TIMEOUT_S = 5.0
#: How long a request waits for a pooled connection once our own count
#: admitted it (a backstop: the count keeps httpx's pool from filling).
POOL_WAIT_S = 5.0
#: Idle keep-alive connections are dropped before uvicorn's (vLLM's) 5 s
#: keep-alive timeout closes them from the server's side, which would fail
#: a request sent on one at that moment.
KEEPALIVE_EXPIRY_S = 2.0
#: ``/health`` asks each server with this total deadline.
HEALTH_TIMEOUT_S = 5.0


def parse_urls(value: str, side: str) -> tuple[str, ...]:
    """``URL[,URL...]`` of one side, each ``http(s)://host[:port]`` (no
    user or password, path, query or fragment), no server twice."""
    urls = tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())
    if not urls:
        raise ConfigError(f"--{side} names no server", hint=f"pass --{side} http://127.0.0.1:8100[,http://...]")
    seen: dict[tuple[str, str, int], str] = {}
    for url in urls:
        problem = _url_problem(url)
        if problem:
            raise ConfigError(f"--{side}: {_shown(url)!r} is not a server URL ({problem})",
                              hint=f"write each {side} server as http://HOST:PORT, comma-separated")
        parts = urlsplit(url)
        server = (parts.scheme, parts.hostname or "", parts.port or _DEFAULT_PORTS[parts.scheme])
        if server in seen:  # a second Upstream would double its --max-connections and hide one count in /health
            raise ConfigError(f"--{side} names {url!r} more than once (as {seen[server]!r} too)",
                              hint=f"name each {side} server once")
        seen[server] = url
    return urls


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _url_problem(url: str) -> str:
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number or out of range
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if parts.username is not None or parts.password is not None:
        # it would be shown to clients in error messages and /health, and replace their Authorization header
        return "a server URL has no user or password; the client's Authorization header is passed on"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "a server URL has no path, query or fragment"
    return ""


def _shown(url: str) -> str:
    """``url`` with any user and password masked (they never reach a message)."""
    scheme, sep, rest = url.partition("://")
    host_part, slash, tail = rest.partition("/")
    if "@" not in host_part:
        return url
    return f"{scheme}{sep}***@{host_part.rpartition('@')[2]}{slash}{tail}"


@dataclass(frozen=True)
class ProxyLimits:
    """What the proxy waits for and holds (docs/pd.md, "The proxy")."""

    #: A decode server's whole unstreamed answer; for a stream its first
    #: bytes, then each gap between two chunks.
    timeout_s: float = 600.0
    #: The whole prefill phase, every prefill server tried (None: ``timeout_s``).
    prefill_timeout_s: float | None = None
    #: Requests in flight to one server.
    max_connections: int = 1024
    #: Largest request body a client may send (why 32 MiB: :mod:`ucm_db.tools.proxy`).
    max_body_bytes: int = 32 * MIB
    #: A body over this is parsed and encoded in a worker process, not on the event loop
    #: (:class:`~ucm_db.tools.proxy_bodies.BodyPool`; 256 KiB costs the loop a few ms).
    offload_body_bytes: int = 256 << 10
    #: Large bodies waiting for or held by a worker, in all; past it a 503.
    offload_budget_bytes: int = 256 * MIB
    #: Worker processes preparing large bodies.
    body_workers: int = 2

    def __post_init__(self) -> None:
        for name in ("timeout_s", "prefill_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                option = "--" + name.replace("_", "-")
                raise ConfigError(f"{option} must be a positive number of seconds, got {value}",
                                  hint=f"pass {option} 600 (a large finite number for a long wait)")
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-mb must be positive, got {self.max_body_bytes / MIB:g}")
        if self.offload_body_bytes < 0 or self.offload_budget_bytes < 1 or self.body_workers < 1:
            raise ConfigError("large bodies need a threshold >= 0, a budget and a worker, got "
                              f"{self.offload_body_bytes}, {self.offload_budget_bytes} and {self.body_workers}")

    @property
    def prefill_deadline(self) -> tuple[float, str]:
        """The prefill phase's deadline and the option that set it."""
        if self.prefill_timeout_s is None:
            return self.timeout_s, "--timeout-s"
        return self.prefill_timeout_s, "--prefill-timeout-s"


class Upstream:
    """One server: its own pool, its count of requests in flight, and the
    pool of its probes (``control``)."""

    def __init__(self, url: str, limits: ProxyLimits) -> None:
        self.url = url
        self.limit = limits.max_connections
        self.in_flight = 0
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(limits.timeout_s, connect=CONNECT_TIMEOUT_S, pool=POOL_WAIT_S),
            transport=_direct(httpx.Limits(max_connections=self.limit, max_keepalive_connections=min(self.limit, 64),
                                           keepalive_expiry=KEEPALIVE_EXPIRY_S)))
        self.control = control_client()

    def try_acquire(self) -> bool:
        """Counts one request in flight; False (nothing counted) when full."""
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1

    def saturated(self) -> str:
        return f"{self.url}: proxy saturated ({self.limit} connections in use; raise --max-connections)"


class Side:
    """The servers of one side, handed out round-robin."""

    def __init__(self, name: str, urls: Sequence[str], limits: ProxyLimits) -> None:
        self.name = name
        self.urls = tuple(urls)
        self.servers: list[Upstream] = []
        self._limits = limits
        self._next: Iterator[int] = itertools.cycle(range(len(self.urls)))

    def open(self) -> None:
        """Creates the pools (inside the event loop that will use them)."""
        self.servers = [Upstream(url, self._limits) for url in self.urls]

    async def aclose(self) -> None:
        for server in self.servers:
            await server.client.aclose()
            await server.control.aclose()

    def order(self) -> list[Upstream]:
        """Every server once, starting with this request's turn."""
        start = next(self._next)
        return [self.servers[(start + i) % len(self.servers)] for i in range(len(self.servers))]


def control_client() -> httpx.AsyncClient:
    """One server's pool for ``/health`` and ``/v1/models``, apart from the traffic's."""
    return httpx.AsyncClient(timeout=httpx.Timeout(HEALTH_TIMEOUT_S),
                             transport=_direct(httpx.Limits(max_connections=64, max_keepalive_connections=8,
                                                            keepalive_expiry=KEEPALIVE_EXPIRY_S)))


def _direct(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """A pool that connects to its server itself: a client given its own
    transport reads no ``HTTP_PROXY``/``ALL_PROXY``. Every pool shares one
    SSL context (:func:`_ssl_context`)."""
    return httpx.AsyncHTTPTransport(limits=limits, verify=_ssl_context(os.environ.get("SSL_CERT_FILE"),
                                                                       os.environ.get("SSL_CERT_DIR")))


@functools.lru_cache(maxsize=1)
def _ssl_context(_cert_file: str | None, _cert_dir: str | None) -> ssl.SSLContext:
    """The SSL context of every pool, built once for the environment's
    ``SSL_CERT_FILE``/``SSL_CERT_DIR`` (read as httpx reads them; the
    arguments key the cache). Why shared: a transport left to build its own
    loads the CA bundle again, which doubled the proxy's start-up time and
    memory once each server had a probe pool (200 servers: 4.4 -> 8.3 s,
    +166 -> +328 MiB)."""
    return httpx.create_ssl_context(trust_env=True)


def unsent(exc: httpx.HTTPError) -> bool:
    """Whether the request surely never reached the server (so another may take it)."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))


def describe(exc: BaseException, timeout_s: float, option: str = "--timeout-s") -> str:
    """What went wrong, in words (httpx's timeouts have an empty message)."""
    if isinstance(exc, httpx.PoolTimeout):
        return "proxy saturated (no free connection; raise --max-connections)"
    if isinstance(exc, httpx.ConnectTimeout):
        return f"unreachable (no connection within {CONNECT_TIMEOUT_S:g} s)"
    if isinstance(exc, httpx.ConnectError):
        return f"unreachable ({exc or type(exc).__name__})"
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return f"no answer within {option} {timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
