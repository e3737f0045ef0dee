"""What a node proves itself with and checks the others by (docs/security.md): the cluster secret, the
peer TLS files, or both; `NO_CREDENTIALS` when neither is configured.

`load_secrets` reads `--cluster-secret-file`: one secret a line, each at least `MIN_SECRET_BYTES` long
(`openssl rand -hex 32 > secret` makes one). The first is the one this node proves when it listens; a
dialer accepts a listener that proves any of them — a second line is how a secret is rotated without
stopping the cluster (docs/security.md). `load_secret` reads a file holding one (the control token).
Secrets never appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Final, final

from transport.auth.challenge import MIN_SECRET_BYTES
from transport.auth.tls import TlsError, TlsFiles, client_context, server_context


@final
class CredentialError(Exception):
    """A credential file cannot be used (the message names the option, the file and the reason)."""


def load_secret(path: str, option: str = "--cluster-secret-file") -> bytes:
    try:
        with open(path, "rb") as file:
            secret = file.read(1 << 16).strip()
    except OSError as exc:
        raise CredentialError(f"{option} {path}: {exc.strerror or exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise CredentialError(
            f"{option} {path}: it holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            "(openssl rand -hex 32 makes one)"
        )
    return secret


def load_secrets(path: str, option: str = "--cluster-secret-file") -> tuple[bytes, ...]:
    """The secrets of `path`, one a line (blank lines skipped); raises `CredentialError`."""
    try:
        with open(path, "rb") as file:
            lines = [line.strip() for line in file.read(1 << 16).splitlines()]
    except OSError as exc:
        raise CredentialError(f"{option} {path}: {exc.strerror or exc}") from None
    secrets = tuple(line for line in lines if line)
    if not secrets:
        raise CredentialError(f"{option} {path}: it holds no secret (openssl rand -hex 32 makes one)")
    for number, secret in enumerate(secrets, 1):
        if len(secret) < MIN_SECRET_BYTES:
            raise CredentialError(
                f"{option} {path}: secret {number} holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                "(openssl rand -hex 32 makes one)"
            )
    return secrets


@final
class Credentials:
    """The secret and/or TLS files of this node; their TLS contexts are built once, here."""

    def __init__(
        self, *, secret: bytes | None = None, also: tuple[bytes, ...] = (), tls: TlsFiles | None = None
    ) -> None:
        """`secret`: the one this node proves; `also`: others it accepts from a listener (rotation)."""
        self.secret = secret
        self.also = also
        self.tls = tls
        self.server_tls: ssl.SSLContext | None = None
        self.client_tls: ssl.SSLContext | None = None
        if tls is not None:
            try:
                self.server_tls, self.client_tls = server_context(tls), client_context(tls)
            except TlsError as exc:
                raise CredentialError(str(exc)) from None

    @property
    def configured(self) -> bool:
        return self.secret is not None or self.tls is not None

    def admission(self, name: str, *, tls: bool = False) -> LinkAdmission | None:
        """What admits the transfer links of node `name`: the secret (None without one); `tls`: tcp
        links speak TLS with this node's certificate (`--transfer-tls`)."""
        if self.secret is None:
            return None
        if not tls:
            return LinkAdmission(name, self.secret, self.also)
        return LinkAdmission(
            name, self.secret, self.also, server_tls=self.server_tls, client_tls=self.client_tls
        )

    def describe(self) -> str:
        """What authenticates links, in words (for the start line and docs)."""
        kinds = [name for name, on in (("mutual TLS", self.tls), ("the cluster secret", self.secret)) if on]
        return " and ".join(kinds) or "nothing"

    def __repr__(self) -> str:
        return f"Credentials({self.describe()})"


NO_CREDENTIALS: Final = Credentials()


@final
@dataclass(frozen=True, slots=True)
class LinkAdmission:
    """What admits a transfer link (`transport.endpoint`): the cluster secret's exchange (purpose
    `transfer`), this node's name bound into it. Held by the endpoint's `TransferConfig`."""

    name: str
    secret: bytes = field(repr=False)
    also: tuple[bytes, ...] = field(default=(), repr=False)
    server_tls: ssl.SSLContext | None = None  # --transfer-tls: tcp links accepted speak TLS
    client_tls: ssl.SSLContext | None = None  # ... and so do tcp links dialled

    @property
    def credentials(self) -> Credentials:
        return Credentials(secret=self.secret, also=self.also)
