"""`engine.cluster.etcd` against a real etcd (the `etcd` fixture): keys, transactions, leases, watches,
and the two failures — etcd unreachable and etcd answering an error; and an etcd requiring a user and
password (`etcd_with_users`), plain and behind client certificates: the members' user reads and writes
its prefix and nothing else, a client without a user or with a wrong password is refused, a restarted
etcd (which forgets every token) answers once the client authenticates again. No mocks."""

from __future__ import annotations

import re
import socket
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cluster.certificates import make_certificate
from engine.cluster.etcd import (
    Etcd,
    EtcdError,
    EtcdTls,
    EtcdUnavailable,
    KeyValue,
    WatchEvent,
    keepalive_blocking,
)
from engine.cluster.local_etcd import LocalEtcd, LocalEtcdError, start_local_etcd
from tests.cluster.conftest import etcd_with_users
from tests.waiting import deadline, wait_until


def _closed_port_url() -> str:
    """The URL of a port nothing listens on (it was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def _watched(
    client: Etcd, prefix: str, start_revision: int, into: trio.MemorySendChannel[WatchEvent]
) -> None:
    """Send what a watch of `prefix` sees into `into`, until cancelled."""
    async with aclosing(client.watch_prefix(prefix, start_revision=start_revision)) as events:
        async for event in events:
            await into.send(event)


async def test_put_get_and_get_prefix_sorted_by_key(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        for key in ("svc/b", "svc/a/2", "svd", "sv", "svc/a/1", "svc/c"):
            await client.put(key, key.encode())
        last = await client.put("svc/a/0", b"")
        assert await client.get("svc/missing") is None
        found = await client.get("svc/b")
        assert found is not None
        assert (found.key, found.value, found.lease) == ("svc/b", b"svc/b", 0)
        assert found.create_revision == found.mod_revision < last
        kvs, revision = await client.get_prefix("svc/")
        assert [kv.key for kv in kvs] == ["svc/a/0", "svc/a/1", "svc/a/2", "svc/b", "svc/c"]
        assert kvs[0] == KeyValue("svc/a/0", b"", last, last, 0)
        assert revision == last
        assert await client.get_prefix("nothing/") == ([], last)
        assert await client.delete("svc/b") == 1
        assert await client.delete("svc/b") == 0
        assert await client.get("svc/b") is None


async def test_create_succeeds_only_for_a_key_that_does_not_exist(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        assert await client.create("leader", b"one") is True
        assert await client.create("leader", b"two") is False
        found = await client.get("leader")
        assert found is not None and found.value == b"one"
        await client.delete("leader")
        assert await client.create("leader", b"three") is True


async def test_a_lease_is_kept_alive_until_revoked_and_takes_its_keys_along(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        lease = await client.grant(30)
        assert lease.id > 0 and lease.ttl == 30
        assert await client.create("nodes/a", b"a", lease=lease.id) is True
        await client.put("nodes/b", b"b", lease=lease.id)
        found = await client.get("nodes/a")
        assert found is not None and found.lease == lease.id
        assert await client.keepalive_once(lease.id) == 30
        await client.revoke(lease.id)
        assert await client.keepalive_once(lease.id) == 0
        assert (await client.get_prefix("nodes/"))[0] == []
        await client.revoke(lease.id)  # already gone: not an error


async def test_a_key_under_a_lease_that_is_not_kept_alive_expires(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        lease = await client.grant(1)
        await client.put("nodes/short", b"x", lease=lease.id)

        async def gone() -> bool:
            return await client.get("nodes/short") is None

        await wait_until(gone, "the key under a 1 s lease to expire", 30)
        assert await client.keepalive_once(lease.id) == 0


async def test_watch_prefix_sees_puts_and_deletes_in_order(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        await client.put("nodes/old", b"before")
        _, revision = await client.get_prefix("nodes/")
        send, receive = trio.open_memory_channel[WatchEvent](100)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watched, client, "nodes/", revision + 1, send)
            lease = await client.grant(30)
            first = await client.put("nodes/a", b"1")
            second = await client.put("nodes/b", b"2", lease=lease.id)
            await client.put("elsewhere", b"not watched")
            third = await client.put("nodes/a", b"3")
            await client.revoke(lease.id)
            deleted = await client.delete("nodes/a")
            events: list[WatchEvent] = []
            with deadline("the watch to deliver 5 events", 30, detail=lambda: events):
                for _ in range(5):
                    events.append(await receive.receive())
            nursery.cancel_scope.cancel()
        assert deleted == 1
        assert events == [
            WatchEvent("put", "nodes/a", b"1", first, 0),
            WatchEvent("put", "nodes/b", b"2", second, lease.id),
            WatchEvent("put", "nodes/a", b"3", third, 0),
            WatchEvent("delete", "nodes/b", b"", third + 1, 0),  # the lease's revocation
            WatchEvent("delete", "nodes/a", b"", third + 2, 0),
        ]


async def test_a_watch_from_a_compacted_revision_is_an_etcd_error(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        await client.put("nodes/a", b"1")
        revision = await client.put("nodes/a", b"2")
        async with httpx.AsyncClient(base_url=etcd.url, trust_env=False) as raw:
            answer = await raw.post("/v3/kv/compaction", json={"revision": revision})
            assert answer.status_code == 200, answer.text
        with deadline("the compacted watch to fail", 30), pytest.raises(EtcdError) as raised:
            async with aclosing(client.watch_prefix("nodes/", start_revision=1)) as events:
                async for event in events:
                    pytest.fail(f"a compacted watch delivered {event}")
        assert str(raised.value) == (
            f"etcd watch failed: watch on prefix 'nodes/' ended: revision 1 is compacted (up to {revision})"
        )


async def test_a_watch_whose_etcd_stops_raises_etcd_unavailable(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        revision = await client.put("nodes/a", b"1")
        with deadline("the watch to break", 30), pytest.raises(EtcdUnavailable) as raised:
            async with aclosing(client.watch_prefix("nodes/", start_revision=revision)) as events:
                async for event in events:
                    assert event.key == "nodes/a"
                    await etcd.stop()
        assert str(raised.value).startswith(f"etcd at {etcd.url} is unreachable: ")


async def test_version_names_the_etcd_server_release(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        assert re.fullmatch(r"3\.[45]\.\d+", await client.version())


async def test_a_closed_port_is_etcd_unavailable_naming_the_url() -> None:
    url = _closed_port_url()
    prefix = f"etcd at {url} is unreachable: ConnectError: "
    async with Etcd(url) as client:
        with pytest.raises(EtcdUnavailable, match=f"^{re.escape(prefix)}"):
            await client.get("anything")
        with pytest.raises(EtcdUnavailable, match=f"^{re.escape(prefix)}"):
            await client.version()
    with pytest.raises(EtcdUnavailable, match=f"^{re.escape(prefix)}"):
        keepalive_blocking(url, 1, timeout=5.0)


async def test_a_paused_etcd_is_unavailable_until_resumed(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url, timeout=0.5) as client:
        await client.put("k", b"v")
        etcd.pause()
        try:
            with pytest.raises(
                EtcdUnavailable, match=f"^{re.escape(f'etcd at {etcd.url} is unreachable: ')}"
            ):
                await client.get("k")
        finally:
            etcd.resume()
    async with Etcd(etcd.url) as client:
        found = await client.get("k")
        assert found is not None and found.value == b"v"


async def test_etcd_answering_an_error_is_an_etcd_error(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        with pytest.raises(EtcdError) as raised:
            await client.put("k", b"v", lease=12345)
    assert str(raised.value) == "etcd kv/put failed: etcdserver: requested lease not found (code 5)"
    assert (raised.value.call, raised.value.code) == ("kv/put", 5)


async def test_keepalive_blocking_in_a_worker_thread_returns_the_ttl(etcd: LocalEtcd) -> None:
    async with Etcd(etcd.url) as client:
        lease = await client.grant(20)
        ttl = await trio.to_thread.run_sync(lambda: keepalive_blocking(etcd.url, lease.id, timeout=5.0))
        assert ttl == 20
        await client.revoke(lease.id)
        assert await trio.to_thread.run_sync(lambda: keepalive_blocking(etcd.url, lease.id, timeout=5.0)) == 0


async def test_any_key_and_value_round_trip(etcd: LocalEtcd) -> None:
    """A property: printable text keys and arbitrary byte values come back as put. Hypothesis runs in a
    worker thread and calls into this trio run for each example (one etcd for all of them)."""
    async with Etcd(etcd.url) as client:

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(
            key=st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp"))),
            value=st.binary(max_size=2048),
        )
        def round_trip(key: str, value: bytes) -> None:
            revision = trio.from_thread.run(client.put, f"prop/{key}", value)
            found = trio.from_thread.run(client.get, f"prop/{key}")
            assert found == KeyValue(f"prop/{key}", value, found.create_revision if found else 0, revision, 0)
            kvs, _ = trio.from_thread.run(client.get_prefix, f"prop/{key}")
            assert kvs[0] == found

        with deadline("60 round-trip examples", 60):
            await trio.to_thread.run_sync(round_trip, abandon_on_cancel=True)


async def test_an_etcd_that_cannot_start_names_its_binary(tmp_path: Path) -> None:
    with pytest.raises(LocalEtcdError, match=r"^etcd \(/bin/false\) exited with code 1 before it was ready"):
        await start_local_etcd(str(tmp_path), binary="/bin/false")


PREFIX = "/zigzag/auth-test/"
DENIED = "etcdserver: permission denied"


async def _refused(etcd: Etcd) -> EtcdError:
    with pytest.raises(EtcdError) as info:
        await etcd.get(PREFIX + "key")
    return info.value


@pytest.mark.parametrize("tls", [False, True], ids=["http", "client certificates"])
async def test_only_the_users_etcd_knows_read_and_only_what_their_role_allows(
    tmp_path: Path, tls: bool
) -> None:
    async with etcd_with_users(tmp_path, PREFIX, tls=tls) as (local, ca):
        auth, client_tls = local.auth, local.client_tls
        assert auth is not None
        async with Etcd(local.url, tls=client_tls, username=auth.user, password=auth.password) as member:
            await member.put(PREFIX + "key", b"value")
            stored = await member.get(PREFIX + "key")
            assert stored is not None and stored.value == b"value"
            with pytest.raises(EtcdError) as outside:
                await member.put("/zigzag/another-cluster/key", b"value")
            assert (outside.value.call, outside.value.message) == ("kv/put", DENIED)

            async with local.operator() as operator:  # root reads what the member wrote
                stored = await operator.get(PREFIX + "key")
                assert stored is not None and stored.value == b"value"

            async with Etcd(local.url, tls=client_tls) as anonymous:
                refused = await _refused(anonymous)
            assert (refused.call, refused.message) == ("kv/range", "etcdserver: user name is empty")
            async with Etcd(
                local.url, tls=client_tls, username=auth.user, password=auth.password + "x"
            ) as wrong:
                refused = await _refused(wrong)
            assert (refused.call, refused.message) == (
                "auth/authenticate",
                "etcdserver: authentication failed, invalid user ID or password",
            )
            if ca is not None:
                # A certificate of the CA with a commonName is refused by etcd's gateway once users are
                # required (it cannot pass the name on): clients of such an etcd need one without.
                made = make_certificate(tmp_path / "named", ca, "named")
                named = EtcdTls(str(made.ca_file), str(made.cert_file), str(made.key_file))
                async with Etcd(local.url, tls=named, username=auth.user, password=auth.password) as holder:
                    refused = await _refused(holder)
                assert refused.message.startswith("HTTP 400: CommonName of client"), refused

            # etcd keeps its tokens in memory: restarted, it refuses the member's token, and the member
            # authenticates again and is answered.
            token = await member.auth_token()
            await local.restart()
            stored = await member.get(PREFIX + "key")
            assert stored is not None and stored.value == b"value"
            assert await member.auth_token() != token
