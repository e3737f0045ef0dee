"""Mutual TLS for links (docs/security.md): contexts from a CA, a certificate and its key, and the name a
verified certificate proves.

Both sides present a certificate signed by the cluster's CA (`--peer-ca-file`) and verify the other's.
A certificate names its node by a DNS subjectAltName (or, lacking one, its subject's commonName): that
name is the node's identity on every link, so the frames a node sends must name it as their sender.
Host names are not checked — nodes are named by `--node-id`, not by where they run; the caller compares
the proven name with the node it meant to reach.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any, final


@final
class TlsError(Exception):
    """A TLS file cannot be used (the message names the option and the reason)."""


@final
@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca_file: str
    cert_file: str
    key_file: str


def _context(files: TlsFiles, purpose: ssl.Purpose) -> ssl.SSLContext:
    context = ssl.SSLContext(
        ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    )
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # the caller checks the proven node name (see the module docstring)
    context.verify_mode = ssl.CERT_REQUIRED
    if purpose is ssl.Purpose.CLIENT_AUTH:
        context.num_tickets = 0  # links are long-lived: no resumption, nothing sent after the handshake
    try:
        context.load_verify_locations(cafile=files.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"--peer-ca-file {files.ca_file}: {exc.strerror or exc}") from None
    try:
        context.load_cert_chain(files.cert_file, files.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(
            f"--peer-cert-file {files.cert_file} with --peer-key-file {files.key_file}: {exc.strerror or exc}"
        ) from None
    return context


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """For the side that accepts: it requires and verifies the dialer's certificate."""
    return _context(files, ssl.Purpose.CLIENT_AUTH)


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """For the side that dials: it verifies the listener's certificate and presents its own."""
    return _context(files, ssl.Purpose.SERVER_AUTH)


def certificate_name(certificate: dict[str, Any] | None) -> str | None:
    """The node a verified certificate (`SSLSocket.getpeercert()`) names: its first DNS subjectAltName,
    else its subject's commonName; None when it names none."""
    if not certificate:
        return None
    for kind, value in certificate.get("subjectAltName", ()):
        if kind == "DNS":
            return str(value)
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
