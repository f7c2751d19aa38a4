"""HTTP webhook sink: a batch's POSTs run concurrently, per-key order kept, with retries
(docs/sinks.md, "HTTP webhook"). No request of a batch may still be in flight once `publish`
returns or raises: the relay's re-send would overtake it."""

from __future__ import annotations

import contextlib
import http.client
import re
import select
import ssl
import threading
import time
from base64 import b64encode
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from urllib.parse import quote, unquote, urlsplit, urlunsplit
from urllib.request import getproxies, proxy_bypass

from outbox_migrate.backoff import backoff_s
from outbox_migrate.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.options import Ordering
from outbox_migrate.relay.sinks import (
    NotSent,
    SinkConfig,
    check_options,
    int_option,
    prepare,
    size_over,
    too_large,
)
from outbox_migrate.relay.sinks.envelopes import (
    CloudEvents,
    Envelope,
    content_type,
    envelope_option,
    require_text,
)
from outbox_migrate.relay.sinks.isolation import isolate
from outbox_migrate.relay.sinks.urls import mask_url, require_scheme

RETRYABLE_STATUS = frozenset({408, 429})
CONTENT_STATUS = frozenset({400, 413, 422})
"""Refusals of a batch array that may be about one element of it (or its size): isolated."""
DEFAULT_RETRIES = 3
DEFAULT_CONCURRENCY = 16
RETRY_BASE_S = 0.1
STALE_CHECK_S = 1.0
"""A connection idle this long is checked for a close by the webhook before it is reused."""
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP header name (RFC 9110 `token`)."""
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in '%"')


def header_value(value: str) -> str:
    """A header value HTTP can carry: printable ASCII as is, anything else percent-encoded."""
    if value.isascii() and value.isprintable() and "%" not in value:
        return value
    return quote(value, safe=_HEADER_SAFE)


def request_headers(message: Message, envelope: Envelope, ce: CloudEvents) -> dict[str, str]:
    """The headers of one message's POST (docs/sinks.md, "Metadata")."""
    out = {
        "Content-Type": "application/json" if envelope is Envelope.json else content_type(message),
        "Idempotency-Key": str(message.id),
        "X-Outbox-Id": str(message.id),
        "X-Event-Type": header_value(message.event_type or ""),
    }
    if envelope is Envelope.cloudevents:
        more = ce.binary_headers(message, "ce-", content_type=False)
    else:
        more = message.headers()
    taken = {name.lower() for name in out}
    for name, value in more.items():
        if name.lower() not in taken:
            out[name] = header_value(value)
    return out


def bad_header_name(headers: Mapping[str, str]) -> str | None:
    """Why these headers cannot be sent, or None: a name that is not an HTTP token (a space,
    a colon, a non-ASCII letter — from a row's own headers or metadata columns). http.client
    refuses it before sending, which the sink must not take for an outage (it would never pass)."""
    for name in headers:
        if not _TOKEN.fullmatch(name):
            return f"http header name {name[:60]!r} is not an HTTP token; not sent"
    return None


def posting_groups(batch: Sequence[Message], ordering: Ordering | None) -> list[list[Message]]:
    """Split a batch into groups that may be posted concurrently; each keeps batch order."""
    if ordering is None or ordering is Ordering.global_:
        return [list(batch)] if batch else []
    groups: dict[tuple[str, object], list[Message]] = {}
    for message in batch:
        if message.key is not None:
            group: tuple[str, object] = ("key", message.key)
        elif ordering is Ordering.none:
            group = ("id", message.id)
        else:
            # The relay shards NULL keys together under `key` ordering: keep them in order.
            group = ("no key", None)
        groups.setdefault(group, []).append(message)
    return list(groups.values())


def _bool_option(extra: Mapping[str, str], name: str) -> bool:
    raw = extra.get(name, "").strip().lower()
    if raw not in _TRUE | _FALSE:
        raise RelayError(f"http sink: {name} must be true or false, got {extra[name]!r}")
    return raw in _TRUE


