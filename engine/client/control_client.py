"""An async client of the node's control socket: one method per op (architecture §7).

    async with ControlClient.connect("127.0.0.1:7340") as client:
        async for reply in client.generate(prompt="Hello", max_tokens=8, stream=True):
            ...  # TokenReply ..., then the GenerateResult
        status = await client.status()

Requests may run concurrently on one client (one task each); a reader task routes replies by id. An
``error`` reply raises `ControlError(code, message)`. If the connection ends before a request's final
reply, the request raises `ControlConnectionClosed`; an unreadable reply raises `ControlProtocolError`
in every pending request. No method has its own timeout: wrap calls in ``trio.fail_after``. Leaving a
`generate` iteration early does not cancel the request on the node; call `cancel(request_id)` for that
(`generate` always sends a `request_id`, so it is known before the first token).
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Final, Literal, TypeVar, final

import msgspec
import trio

from engine.config.address import Address, TcpAddress, parse_address
from engine.control.lines import LineReader, LineTooLong
from messages.control import (
    CancelRequest,
    ControlRequest,
    GenerateRequest,
    ImageInput,
    LockRequest,
    MetricsRequest,
    Op,
    ReleaseRequest,
    ReplicaRole,
    ReplicaStateName,
    ScaleMode,
    ScaleRequest,
    ShutdownRequest,
    SourceChoice,
    StatusRequest,
    TransitionRequest,
    UnlockRequest,
)
from messages.control_replies import (
    CancelResult,
    ControlReply,
    ControlResult,
    ErrorReply,
    GenerateResult,
    LockResult,
    MetricsResult,
    ReleaseResult,
    ScaleResult,
    ShutdownResult,
    StatusResult,
    TokenReply,
    TransitionResult,
    reply_decoder,
)
from messages.grammar import Grammar
from transport.protocol.scope import open_task_scope

DEFAULT_MAX_LINE_BYTES: Final = 64 * 1024 * 1024
R = TypeVar("R", bound=ControlResult)


class ControlClientError(Exception):
    """Base class of client errors."""


@final
class ControlError(ControlClientError):
    """The node answered with an ``error`` reply."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@final
class ControlConnectionClosed(ControlClientError):
    """The connection ended before the request's final reply."""


@final
class ControlProtocolError(ControlClientError):
    """The node sent a line this client cannot read (not a reply, or for no pending request)."""


class _Envelope(msgspec.Struct):
    id: str | None = None
    type: str | None = None


@final
class _Pending:
    __slots__ = ("op", "receive", "send")

    def __init__(self, op: Op) -> None:
        self.op = op
        self.send, self.receive = trio.open_memory_channel[ControlReply](math.inf)


