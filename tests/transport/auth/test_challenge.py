"""The cluster secret's challenge–response and the per-frame MAC, as bytes (transport.auth): each side
admits only a holder of the same secret, nothing of one exchange passes in another, and every changed,
replayed or reordered frame fails its check. Hypothesis parses arbitrary bytes: an `AuthFailed`, never
another exception."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transport.auth.challenge import (
    MAX_NAME_BYTES,
    AuthFailed,
    answer,
    check_answer,
    check_proof,
    encode_answer,
    encode_hello,
    new_hello,
    parse_answer,
    parse_hello,
)
from transport.auth.frames import FrameOpener, FrameSealer

SECRET = b"s" * 32
OTHER = b"o" * 32
names = st.text(min_size=1, max_size=16).filter(lambda n: 0 < len(n.encode()) <= MAX_NAME_BYTES)


@given(dialer=names, listener=names)
def test_holders_of_one_secret_admit_each_other_and_share_a_key(dialer: str, listener: str) -> None:
    hello = new_hello("peer", dialer)
    received = parse_hello(encode_hello(hello))
    assert received == hello
    reply, listener_key = answer(SECRET, received, listener)
    parsed = parse_answer(encode_answer(reply))
    assert parsed == reply
    proof, dialer_key = check_answer([SECRET], hello, parsed)
    check_proof(SECRET, received, reply, proof)
    assert dialer_key == listener_key


def test_a_listener_without_the_secret_is_refused_by_the_dialer() -> None:
    hello = new_hello("peer", "pre")
    reply, _ = answer(OTHER, hello, "dec")
    with pytest.raises(AuthFailed, match="'dec' did not prove the cluster secret"):
        check_answer([SECRET], hello, reply)


def test_a_dialer_without_the_secret_is_refused_by_the_listener() -> None:
    hello = new_hello("peer", "intruder")
    reply, _ = answer(SECRET, hello, "dec")
    forged = b"x" * 32
    with pytest.raises(AuthFailed, match="'intruder' did not prove"):
        check_proof(SECRET, hello, reply, forged)
    wrong_secret_proof, _ = check_answer([OTHER], hello, answer(OTHER, hello, "dec")[0])
    with pytest.raises(AuthFailed):
        check_proof(SECRET, hello, reply, wrong_secret_proof)


def test_a_proof_does_not_pass_for_another_name_purpose_or_exchange() -> None:
    hello = new_hello("peer", "pre")
    reply, _ = answer(SECRET, hello, "dec")
    proof, _ = check_answer([SECRET], hello, reply)
    renamed = type(hello)(purpose="peer", nonce=hello.nonce, name="enc")
    with pytest.raises(AuthFailed):
        check_proof(SECRET, renamed, reply, proof)
    repurposed = type(hello)(purpose="transfer", nonce=hello.nonce, name="pre")
    with pytest.raises(AuthFailed):
        check_proof(SECRET, repurposed, reply, proof)
    fresh, _ = answer(SECRET, hello, "dec")  # the listener's next exchange: a new nonce
    with pytest.raises(AuthFailed):
        check_proof(SECRET, hello, fresh, proof)
    # the listener's MAC is not the dialer's: a reflected answer is no proof
    with pytest.raises(AuthFailed):
        check_proof(SECRET, hello, reply, reply.mac)


@given(data=st.binary(max_size=300))
def test_any_bytes_parse_or_fail_with_auth_failed(data: bytes) -> None:
    for parse in (parse_hello, parse_answer):
        try:
            parse(data)
        except AuthFailed:
            pass


@given(bodies=st.lists(st.binary(max_size=64), min_size=1, max_size=8))
def test_frames_pass_in_order_and_fail_when_changed_replayed_or_reflected(bodies: list[bytes]) -> None:
    key = b"k" * 32
    sealer, opener = FrameSealer(key, "dialer"), FrameOpener(key, "dialer")
    tags = [sealer.seal(body) for body in bodies]
    for body, tag in zip(bodies, tags, strict=True):
        opener.check(body, tag)
    with pytest.raises(AuthFailed):  # the first frame again: a replay
        opener.check(bodies[0], tags[0])
    changed = FrameOpener(key, "dialer")
    with pytest.raises(AuthFailed):
        changed.check(bodies[0] + b"!", tags[0])
    reflected = FrameOpener(key, "listener")
    with pytest.raises(AuthFailed):
        reflected.check(bodies[0], tags[0])


def test_a_dialer_accepts_a_listener_that_proves_any_of_its_secrets() -> None:
    """Rotation: a listener proves its first secret; a dialer holding old and new admits either."""
    hello = new_hello("transfer", "pre")
    for listener_secret in (SECRET, OTHER):
        reply, listener_key = answer(listener_secret, hello, "dec")
        proof, dialer_key = check_answer([OTHER, SECRET], hello, reply)
        check_proof(listener_secret, hello, reply, proof)
        assert dialer_key == listener_key
    with pytest.raises(AuthFailed):
        check_answer([OTHER], hello, answer(SECRET, hello, "dec")[0])