class _Lanes:
    """One batch's shared state: the groups still to post, what was refused, the stop signal."""

    def __init__(self, groups: list[list[Message]], deadline: float) -> None:
        self._groups: Iterator[list[Message]] = iter(groups)
        self._lock = threading.Lock()
        self.deadline = deadline
        """When the publish must have ended (monotonic)."""
        self.rejected: dict[MessageId, str] = {}
        self.acked: list[MessageId] = []
        """Answered with a 2xx."""
        self.stop = threading.Event()
        """Set when one message made the batch hopeless: lanes start nothing new."""

    def next_group(self) -> list[Message] | None:
        with self._lock:
            return next(self._groups, None)

    def reject(self, outbox_id: MessageId, reason: str) -> None:
        with self._lock:
            self.rejected[outbox_id] = reason

    def ack(self, outbox_id: MessageId) -> None:
        with self._lock:
            self.acked.append(outbox_id)


class Endpoint:
    """Where the POSTs go, parsed once: host, port, request target, TLS, proxy, credentials."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise RelayError(f"http sink: {mask_url(url)!r} has no valid port") from None
        self.https = parts.scheme.lower() == "https"
        self.host = parts.hostname or ""
        self.port = port or (443 if self.https else 80)
        self.target = urlunsplit(("", "", parts.path or "/", parts.query, ""))
        self.headers: dict[str, str] = {}
        """Set on every request, replacing a message's header of the same name."""
        if parts.username is not None or parts.password is not None:
            self.headers["Authorization"] = basic_auth(parts.username, parts.password)
        self.context = ssl.create_default_context() if self.https else None
        if self.context is not None:  # and certifi's CA bundle: a slim container may have none
            with contextlib.suppress(ImportError):
                import certifi

                self.context.load_verify_locations(cafile=certifi.where())
        self.proxy: tuple[str, int] | None = None
        self.proxy_headers: dict[str, str] = {}
        proxies = getproxies()  # from the environment; `no_proxy` is `proxy_bypass`
        proxy = proxies.get(parts.scheme.lower()) or proxies.get("all")
        if proxy and not proxy_bypass(self.host):
            pparts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            if pparts.scheme.lower() != "http" or not pparts.hostname:
                raise RelayError(
                    f"http sink: proxy {mask_url(proxy)!r} from the environment is not an "
                    "http:// proxy"
                )
            self.proxy = (pparts.hostname, pparts.port or 80)
            if pparts.username is not None or pparts.password is not None:
                credentials = basic_auth(pparts.username, pparts.password)
                self.proxy_headers["Proxy-Authorization"] = credentials
            if not self.https:  # absolute-form through the proxy; https goes through a tunnel
                host = f"[{self.host}]" if ":" in self.host else self.host
                netloc = host if port is None else f"{host}:{port}"
                self.target = urlunsplit(("http", netloc, parts.path or "/", parts.query, ""))
                self.headers.update(self.proxy_headers)

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """A new connection (it connects on its first request)."""
        host, port = self.proxy or (self.host, self.port)
        if self.https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout_s, context=self.context
            )
            if self.proxy:
                conn.set_tunnel(self.host, self.port, headers=self.proxy_headers)
            return conn
        return http.client.HTTPConnection(host, port, timeout=timeout_s)


def basic_auth(username: str | None, password: str | None) -> str:
    """`Authorization: Basic` from a URL's (percent-encoded) user and password."""
    pair = f"{unquote(username or '')}:{unquote(password or '')}"
    return "Basic " + b64encode(pair.encode()).decode("ascii")


