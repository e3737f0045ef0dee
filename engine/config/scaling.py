"""The config sections of scaling out and by the load: `[cluster]` (docs/cluster.md) and `[autoscale]`
(docs/planner.md). Part of the node's one config tree (`engine.config.NodeConfig`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engine.config.base import Section, _doc

NodeName = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[a-z0-9][a-z0-9_-]*$")]


class ClusterConfig(Section, frozen=True, kw_only=True):
    cluster: Annotated[
        str | None,
        _doc("join the cluster whose etcd answers at this URL, http(s)://HOST:PORT (docs/cluster.md)"),
    ] = None
    node_id: Annotated[
        NodeName | None,
        _doc("this node's cluster-unique name (default: node-PID); its replicas are {node}/{role}-{n}"),
    ] = None
    cluster_name: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$"),
        _doc("the cluster's name: its etcd keys live under /zigzag/{name}/"),
    ] = "default"
    lease_ttl: Annotated[
        int, msgspec.Meta(ge=1, le=3600), _doc("seconds a node outlives the latest renewal of its lease")
    ] = 10
    cluster_host: Annotated[
        str, _doc("address this node listens on for other nodes (peer links, transfers) and announces")
    ] = "127.0.0.1"
    replica_slots: Annotated[
        int, msgspec.Meta(ge=0, le=1024), _doc("replicas this node may run (what `scale` places here)")
    ] = 16
    cluster_secret_file: Annotated[
        str | None,
        _doc(
            "a file holding the cluster's shared secret, one a line (16 bytes or more; the first is proven, any "
            "is accepted: rotation): peer and transfer links admit only nodes that prove it, and every peer "
            "frame carries a MAC (docs/security.md)"
        ),
    ] = None
    peer_ca_file: Annotated[
        str | None, _doc("mutual TLS on peer links: the CA that signs every node's certificate")
    ] = None
    peer_cert_file: Annotated[
        str | None,
        _doc("mutual TLS on peer links: this node's certificate, naming --node-id (DNS SAN or CN)"),
    ] = None
    peer_key_file: Annotated[str | None, _doc("mutual TLS on peer links: the key of --peer-cert-file")] = None
    etcd_ca_file: Annotated[str | None, _doc("TLS: the CA that signed etcd's certificate")] = None
    etcd_cert_file: Annotated[str | None, _doc("TLS: this node's client certificate for etcd")] = None
    etcd_key_file: Annotated[str | None, _doc("TLS: the key of --etcd-cert-file")] = None
    etcd_username: Annotated[str | None, _doc("etcd auth: user name")] = None
    etcd_password: Annotated[str | None, _doc("etcd auth: password (prefer ZIGZAG_ETCD_PASSWORD)")] = None
    nodes: Annotated[
        int,
        msgspec.Meta(ge=1, le=16),
        _doc("--demo: run the demo across this many node processes and a local etcd"),
    ] = 1
    secure: Annotated[
        bool,
        _doc(
            "--demo --nodes N: the local etcd takes only clients with a certificate of a CA made for the run "
            "and a user's password (each node gets its own certificate; needs the openssl command)"
        ),
    ] = False

    def __post_init__(self) -> None:
        tls = {"--peer-ca-file": self.peer_ca_file, "--peer-cert-file": self.peer_cert_file}
        tls["--peer-key-file"] = self.peer_key_file
        given = [option for option, value in tls.items() if value is not None]
        if given and len(given) < len(tls):
            missing = ", ".join(option for option in tls if option not in given)
            raise ValueError(f"mutual TLS on peer links needs {', '.join(tls)}: {missing} missing")
        if given and self.cluster_secret_file is None:
            raise ValueError(
                "--peer-cert-file authenticates the peer links; transfer links are admitted by the cluster "
                "secret: give --cluster-secret-file as well (docs/security.md)"
            )


Utilisation = Annotated[float, msgspec.Meta(gt=0, le=1)]
Replicas = Annotated[int, msgspec.Meta(ge=0, le=64)]


class AutoscaleConfig(Section, frozen=True, kw_only=True):
    """The planner (docs/planner.md): off unless `--autoscale`. Bounds are utilisations: the planner
    scales a role up above `upper`, down below `lower` (BlitzScale's defaults)."""

    autoscale: Annotated[
        bool, _doc("scale prefill and decode replicas by the load (the cluster's leader)")
    ] = False
    autoscale_policy: Annotated[
        Literal["blitz", "serverless"],
        _doc(
            "blitz: prefill scales up with ZigZag, weights from any source; serverless: stop-the-world from host or disk"
        ),
    ] = "blitz"
    autoscale_period: Annotated[
        float, msgspec.Meta(gt=0, le=3600), _doc("seconds between planner passes")
    ] = 0.1
    autoscale_window: Annotated[
        float, msgspec.Meta(gt=0, le=3600), _doc("seconds of load the rates are measured over")
    ] = 5.0
    autoscale_drain: Annotated[
        float,
        msgspec.Meta(gt=0, le=3600),
        _doc("seconds within which the waiting prompt tokens should be prefilled"),
    ] = 2.0
    autoscale_keep_alive: Annotated[
        float,
        msgspec.Meta(ge=0, le=86400),
        _doc("seconds a scaled-down replica keeps its weights (ShuttingNull) before it is made Inactive"),
    ] = 0.333
    autoscale_down_after: Annotated[
        float,
        msgspec.Meta(ge=0, le=3600),
        _doc(
            "seconds a role's range must stay below its count (and since its last scale-up) before a scale-down"
        ),
    ] = 3.0
    autoscale_pause_after_manual: Annotated[
        float, msgspec.Meta(ge=0, le=86400), _doc("seconds the planner waits after a manual scale")
    ] = 30.0
    autoscale_slo_ttft: Annotated[
        float,
        msgspec.Meta(ge=0, le=3600),
        _doc(
            "TTFT SLO, seconds (0: off): past `--autoscale-slo-miss` of first tokens late, prefill scales up"
        ),
    ] = 0.0
    autoscale_slo_ttft_per_token: Annotated[
        float, msgspec.Meta(ge=0, le=1), _doc("... or this many seconds per prompt token, whichever is more")
    ] = 0.000375
    autoscale_slo_miss: Annotated[
        float, msgspec.Meta(ge=0, le=1), _doc("the fraction of first tokens that may miss the TTFT SLO")
    ] = 0.05
    autoscale_predictor: Annotated[
        Literal["none", "constant", "ewma", "kalman", "periodic"],
        _doc(
            "the forecast that sets each role's floor: constant, ewma, kalman (local linear trend on "
            "log(1 + rate)), periodic (a profile over --autoscale-forecast-season); none: reactive only"
        ),
    ] = "kalman"
    autoscale_advisory: Annotated[
        bool, _doc("decide and log every decision (planner_decision, advisory), but never scale")
    ] = False
    autoscale_forecast_interval: Annotated[
        float, msgspec.Meta(gt=0, le=3600), _doc("seconds of arrivals per forecast interval")
    ] = 1.0
    autoscale_forecast_season: Annotated[
        float,
        msgspec.Meta(gt=0, le=86400),
        _doc("seconds of one period of the `periodic` predictor's profile"),
    ] = 60.0
    autoscale_forecast_clamp: Annotated[
        float,
        msgspec.Meta(ge=1, le=100),
        _doc("a forecast is at most this many times the largest interval's load seen"),
    ] = 2.0
    autoscale_lead_time: Annotated[
        float,
        msgspec.Meta(ge=0, le=3600),
        _doc(
            "the forecast's horizon, seconds, until a weight copy from the source a scale-up uses was measured"
        ),
    ] = 1.0
    prefill_utilization_lower: Annotated[Utilisation, _doc("prefill: scale down below this")] = 0.5
    prefill_utilization_upper: Annotated[Utilisation, _doc("prefill: scale up above this")] = 0.7
    decode_utilization_lower: Annotated[Utilisation, _doc("decode KV memory: scale down below this")] = 0.75
    decode_utilization_upper: Annotated[Utilisation, _doc("decode KV memory: scale up above this")] = 0.95
    migration_utilization_lower: Annotated[Utilisation, _doc("KV migration bandwidth: scale down below")] = (
        0.4
    )
    migration_utilization_upper: Annotated[Utilisation, _doc("KV migration bandwidth: scale up above")] = 0.8
    migration_bytes_per_s: Annotated[
        float,
        msgspec.Meta(ge=0),
        _doc("KV bytes/s one decode replica takes in (0: measured from the transfers)"),
    ] = 0.0
    prefill_tokens_per_s: Annotated[
        float, msgspec.Meta(ge=0), _doc("prompt tokens/s one prefill replica computes (0: measured)")
    ] = 0.0
    min_prefill_replicas: Annotated[
        Replicas, _doc("the planner keeps at least this many prefill replicas")
    ] = 1
    max_prefill_replicas: Annotated[Replicas, _doc("... and at most this many")] = 4
    min_decode_replicas: Annotated[Replicas, _doc("the planner keeps at least this many decode replicas")] = 1
    max_decode_replicas: Annotated[Replicas, _doc("... and at most this many")] = 4

    def __post_init__(self) -> None:
        for role in ("prefill", "decode", "migration"):
            lower, upper = (
                getattr(self, f"{role}_utilization_lower"),
                getattr(self, f"{role}_utilization_upper"),
            )
            if not lower < upper:
                raise ValueError(
                    f"{role}_utilization_lower ({lower}) must be below {role}_utilization_upper ({upper})"
                )
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}_replicas"), getattr(self, f"max_{role}_replicas")
            if low > high:
                raise ValueError(f"min_{role}_replicas ({low}) exceeds max_{role}_replicas ({high})")
