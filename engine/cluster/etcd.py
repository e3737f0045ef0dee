"""An etcd v3 client for Trio over etcd's JSON gateway (HTTP `/v3/...`, keys and values in base64).

Works with the etcd 3.4 and 3.5 gateways: int64 fields arrive as JSON strings (numbers are accepted
too), zero or empty fields are left out (typed structs default them). Keys are `str` (UTF-8; other
bytes round-trip as surrogate escapes), values `bytes`. `EtcdUnavailable`: etcd cannot be reached
(connect, read or write errors, a timeout, a broken stream, etcd saying it is unavailable);
`EtcdError`: etcd answered with an error. Authentication (`username`/`password` → a token from
`/v3/auth/authenticate`, sent as the `Authorization` header, renewed once when etcd calls it
invalid) and TLS (`EtcdTls`) are supported; proxy settings from the environment are ignored.

Cancellation: every call is one HTTP request; cancelling it abandons the request. A cancelled write
(`put`, `create`, `delete`, `grant`, `revoke`) may or may not have been applied by etcd.
"""

from __future__ import annotations

import base64
import ssl
from collections.abc import AsyncGenerator
from typing import Any, Literal, TypeVar, final

import httpx
import msgspec
import trio

T = TypeVar("T")

_NOT_FOUND = 5  # gRPC status codes, as the gateway reports them
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16


@final
class EtcdUnavailable(Exception):
    """etcd cannot be reached; the message names the URL and the reason."""


@final
class EtcdError(Exception):
    """etcd answered a call with an error: `call` (e.g. "kv/put"), etcd's `message` and its gRPC `code`
    (0 when the answer had none)."""

    def __init__(self, call: str, message: str, code: int = 0) -> None:
        super().__init__(f"etcd {call} failed: {message}" + (f" (code {code})" if code else ""))
        self.call = call
        self.message = message
        self.code = code


@final
class EtcdTls(msgspec.Struct, frozen=True):
    """TLS to etcd: `ca_file` verifies the server (the system's CAs when None); `cert_file` and
    `key_file` are a client certificate and its key (the key may be inside `cert_file`)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


@final
class KeyValue(msgspec.Struct, frozen=True):
    """A key as etcd stores it; `lease` is 0 when the key has none."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@final
class Lease(msgspec.Struct, frozen=True):
    """A granted lease: its id and the TTL etcd granted, in seconds."""

    id: int
    ttl: int