class _Lane(threading.local):
    """One lane thread's keep-alive connection and when it last answered (monotonic)."""

    conn: http.client.HTTPConnection | None = None
    used = 0.0


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection has something to read: the webhook closed it (EOF) or sent
    what nobody asked for; either way it cannot carry the next request."""
    sock = conn.sock
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


_TRANSPORT_ERRORS = (OSError, http.client.HTTPException)
"""What a failed exchange raises: socket errors and timeouts, TLS errors (OSError), a closed
or garbled response (HTTPException)."""


class HttpSink:
    name = "http"

    def __init__(self, config: SinkConfig) -> None:
        if not config.url:
            raise RelayError("the http sink needs --sink-url (the webhook address)")
        check_options(self.name, config.extra, ("retries", "concurrency", "batch"))
        self.url = require_scheme(self.name, config.url, ("http", "https")) or config.url
        self.endpoint = Endpoint(self.url)
        self.envelope = envelope_option(config.extra, self.name, Envelope.json)
        self.cloudevents = CloudEvents(config.extra)
        self.timeout_s = config.timeout_s
        self.ordering = config.ordering
        extra = config.extra
        self.retries = int_option(extra, self.name, "retries", DEFAULT_RETRIES, 0)
        self.concurrency = int_option(extra, self.name, "concurrency", DEFAULT_CONCURRENCY, 1)
        self.batch_mode = _bool_option(extra, "batch")
        self.config = config
        self.limit = config.max_message_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._lane_state = _Lane()
        self._connections: list[http.client.HTTPConnection] = []
        self._connections_lock = threading.Lock()

    def _connection(self, now: float) -> http.client.HTTPConnection:
        """This thread's connection: one keep-alive connection per lane, none shared."""
        lane = self._lane_state
        conn = lane.conn
        if conn is None:
            conn = lane.conn = self.endpoint.connection(self.timeout_s)
            with self._connections_lock:
                self._connections.append(conn)
        elif now - lane.used > STALE_CHECK_S and _closed_by_peer(conn):
            conn.close()  # reconnects on the next request
        return conn

    def _exchange(self, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
        """One POST on this lane's connection: the response's status (its body is read and
        dropped, so the connection can carry the next request)."""
        now = time.monotonic()
        conn = self._connection(now)
        if conn.sock is None:
            conn.timeout = timeout_s
        else:
            conn.sock.settimeout(timeout_s)
        try:
            conn.request("POST", self.endpoint.target, body, headers)
            response = conn.getresponse()
            response.read()
        except BaseException:
            conn.close()  # a half-done exchange: the next request starts on a new connection
            raise
        self._lane_state.used = time.monotonic()
        return response.status

    def _post(
        self, body: str | bytes, headers: dict[str, str], stop: threading.Event, deadline: float
    ) -> int | None:
        """POST with retries, all before `deadline`: the final status, None when the batch
        stopped meanwhile, or SinkUnavailable when the retries or the time are exhausted."""
        payload = body.encode() if isinstance(body, str) else body
        if self.endpoint.headers:  # credentials win over a row's header of the same name
            names = {name.lower() for name in self.endpoint.headers}
            for name in [name for name in headers if name.lower() in names]:
                del headers[name]
            headers.update(self.endpoint.headers)
        reason = ""
        attempts = 0
        for attempt in range(self.retries + 1):
            if attempt:
                pause = backoff_s(attempt - 1, base_s=RETRY_BASE_S)
                if time.monotonic() + pause >= deadline:
                    break  # no time for another attempt
                if stop.wait(pause):
                    return None
            left = deadline - time.monotonic()
            if left <= 0:
                break
            attempts += 1
            try:
                status = self._exchange(payload, headers, min(self.timeout_s, left))
            except _TRANSPORT_ERRORS as exc:
                reason = f"{type(exc).__name__}: {exc}"
                continue
            if status < 300:
                return status
            if status >= 500 or status in RETRYABLE_STATUS:
                reason = f"HTTP {status}"
                continue
            return status
        if attempts <= self.retries:  # stopped by the clock, not by the retry count
            spent = f"the publish's {self.timeout_s:g} s (--sink-timeout) are spent"
            reason = f"{reason}; {spent}" if reason else spent
        raise SinkUnavailable(self.name, mask_url(f"{reason} after {attempts} attempts"))

    def _lane(self, lanes: _Lanes) -> None:
        """Post whole groups, one message after the other, until none is left or one fails."""
        try:
            while not lanes.stop.is_set() and (group := lanes.next_group()) is not None:
                for message in group:
                    if lanes.stop.is_set():
                        return
                    try:
                        body = self._body(message)
                    except NotSent as exc:
                        lanes.reject(message.id, str(exc))
                        continue
                    headers = request_headers(message, self.envelope, self.cloudevents)
                    bad = bad_header_name(headers)
                    if bad is not None:
                        lanes.reject(message.id, bad)
                        continue
                    status = self._post(body, headers, lanes.stop, lanes.deadline)
                    if status is None:
                        return
                    if status >= 300:
                        lanes.reject(message.id, f"HTTP {status}")
                    else:
                        lanes.ack(message.id)
        except BaseException:
            lanes.stop.set()
            raise

    def _body(self, message: Message, *, structured: bool = False) -> str | bytes:
        """The body of one message's POST (`structured`: its element of a batch array), or
        `NotSent`: refused without a request."""
        if structured and self.envelope is Envelope.cloudevents:
            require_text(message, self.name)
            body: str | bytes = self.cloudevents.structured(message)
        elif structured or self.envelope is Envelope.json:
            require_text(message, self.name)
            body = message.envelope()
        else:
            body = message.payload  # text or bytes; text is sent as UTF-8
        limit = self.limit
        if limit is not None and (size := size_over(body, limit)) is not None:
            raise NotSent(too_large(size, limit, self.config, "http"))
        return body

    def _element(self, message: Message) -> str:
        element = self._body(message, structured=True)
        assert isinstance(element, str)  # structured: JSON text
        return element

    def _publish_each(self, batch: Sequence[Message]) -> dict[MessageId, str]:
        groups = posting_groups(batch, self.ordering)
        # At most `timeout_s` in all, retries included: the polling relay's session ends at its
        # idle-in-transaction timeout (sink timeout + 2 s), and the batch would be sent again.
        lanes = _Lanes(groups, time.monotonic() + self.timeout_s)
        try:
            self._run_lanes(lanes, min(self.concurrency, len(groups)))
        except SinkUnavailable as exc:  # what was answered with a 2xx is still acknowledged
            raise SinkUnavailable(self.name, exc.reason, lanes.acked) from None
        return lanes.rejected

    def _run_lanes(self, lanes: _Lanes, count: int) -> None:
        if count <= 1:
            self._lane(lanes)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="outbox-http")
        futures = [self._pool.submit(self._lane, lanes) for _ in range(count)]
        wait(futures)  # every lane: no request of this batch outlives publish
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            raise next((e for e in errors if isinstance(e, SinkUnavailable)), errors[0])

    def _publish_batch(self, batch: Sequence[Message]) -> dict[MessageId, str]:
        deadline = time.monotonic() + self.timeout_s
        refused, ready = prepare(batch, self._element)
        elements = {message.id: element for message, element in ready}
        sent = [message for message, _ in ready]
        status = self._post_array(sent, elements, deadline)
        if status is None:
            return refused
        if status in CONTENT_STATUS and len(sent) > 1:

            def send_group(group: Sequence[Message]) -> dict[MessageId, str]:
                again = self._post_array(group, elements, deadline)
                if again is None:
                    return {}
                return {message.id: f"HTTP {again}" for message in group}

            refused.update(isolate(sent, send_group, deadline, self.name))
        else:
            refused.update({message.id: f"HTTP {status}" for message in sent})
        return refused

    def _post_array(
        self, group: Sequence[Message], elements: Mapping[MessageId, str], deadline: float
    ) -> int | None:
        """POST `group` as one array: None when it was accepted, else the refusing status."""
        if not group:
            return None
        if self.envelope is Envelope.cloudevents:
            mime = "application/cloudevents-batch+json; charset=utf-8"
        else:
            mime = "application/json"
        headers = {"Content-Type": mime, "X-Outbox-Count": str(len(group))}
        body = "[" + ",".join(elements[message.id] for message in group) + "]"
        status = self._post(body, headers, threading.Event(), deadline)
        return status if status is not None and status >= 300 else None

    def publish(self, batch: Sequence[Message]) -> None:
        publish = self._publish_batch if self.batch_mode else self._publish_each
        rejected = publish(batch)
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._connections_lock:
            connections, self._connections = self._connections, []
        self._lane_state = _Lane()
        for conn in connections:
            conn.close()