@final
class ControlClient:
    """A connected client; build it with `ControlClient.connect`."""

    def __init__(self, stream: trio.abc.Stream, max_line_bytes: int) -> None:
        self._stream = stream
        self._max_line_bytes = max_line_bytes
        self._encoder = msgspec.json.Encoder()
        self._send_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._failure: ControlClientError | None = None
        # Requests whose caller stopped listening before the final reply: their late replies are dropped.
        self._abandoned: set[str] = set()

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        address: str | Address,
        *,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        token: bytes | None = None,
    ) -> AsyncIterator[ControlClient]:
        """Connect to ``HOST:PORT`` or ``unix:PATH``; closing the block closes the connection. `token`:
        the node's `--control-token-file` token, sent as the first line (a wrong one: the node answers
        `unauthorized` and closes, and every request raises `ControlProtocolError` saying so).

        Raises OSError when nobody listens there. Wrap in ``trio.fail_after`` to bound the connect.
        """
        target = parse_address(address) if isinstance(address, str) else address
        if isinstance(target, TcpAddress):
            stream: trio.abc.Stream = await trio.open_tcp_stream(target.host, target.port)
        else:
            stream = await trio.open_unix_socket(target.path)
        if token is not None:
            await stream.send_all(msgspec.json.encode({"token": token.decode()}) + b"\n")
        client = cls(stream, max_line_bytes)
        try:
            # The reader never raises: what leaves this block is what the caller's block raised.
            async with open_task_scope() as nursery:
                nursery.start_soon(client._read_loop)
                try:
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    # ------------------------------------------------------------------ ops
    async def generate(
        self,
        *,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        images: Sequence[ImageInput] = (),
        max_tokens: int | None = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop: Sequence[str] = (),
        add_special_tokens: bool = True,
        stream: bool = False,
        request_id: str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        grammar: Grammar | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> AsyncGenerator[TokenReply | GenerateResult, None]:
        """Token replies (when `stream`) and then the result. `request_id` defaults to a fresh uuid."""
        request = GenerateRequest(
            id=self._next_id(),
            prompt=prompt,
            input_ids=None if input_ids is None else list(input_ids),
            images=list(images),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            stop=list(stop),
            add_special_tokens=add_special_tokens,
            stream=stream,
            request_id=request_id or uuid.uuid4().hex,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=dict(logit_bias or {}),
        )
        async for reply in self.replies(request):
            match reply:
                case TokenReply() | GenerateResult():
                    yield reply
                case _:
                    raise ControlProtocolError(f"generate {request.id!r}: unexpected {type(reply).__name__}")

    async def generate_result(
        self,
        *,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        images: Sequence[ImageInput] = (),
        max_tokens: int | None = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop: Sequence[str] = (),
        request_id: str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        grammar: Grammar | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> GenerateResult:
        """`generate` without streaming: the result alone."""
        replies = self.generate(
            prompt=prompt,
            input_ids=input_ids,
            images=images,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            stop=stop,
            request_id=request_id,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=logit_bias,
        )
        async for reply in replies:
            if isinstance(reply, GenerateResult):
                return reply
        raise ControlProtocolError("generate: no result")

    async def status(self) -> StatusResult:
        return await self._call(StatusRequest(id=self._next_id()), StatusResult)

    async def cancel(self, request_id: str) -> CancelResult:
        return await self._call(CancelRequest(id=self._next_id(), request_id=request_id), CancelResult)

    async def transition(
        self,
        replica: str,
        to: ReplicaStateName,
        *,
        source: SourceChoice = "auto",
        paired_with: str | None = None,
    ) -> TransitionResult:
        request = TransitionRequest(
            id=self._next_id(), replica=replica, to=to, source=source, paired_with=paired_with
        )
        return await self._call(request, TransitionResult)

    async def lock(self, replica: str) -> LockResult:
        return await self._call(LockRequest(id=self._next_id(), replica=replica), LockResult)

    async def unlock(self, replica: str) -> LockResult:
        return await self._call(UnlockRequest(id=self._next_id(), replica=replica), LockResult)

    async def scale(
        self,
        role: ReplicaRole,
        replicas: int,
        *,
        mode: ScaleMode | None = None,
        source: SourceChoice = "auto",
        node: str | None = None,
        partner: str = "auto",
    ) -> ScaleResult:
        request = ScaleRequest(
            id=self._next_id(),
            role=role,
            replicas=replicas,
            mode=mode,
            source=source,
            node=node,
            partner=partner,
        )
        return await self._call(request, ScaleResult)

    async def metrics(self) -> MetricsResult:
        return await self._call(MetricsRequest(id=self._next_id()), MetricsResult)

    async def release(self, fault: Literal["hold_weights"] = "hold_weights") -> ReleaseResult:
        """End the holds of fault hook `fault` in progress on the node (tests)."""
        return await self._call(ReleaseRequest(id=self._next_id(), fault=fault), ReleaseResult)

    async def shutdown(self, *, cluster: bool = False) -> ShutdownResult:
        """Stop the node (`cluster`: every node of its cluster)."""
        return await self._call(ShutdownRequest(id=self._next_id(), cluster=cluster), ShutdownResult)

    # ------------------------------------------------------------------ plumbing
    async def replies(self, request: ControlRequest) -> AsyncGenerator[TokenReply | ControlResult, None]:
        """Send `request` and yield its replies up to the final one; an ``error`` reply raises `ControlError`."""
        if request.id in self._pending:
            raise ValueError(f"request id {request.id!r} is already in flight on this client")
        if self._failure is not None:
            raise self._failure
        op: Op = request.__struct_config__.tag  # type: ignore[assignment]
        pending = self._pending[request.id] = _Pending(op)
        finished = False
        try:
            line = self._encoder.encode(request) + b"\n"
            try:
                async with self._send_lock:
                    await self._stream.send_all(line)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ControlConnectionClosed(f"cannot send {op} {request.id!r}: {exc!r}") from exc
            while True:
                try:
                    reply = await pending.receive.receive()
                except trio.EndOfChannel:
                    raise self._failure or ControlConnectionClosed(
                        f"the connection closed before the final reply to {op} {request.id!r}"
                    ) from None
                if isinstance(reply, ErrorReply):
                    finished = True
                    raise ControlError(reply.code, reply.message, reply.request_id)
                finished = not isinstance(reply, TokenReply)
                yield reply
                if finished:
                    return
        finally:
            del self._pending[request.id]
            if not finished and self._failure is None:
                self._abandoned.add(request.id)

    async def _call(self, request: ControlRequest, result_type: type[R]) -> R:
        async for reply in self.replies(request):
            if isinstance(reply, result_type):
                return reply
            raise ControlProtocolError(
                f"{request.id!r}: expected {result_type.__name__}, got {type(reply).__name__}"
            )
        raise ControlProtocolError(f"{request.id!r}: no final reply")

    def _next_id(self) -> str:
        return str(next(self._ids))

    async def _read_loop(self) -> None:
        reader = LineReader(self._stream, self._max_line_bytes)
        try:
            while (line := await reader.next_line()) is not None:
                self._route(line)
            self._failure = ControlConnectionClosed("the node closed the connection")
        except LineTooLong as exc:
            self._failure = ControlProtocolError(f"reply {exc}")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._failure = ControlConnectionClosed(f"the connection broke: {exc!r}")
        except ControlProtocolError as exc:
            self._failure = exc
        finally:
            for pending in self._pending.values():
                pending.send.close()

    def _route(self, line: bytes) -> None:
        try:
            envelope = msgspec.json.decode(line, type=_Envelope)
        except msgspec.DecodeError as exc:
            raise ControlProtocolError(f"unreadable reply line: {exc}") from exc
        if envelope.id in self._abandoned:
            if envelope.type != "token":
                self._abandoned.discard(envelope.id)
            return
        pending = self._pending.get(envelope.id) if envelope.id is not None else None
        if pending is None and envelope.type == "error":  # the connection's own error (id null)
            error = msgspec.json.decode(line, type=ErrorReply)
            raise ControlProtocolError(f"the node answered {error.code}: {error.message}")
        if pending is None:
            raise ControlProtocolError(f"reply for no pending request (id {envelope.id!r}): {line[:200]!r}")
        try:
            reply = reply_decoder(pending.op).decode(line)
        except msgspec.DecodeError as exc:
            raise ControlProtocolError(
                f"reply to {pending.op} {envelope.id!r} does not match the protocol: {exc}"
            ) from exc
        pending.send.send_nowait(reply)
        if not isinstance(reply, TokenReply):
            pending.send.close()