@final
class WatchEvent(msgspec.Struct, frozen=True):
    """A change under a watched prefix. A delete carries an empty value and lease 0."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    lease: int


# The gateway's replies. Every field defaults: the gateway leaves out zeros and empties.
class _Header(msgspec.Struct):
    revision: int = 0


class _Kv(msgspec.Struct):
    key: bytes = b""
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    lease: int = 0


class _Event(msgspec.Struct):
    type: str | int = "PUT"
    kv: _Kv = msgspec.field(default_factory=_Kv)


class _Reply(msgspec.Struct):  # every reply's fields: kv/*, lease/*, auth, an error, a watch response
    header: _Header = msgspec.field(default_factory=_Header)
    kvs: list[_Kv] = []
    deleted: int = 0
    succeeded: bool = False
    token: str = ""
    id: int = msgspec.field(name="ID", default=0)
    ttl: int = msgspec.field(name="TTL", default=0)
    error: Any = None  # a string (an error reply, lease/grant's error) or an object (a stream's error)
    message: str = ""
    code: int = 0
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[_Event] = []


class _Line(_Reply):  # a line of a streamed reply (lease/keepalive, watch); an error is {"error": {...}}
    result: _Reply = msgspec.field(default_factory=_Reply)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _key64(key: str) -> str:
    return _b64(key.encode("utf-8", "surrogateescape"))


def _key_str(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def prefix_range(prefix: str) -> dict[str, Any]:
    """Every key starting with `prefix`: up to the prefix with its last byte below 0xff incremented."""
    key = prefix.encode("utf-8", "surrogateescape")
    end = b"\x00"
    for index in range(len(key) - 1, -1, -1):
        if key[index] < 0xFF:
            end = key[:index] + bytes([key[index] + 1])
            break
    return {"key": _b64(key or b"\x00"), "range_end": _b64(end)}


def _put_body(key: str, value: bytes, lease: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _key64(key), "value": _b64(value)}
    return body | {"lease": lease} if lease else body


def _watch_event(event: _Event) -> WatchEvent:
    kv = event.kv
    if event.type in ("DELETE", 1):
        return WatchEvent("delete", _key_str(kv.key), b"", kv.mod_revision, 0)
    return WatchEvent("put", _key_str(kv.key), kv.value, kv.mod_revision, kv.lease)


def _watch_line(url: str, prefix: str, start_revision: int, line: str) -> list[WatchEvent]:
    """The events of one line of a watch stream; raises when etcd ended the watch."""
    message = _decode("watch", line, _Line)
    if message.error is not None:
        raise _failure(url, "watch", message, "error")
    result, ended = message.result, f"watch on prefix {prefix!r} ended"
    if result.compact_revision:
        compacted = f"revision {start_revision} is compacted (up to {result.compact_revision})"
        raise EtcdError("watch", f"{ended}: {compacted}")
    if result.canceled:
        raise EtcdError("watch", f"{ended}: {result.cancel_reason or 'etcd cancelled it'}")
    return [_watch_event(event) for event in result.events]


def _key_value(kv: _Kv) -> KeyValue:
    return KeyValue(_key_str(kv.key), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


def _decode(call: str, content: bytes | str, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(content, type=kind, strict=False)
    except msgspec.DecodeError as error:
        raise EtcdError(call, f"malformed reply ({error}): {str(content)[:200]}") from None


def _unreachable(url: str, reason: BaseException | str) -> EtcdUnavailable:
    if isinstance(reason, BaseException):
        reason = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
    return EtcdUnavailable(f"etcd at {url} is unreachable: {reason}")


def _failure(url: str, call: str, failure: _Reply, status: str) -> EtcdUnavailable | EtcdError:
    """The exception for an error reply: `failure.error` is a string (unary) or an object (stream)."""
    message, code = failure.message, failure.code
    if isinstance(failure.error, dict):
        message = str(failure.error.get("message", "")) or message
        code = int(failure.error.get("grpc_code", 0) or failure.error.get("code", 0) or code)
    elif isinstance(failure.error, str) and not message:
        message = failure.error
    if code == _UNAVAILABLE:
        return _unreachable(url, message or status)
    return EtcdError(call, message or status, code)


def _answer(url: str, call: str, response: httpx.Response, kind: type[T]) -> T:
    if response.status_code != 200:
        status = f"HTTP {response.status_code}: {response.text.strip()[:200]}"
        try:  # etcd's gateway answers errors in JSON; in front of it, etcd answers some in plain text
            failure = msgspec.json.decode(response.content or b"{}", type=_Reply, strict=False)
        except msgspec.DecodeError:
            raise EtcdError(call, status) from None
        raise _failure(url, call, failure, status)
    return _decode(call, response.content, kind)


def _remaining_ttl(url: str, kept: _Line) -> int:
    if kept.error is not None:
        raise _failure(url, "lease/keepalive", kept, "error")
    return max(kept.result.ttl, 0)


def _verify(tls: EtcdTls | None) -> ssl.SSLContext | bool:
    return True if tls is None else ssl_context(tls)


def ssl_context(tls: EtcdTls) -> ssl.SSLContext:
    """The client's TLS context for `tls`: the server verified by `ca_file` (the system's CAs when
    None), `cert_file` presented when given."""
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


def _headers(token: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json"} | ({"Authorization": token} if token else {})


@final
class Etcd:
    """A client of the etcd at `url` (e.g. "http://127.0.0.1:2379"); `timeout` bounds each call (the
    connect, each read and write) but not a watch's wait for its next event. `tls` is kept as given
    (for `keepalive_blocking`). Close it with `aclose`, or use it as `async with Etcd(url) as etcd:`."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        tls: EtcdTls | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.tls = tls
        self._timeout = timeout
        self._client = httpx.AsyncClient(
            base_url=self.url, timeout=timeout, verify=_verify(tls), trust_env=False
        )
        self._credentials = (username, password or "") if username is not None else None
        self._token: str | None = None
        self._auth_lock = trio.Lock()

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections. Cancelling it may leave a connection to be closed by the collector."""
        await self._client.aclose()

    async def auth_token(self) -> str | None:
        """The token sent to etcd (authenticating first when there is none yet); None without a
        username. For `keepalive_blocking`'s `token`."""
        if self._credentials is None:
            return None
        async with self._auth_lock:
            if self._token is None:
                body = dict(zip(("name", "password"), self._credentials))
                self._token = (await self._send("auth/authenticate", body, _Reply, None)).token
            return self._token

    async def _send(self, call: str, body: dict[str, Any], kind: type[T], token: str | None) -> T:
        try:
            response = await self._client.post(
                f"/v3/{call}", content=msgspec.json.encode(body), headers=_headers(token)
            )
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from error
        return _answer(self.url, call, response, kind)

    async def _call(self, call: str, body: dict[str, Any], kind: type[T]) -> T:
        token = await self.auth_token()
        try:
            return await self._send(call, body, kind, token)
        except EtcdError as error:
            if error.code != _UNAUTHENTICATED or token is None:
                raise
        async with self._auth_lock:  # the token expired: authenticate again, once
            if self._token == token:
                self._token = None
        return await self._send(call, body, kind, await self.auth_token())

    async def version(self) -> str:
        """The etcd server's version (GET /version), e.g. "3.5.1"."""
        try:
            response = await self._client.get("/version")
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from error
        return str(_answer(self.url, "version", response, dict[str, Any]).get("etcdserver", ""))

    async def grant(self, ttl: int) -> Lease:
        """A new lease of `ttl` seconds (etcd may grant a longer one: its minimum TTL)."""
        granted = await self._call("lease/grant", {"TTL": ttl}, _Reply)
        if granted.error:
            raise EtcdError("lease/grant", granted.error)
        return Lease(granted.id, granted.ttl)

    async def revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys; a lease that is already gone is not an error."""
        try:
            await self._call("lease/revoke", {"ID": lease_id}, _Reply)
        except EtcdError as error:
            if error.code != _NOT_FOUND and "lease not found" not in error.message:
                raise

    async def keepalive_once(self, lease_id: int) -> int:
        """Renew a lease once: its remaining TTL in seconds, 0 when it has expired or is unknown."""
        return _remaining_ttl(self.url, await self._call("lease/keepalive", {"ID": lease_id}, _Line))

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Set `key` to `value` (attached to `lease`, when given): the revision of the write."""
        return (await self._call("kv/put", _put_body(key, value, lease), _Reply)).header.revision

    async def get(self, key: str) -> KeyValue | None:
        """The key, or None when it does not exist."""
        found = await self._call("kv/range", {"key": _key64(key)}, _Reply)
        return _key_value(found.kvs[0]) if found.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, sorted by key, and the revision they were read at (watch from the
        next one to miss nothing)."""
        body = prefix_range(prefix) | {"sort_order": "ASCEND", "sort_target": "KEY"}
        found = await self._call("kv/range", body, _Reply)
        return [_key_value(kv) for kv in found.kvs], found.header.revision

    async def delete(self, key: str) -> int:
        """Delete `key`: the number of keys deleted (0 or 1)."""
        return (await self._call("kv/deleterange", {"key": _key64(key)}, _Reply)).deleted

    async def create(self, key: str, value: bytes, *, lease: int | None = None) -> bool:
        """Put `key` only when it does not exist (one transaction): True when this call created it."""
        put = _put_body(key, value, lease)
        compare = {"target": "CREATE", "result": "EQUAL", "key": put["key"], "create_revision": 0}
        body = {"compare": [compare], "success": [{"request_put": put}]}
        return (await self._call("kv/txn", body, _Reply)).succeeded

    async def watch_prefix(self, prefix: str, *, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        """The changes under `prefix` from `start_revision` on, in order, as they happen (one streaming
        `/v3/watch` request). Raises `EtcdUnavailable` when the stream breaks or ends and `EtcdError`
        when etcd cancels the watch (e.g. `start_revision` was compacted): the caller re-reads with
        `get_prefix` and watches again from the revision it read at.

        An async generator: close it (`contextlib.aclosing`) or cancel its consumer to end the stream.
        Waiting for the next event has no timeout: an etcd that stops answering without closing the
        connection is noticed by other means (a failing lease keepalive)."""
        request = {"create_request": prefix_range(prefix) | {"start_revision": start_revision}}
        token = await self.auth_token()
        timeout = httpx.Timeout(self._timeout, read=None)
        content = msgspec.json.encode(request)
        try:
            async with self._client.stream(
                "POST", "/v3/watch", content=content, headers=_headers(token), timeout=timeout
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    _answer(self.url, "watch", response, _Line)
                async for line in response.aiter_lines():
                    for event in _watch_line(self.url, prefix, start_revision, line) if line.strip() else []:
                        yield event
        except httpx.TransportError as error:
            raise _unreachable(self.url, error) from error
        raise _unreachable(self.url, "the watch stream ended")


def keepalive_blocking(
    url: str, lease_id: int, *, timeout: float, tls: EtcdTls | None = None, token: str | None = None
) -> int:
    """`Etcd.keepalive_once` for a worker thread (a synchronous request, bounded by `timeout`): the
    lease's remaining TTL, 0 when it has expired or is unknown. `token` is `Etcd.auth_token()`'s.
    Raises `EtcdUnavailable` or `EtcdError`. It blocks its thread and cannot be cancelled: a Trio caller
    in `trio.to_thread.run_sync` waits for it (at most about `timeout`) unless it passes
    `abandon_on_cancel=True`."""
    url = url.rstrip("/")
    body = msgspec.json.encode({"ID": lease_id})
    try:
        with httpx.Client(timeout=timeout, verify=_verify(tls), trust_env=False) as client:
            response = client.post(f"{url}/v3/lease/keepalive", content=body, headers=_headers(token))
    except httpx.TransportError as error:
        raise _unreachable(url, error) from error
    return _remaining_ttl(url, _answer(url, "lease/keepalive", response, _Line))
