"""Admitting a UCX link (docs/security.md): with the cluster secret (`TransferConfig.admission`), right
after the connect exchange (`transport.links.ucx.connect`) — before the §5.1 handshake and so before any
grant — the two links run the secret's challenge–response (`transport.auth.streams`, purpose
`transfer`) as `AUTH` control bodies. The sending side hands the link to its endpoint only once the
receiver proved the secret; a link that does not is closed (its goodbye names why) and logged
(`transfer.link_refused`).
"""

from __future__ import annotations

from typing import final

import structlog
import trio

from transport.auth.challenge import AuthFailed
from transport.auth.credentials import LinkAdmission
from transport.auth.streams import admit_dialer, admit_listener
from transport.errors import LinkBroken, LinkClosed, LinkError
from transport.links.ucx.frames import AUTH, GOODBYE, UcxFrameError, auth_body, kind_of, parse_goodbye
from transport.links.ucx.library import UcxFailed
from transport.links.ucx.link import UcxLink

_log = structlog.get_logger("transport.ucx")
_LINK_FAILURES = (UcxFailed, UcxFrameError, LinkError, trio.EndOfChannel, trio.ClosedResourceError)


@final
class _AuthPipe(trio.abc.Stream):
    """The exchange's bytes as `AUTH` control bodies of a link that is not running yet."""

    def __init__(self, link: UcxLink) -> None:
        self._link = link
        self._buffer = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._link.post_control(auth_body(bytes(data)))
        except _LINK_FAILURES as exc:
            raise trio.BrokenResourceError(str(exc)) from None

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._buffer:
            try:
                body = await self._link.next_body()
                if kind_of(body, (AUTH, GOODBYE)) == GOODBYE:
                    raise trio.BrokenResourceError(f"the other side closed the link: {parse_goodbye(body)}")
            except _LINK_FAILURES as exc:
                raise trio.BrokenResourceError(str(exc)) from None
            self._buffer += body[1:]
        count = max_bytes or len(self._buffer)
        chunk = bytes(self._buffer[:count])
        del self._buffer[:count]
        return chunk

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()  # the link's owner closes it


async def admit(link: UcxLink, admission: LinkAdmission, shown: str, timeout: float) -> None:
    """The receiving (dialling) side: prove the secret; raises `LinkBroken` naming why."""
    try:
        with trio.fail_after(timeout):
            await admit_dialer(
                _AuthPipe(link), admission.credentials, purpose="transfer", name=admission.name, expect=None
            )
    except (AuthFailed, trio.BrokenResourceError, trio.TooSlowError) as exc:
        reason = str(exc) or f"no answer within {timeout} s"
        raise LinkBroken(f"the transfer link to {shown} was not admitted: {reason}") from None


async def admitted(link: UcxLink, admission: LinkAdmission, endpoint: str, timeout: float) -> bool:
    """The sending (accepting) side: whether the receiver proved the secret (False: logged, closed)."""
    try:
        with trio.fail_after(timeout):
            peer = await admit_listener(
                _AuthPipe(link), admission.credentials, purpose="transfer", name=admission.name
            )
    except (AuthFailed, trio.BrokenResourceError, trio.TooSlowError) as exc:
        reason = str(exc) or f"it did not authenticate within {timeout} s"
        _log.warning("transfer.link_refused", endpoint=endpoint, link=link.link_id, reason=reason)
        link.close(LinkBroken(f"not admitted: {reason}"))
        return False
    except BaseException as exc:
        link.close(LinkClosed(f"admitting given up: {exc!r}"))
        raise
    _log.debug("transfer.link_admitted", endpoint=endpoint, link=link.link_id, peer=peer.peer)
    return True
