"""What a node's links and control socket authenticate with (docs/security.md), read from the files its
options name: the cluster's credentials (in a cluster) and the control socket's token."""

from __future__ import annotations

import structlog

from engine.config import NodeConfig
from engine.config.address import loopback
from transport.auth.credentials import NO_CREDENTIALS, Credentials, load_secret, load_secrets
from transport.auth.tls import TlsFiles

_log = structlog.get_logger("engine.config.credentials")


def node_credentials(node: NodeConfig) -> tuple[Credentials, bytes | None]:
    """The cluster's credentials (`NO_CREDENTIALS` outside a cluster) and the control token (None
    without `--control-token-file`), read and checked; raises `CredentialError`. A node in a cluster on a
    non-loopback `--cluster-host` without credentials warns once, naming the risk; so does an HTTP API
    on a non-loopback address without `--api-key`."""
    token_file = node.control.control_token_file
    token = None if token_file is None else load_secret(token_file, "--control-token-file")
    http = node.http_address
    if http is not None and node.api_key is None and not loopback(http[0]):
        _log.warning(
            "http.unauthenticated",
            http=f"{http[0]}:{http[1]}",
            risk=(
                f"the HTTP API on {http[0]} serves any client that reaches it; give --api-key, or put it "
                "behind a proxy that authenticates (docs/security.md)"
            ),
        )
    config = node.cluster
    if config.cluster is None:
        return NO_CREDENTIALS, token
    secrets = () if config.cluster_secret_file is None else load_secrets(config.cluster_secret_file)
    tls = None
    if config.peer_ca_file and config.peer_cert_file and config.peer_key_file:
        tls = TlsFiles(
            ca_file=config.peer_ca_file, cert_file=config.peer_cert_file, key_file=config.peer_key_file
        )
    credentials = Credentials(secret=secrets[0] if secrets else None, also=secrets[1:], tls=tls)
    if not credentials.configured and not loopback(config.cluster_host):
        _log.warning(
            "cluster.unauthenticated",
            cluster_host=config.cluster_host,
            risk=(
                f"peer and transfer links on {config.cluster_host} accept any host that reaches them: one "
                "forged frame can stop this node or run requests; give --cluster-secret-file (docs/security.md)"
            ),
        )
    return credentials, token
