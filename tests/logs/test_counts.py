"""The timeline's scaling view: replicas per role (not Inactive) and requests in flight over time."""

from __future__ import annotations

from engine.logs.counts import CountPoint, count_series, role_of


def test_replicas_per_role_and_requests_in_flight_as_steps() -> None:
    lanes = [
        ("prefill-0", [("LoadingPrefill", 0.0, 1.0), ("Prefill", 1.0, None)]),
        (
            "node-b/prefill-1",
            [
                ("Inactive", 0.0, 3.0),
                ("LoadingPrefill", 3.0, 4.0),
                ("Prefill", 4.0, 6.0),
                ("ShuttingPrefill", 6.0, 6.5),
                ("ShuttingNull", 6.5, 7.0),
                ("Inactive", 7.0, 9.0),
            ],
        ),
        ("decode-0", [("Decode", 0.0, 9.0)]),
    ]
    points = count_series(lanes, [(2.0, 5.0), (4.0, 8.0)])
    at = {p.at: (p.prefill, p.decode, p.in_flight) for p in points}
    assert at[0.0] == (1, 1, 0)
    assert at[2.0] == (1, 1, 1)
    assert at[3.0] == (2, 1, 1)  # loading counts
    assert at[4.0] == (2, 1, 2)  # Loading -> Prefill at the same instant: one point, no dip
    assert at[6.5] == (2, 1, 1)  # ShuttingNull still counts
    assert at[7.0] == (1, 1, 1)
    assert points[-1] == CountPoint(at=9.0, encode=0, prefill=1, decode=0, in_flight=0)  # prefill-0 open


def test_the_role_comes_from_the_replica_name() -> None:
    assert role_of("decode-3") == "decode"
    assert role_of("node-b/encode-0") == "encode"
    assert role_of("mystery") is None
