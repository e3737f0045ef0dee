"""Opening authenticated links over real streams (transport.auth.streams): the secret, mutual TLS with
certificates made by `openssl`, and both; a wrong secret, a certificate of another CA, a name that is not
the node dialled, and bytes that are not the exchange are each refused with a reason."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.certs import make_ca, make_node_cert
from tests.waiting import deadline
from transport.auth.challenge import AuthFailed
from transport.auth.credentials import CredentialError, Credentials, load_secret, load_secrets
from transport.auth.streams import Admitted, admit_dialer, admit_listener

SECRET = b"0123456789abcdef0123456789abcdef"


async def _open(
    dialer: Credentials, listener: Credentials, *, expect: str | None = "dec"
) -> tuple[Admitted | Exception, Admitted | Exception]:
    left, right = trio.testing.memory_stream_pair()
    outcomes: list[Admitted | Exception] = [RuntimeError("not run"), RuntimeError("not run")]

    async def side(index: int, admit: object) -> None:
        try:
            outcomes[index] = await admit  # type: ignore[misc]
        except AuthFailed as exc:
            outcomes[index] = exc
            await (left, right)[index].aclose()

    with deadline("both sides of the exchange", 10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(side, 0, admit_dialer(left, dialer, purpose="peer", name="pre", expect=expect))
            nursery.start_soon(side, 1, admit_listener(right, listener, purpose="peer", name="dec"))
    return outcomes[0], outcomes[1]


async def test_one_secret_admits_both_ways_with_one_session_key() -> None:
    dialer, listener = await _open(Credentials(secret=SECRET), Credentials(secret=SECRET))
    assert isinstance(dialer, Admitted) and isinstance(listener, Admitted)
    assert (dialer.peer, listener.peer) == ("dec", "pre")
    assert dialer.key == listener.key is not None


async def test_a_wrong_secret_is_refused_on_both_sides() -> None:
    dialer, listener = await _open(Credentials(secret=SECRET), Credentials(secret=SECRET[::-1]))
    assert isinstance(dialer, AuthFailed) and "did not prove the cluster secret" in str(dialer)
    assert isinstance(listener, AuthFailed)


async def test_a_listener_that_is_not_the_node_dialled_is_refused() -> None:
    dialer, _ = await _open(Credentials(secret=SECRET), Credentials(secret=SECRET), expect="enc")
    assert isinstance(dialer, AuthFailed) and "dialled node 'enc', but 'dec' answered" in str(dialer)


async def test_a_dialer_that_sends_no_exchange_is_refused() -> None:
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(b"\x00\x00\x00\x10" + b"x" * 16)  # a peer frame where the hello belongs
    with deadline("the listener's refusal", 10), pytest.raises(AuthFailed):
        await admit_listener(right, Credentials(secret=SECRET), purpose="peer", name="dec")


async def test_mutual_tls_proves_the_certificate_names(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    pre, dec = make_node_cert(tmp_path, ca, "pre"), make_node_cert(tmp_path, ca, "dec")
    dialer, listener = await _open(Credentials(tls=pre), Credentials(tls=dec))
    assert isinstance(dialer, Admitted) and isinstance(listener, Admitted)
    assert (dialer.peer, listener.peer, dialer.key) == ("dec", "pre", None)
    both_d, both_l = await _open(Credentials(tls=pre, secret=SECRET), Credentials(tls=dec, secret=SECRET))
    assert isinstance(both_d, Admitted) and isinstance(both_l, Admitted) and both_d.key == both_l.key


async def test_a_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    ca, other = make_ca(tmp_path / "ca"), make_ca(tmp_path / "other", "another-ca")
    dec = make_node_cert(tmp_path, ca, "dec")
    intruder = make_node_cert(tmp_path / "other", other, "pre")
    dialer, listener = await _open(Credentials(tls=intruder), Credentials(tls=dec))
    assert isinstance(listener, AuthFailed) and "TLS handshake failed" in str(listener)
    assert isinstance(dialer, AuthFailed)


async def test_a_certificate_and_a_secret_that_name_different_nodes_are_refused(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    enc, dec = make_node_cert(tmp_path, ca, "enc"), make_node_cert(tmp_path, ca, "dec")
    _, listener = await _open(Credentials(tls=enc, secret=SECRET), Credentials(tls=dec, secret=SECRET))
    assert isinstance(listener, AuthFailed) and "the certificate names 'enc'" in str(listener)


def test_secret_files_are_read_stripped_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_secret(str(path)) == SECRET
    path.write_bytes(b"short\n")
    with pytest.raises(CredentialError, match="it holds 5 bytes; use at least 16"):
        load_secret(str(path))
    with pytest.raises(CredentialError, match=r"--cluster-secret-file .*missing: No such file"):
        load_secret(str(tmp_path / "missing"))
    assert "0123" not in repr(Credentials(secret=SECRET))


async def test_a_secret_rotates_without_a_stop(tmp_path: Path) -> None:
    """Old first and new second everywhere, then new first, then new alone: every step's nodes admit
    each other, whichever of them has moved on."""
    old, new = SECRET, SECRET[::-1]
    steps = [
        Credentials(secret=old),
        Credentials(secret=old, also=(new,)),
        Credentials(secret=new, also=(old,)),
    ]
    steps.append(Credentials(secret=new))
    for earlier, later in itertools.pairwise(steps):
        for dialer, listener in ((earlier, later), (later, earlier)):
            outcomes = await _open(dialer, listener)
            assert all(isinstance(outcome, Admitted) for outcome in outcomes), outcomes
    path = tmp_path / "secrets"
    path.write_bytes(new + b"\n\n" + old + b"\n")
    assert load_secrets(str(path)) == (new, old)
    path.write_bytes(new + b"\nshort\n")
    with pytest.raises(CredentialError, match="secret 2 holds 5 bytes"):
        load_secrets(str(path))
