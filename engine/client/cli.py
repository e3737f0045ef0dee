"""``python -m engine.client [--address A] [--json] [--timeout S] OP ...``: one subcommand per control op.

Prints readable text by default, or with ``--json`` every reply exactly as the node sent it (one JSON
object per line). Exit status: 0 success, 1 an ``error`` reply (printed as ``error CODE: message``),
2 bad usage, 3 no connection, the connection closed, or the timeout expired. The default address
comes from ``$ZIGZAG_LISTEN`` — the variable the node reads for its own ``--listen``, so one setting
serves both — else ``127.0.0.1:7340``. ``$ZIGZAG_ADDRESS``, the client's former variable, still works
when ``$ZIGZAG_LISTEN`` is not set, with a deprecation note on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, TextIO, final, get_args

import msgspec
import trio

from engine.client.control_client import ControlClient, ControlClientError, ControlError
from engine.config.address import parse_address
from messages.control import ImageInput, ReplicaRole, ReplicaStateName, ScaleMode, SourceChoice
from messages.control_replies import (
    ControlResult,
    GenerateResult,
    MetricsResult,
    ReplicaStatus,
    StatusResult,
    TokenReply,
)
from transport.auth.credentials import CredentialError, load_secret

ADDRESS_ENV: Final = "ZIGZAG_LISTEN"  # the node's `--listen` variable (engine.cli's naming)
DEPRECATED_ADDRESS_ENV: Final = "ZIGZAG_ADDRESS"
TOKEN_ENV: Final = "ZIGZAG_CONTROL_TOKEN_FILE"  # the node's `--control-token-file` variable
DEFAULT_ADDRESS: Final = "127.0.0.1:7340"  # the node's `--listen` default
EXIT_ERROR_REPLY, EXIT_USAGE, EXIT_CONNECTION = 1, 2, 3


def read_ppm(path: str) -> ImageInput:
    """A binary PPM (P6, maxval 255) as an RGB image; ValueError says what is wrong with the file."""
    data = Path(path).read_bytes()
    fields: list[bytes] = []
    position = 2
    if data[:2] != b"P6":
        raise ValueError(f"{path}: not a binary PPM (P6) file")
    while len(fields) < 3:
        while position < len(data) and data[position : position + 1].isspace():
            position += 1
        if data[position : position + 1] == b"#":
            end = data.find(b"\n", position)
            if end < 0:
                raise ValueError(f"{path}: the PPM header ends inside a comment")
            position = end + 1
            continue
        start = position
        while position < len(data) and not data[position : position + 1].isspace():
            position += 1
        fields.append(data[start:position])
    if not all(field.isdigit() for field in fields):
        raise ValueError(f"{path}: a PPM header needs width, height and maxval as numbers, got {fields!r}")
    width, height, maxval = (int(field) for field in fields)
    if maxval != 255:
        raise ValueError(f"{path}: maxval {maxval} is not supported (only 255)")
    pixels = data[position + 1 : position + 1 + width * height * 3]
    if len(pixels) != width * height * 3:
        raise ValueError(f"{path}: {len(pixels)} pixel bytes for a {width}x{height} image")
    return ImageInput(width=width, height=height, pixels=pixels)


def read_raw_image(spec: str) -> ImageInput:
    """``WIDTHxHEIGHT:FILE`` with FILE holding raw RGB bytes."""
    size, sep, path = spec.partition(":")
    width_text, x, height_text = size.partition("x")
    if not sep or not x or not width_text.isdigit() or not height_text.isdigit():
        raise ValueError(f"--raw-image {spec!r}: expected WIDTHxHEIGHT:FILE, e.g. 64x48:image.rgb")
    return ImageInput(width=int(width_text), height=int(height_text), pixels=Path(path).read_bytes())


def default_address(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The address used without `--address`, and a deprecation note to print when it came from the
    former variable (None otherwise)."""
    if ADDRESS_ENV in environ:
        return environ[ADDRESS_ENV], None
    if DEPRECATED_ADDRESS_ENV in environ:
        note = (
            f"note: ${DEPRECATED_ADDRESS_ENV} is deprecated; set ${ADDRESS_ENV}, which the node reads for its "
            "--listen too"
        )
        return environ[DEPRECATED_ADDRESS_ENV], note
    return DEFAULT_ADDRESS, None


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.client", description=__doc__.split("\n")[0])
    address, _ = default_address(environ)
    parser.add_argument(
        "--address",
        default=address,
        help=(
            f"the node's control socket, HOST:PORT or unix:PATH (default: {DEFAULT_ADDRESS}, the node's "
            f"--listen default; ${ADDRESS_ENV}, the node's variable, sets it for both; now {address})"
        ).replace("%", "%%"),
    )
    parser.add_argument(
        "--control-token-file",
        default=environ.get(TOKEN_ENV),
        help=(
            f"the node's --control-token-file: its token opens the connection (default: ${TOKEN_ENV}, "
            "the node's variable)"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print the replies as JSON lines")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole op (default 600)")
    ops = parser.add_subparsers(dest="op", required=True, metavar="OP")
    generate = ops.add_parser("generate", help="generate text")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (<image> marks where each image goes)")
    source.add_argument("--input-ids", help="comma-separated token ids")
    generate.add_argument("--image", action="append", default=[], metavar="FILE.ppm", help="a P6 PPM image")
    generate.add_argument(
        "--raw-image", action="append", default=[], metavar="WxH:FILE", help="raw RGB bytes"
    )
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--stream", action="store_true", help="print tokens as they come")
    generate.add_argument("--request-id", help="name the request (for cancel); default: a fresh uuid")
    ops.add_parser("status", help="replica states, blocks and queues")
    ops.add_parser(
        "ready",
        help=(
            "wait (up to --timeout) until the node answers and serves: every replica it lists (a "
            "cluster's included) loaded, a prefill and a decode replica among them"
        ),
    )
    ops.add_parser("cancel", help="cancel a running generate").add_argument("request_id")
    transition = ops.add_parser("transition", help="command a replica state change")
    transition.add_argument("replica")
    transition.add_argument("to", choices=get_args(ReplicaStateName), metavar="STATE")
    transition.add_argument(
        "--source", choices=get_args(SourceChoice), default="auto", help="Loading*: weights from"
    )
    transition.add_argument("--paired-with", help="NewPrefill / OldPrefill: the replica to relay with")
    ops.add_parser("lock", help="stop KV migrations to a replica").add_argument("replica")
    ops.add_parser("unlock", help="clear a manual lock").add_argument("replica")
    scale = ops.add_parser("scale", help="set the number of replicas of a role")
    scale.add_argument("role", choices=get_args(ReplicaRole))
    scale.add_argument("replicas", type=int)
    scale.add_argument(
        "--mode", choices=get_args(ScaleMode), help="zigzag or stop_the_world (default: the node's)"
    )
    scale.add_argument(
        "--source", choices=get_args(SourceChoice), default="auto", help="where weights come from"
    )
    scale.add_argument("--node", help="in a cluster: the node whose replicas to scale")
    scale.add_argument(
        "--partner",
        default="auto",
        help="zigzag: the OldPrefill partner (a replica name, of any node; default auto: this node's first)",
    )
    ops.add_parser("metrics", help="counters and gauges")
    ops.add_parser("release", help="end the hold_weights holds in progress (a test hook)")
    shutdown = ops.add_parser("shutdown", help="drain and stop the node")
    shutdown.add_argument("--cluster", action="store_true", help="every node of its cluster")
    return parser


async def run(args: argparse.Namespace, inputs: GenerateInputs | None, out: TextIO, err: TextIO) -> int:
    """Connect, send the op, print its replies. Raises `ControlError` for an ``error`` reply."""
    encoder = msgspec.json.Encoder()

    def show(reply: TokenReply | ControlResult) -> None:
        if args.json:
            out.write(encoder.encode(reply).decode() + "\n")
            out.flush()

    with trio.fail_after(args.timeout):
        if args.op == "ready":
            status = await wait_ready(args.address, args.token)
            show(status)
            if not args.json:
                out.write(render(status) + "\n")
            return 0
        async with ControlClient.connect(args.address, token=args.token) as client:
            if inputs is not None:
                await _generate(client, args, inputs, out, err, show)
                return 0
            result: ControlResult
            match args.op:
                case "status":
                    result = await client.status()
                case "cancel":
                    result = await client.cancel(args.request_id)
                case "transition":
                    result = await client.transition(
                        args.replica, args.to, source=args.source, paired_with=args.paired_with
                    )
                case "lock":
                    result = await client.lock(args.replica)
                case "unlock":
                    result = await client.unlock(args.replica)
                case "scale":
                    result = await client.scale(
                        args.role,
                        args.replicas,
                        mode=args.mode,
                        source=args.source,
                        node=args.node,
                        partner=args.partner,
                    )
                case "metrics":
                    result = await client.metrics()
                case "shutdown":
                    result = await client.shutdown(cluster=args.cluster)
                case "release":
                    result = await client.release()
                case other:
                    raise AssertionError(f"unhandled op {other!r}")
            show(result)
            if not args.json:
                out.write(render(result) + "\n")
    return 0


# States in which a replica serves (a ZigZag pair's prefill states included).
SERVING_STATES: Final = frozenset(
    {"Encode", "Prefill", "NewPrefill", "OldPrefill", "RefractoryPrefill", "Decode"}
)
READY_POLL_SECONDS: Final = 0.2


def serves(status: StatusResult) -> bool:
    """Every listed replica serves, and a prefill and a decode replica are among them."""
    roles = {replica.role for replica in status.replicas}
    loaded = all(replica.state in SERVING_STATES for replica in status.replicas)
    return loaded and {"prefill", "decode"} <= roles


async def wait_ready(address: str, token: bytes | None = None) -> StatusResult:
    """`status`, asked again every `READY_POLL_SECONDS` — through a node not listening yet, too — until
    the node `serves`. Cancellation (the caller's `--timeout`) stops it."""
    for _ in itertools.count():  # a remote node's state: asked, not signalled
        try:
            async with ControlClient.connect(
                address, token=token
            ) as client:  # one connection while it answers
                for _ in itertools.count():
                    status = await client.status()
                    if serves(status):
                        return status
                    await trio.sleep(READY_POLL_SECONDS)
        except (OSError, ControlClientError):  # not listening yet, or went away while starting
            pass
        await trio.sleep(READY_POLL_SECONDS)
    raise AssertionError("unreachable")


@final
class GenerateInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What `generate` reads from files and flags before connecting (so that a bad file is a usage error)."""

    input_ids: list[int] | None
    images: list[ImageInput]


def read_generate_inputs(args: argparse.Namespace) -> GenerateInputs:
    input_ids = None
    if args.input_ids is not None:
        try:
            input_ids = [int(part) for part in args.input_ids.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--input-ids {args.input_ids!r}: expected comma-separated integers") from None
    try:
        images = [read_ppm(path) for path in args.image] + [read_raw_image(spec) for spec in args.raw_image]
    except OSError as exc:  # name the option: "[Errno 2] No such file" alone does not say which
        raise ValueError(f"--image/--raw-image: {exc.filename}: {exc.strerror or exc}") from exc
    return GenerateInputs(input_ids=input_ids, images=images)


async def _generate(
    client: ControlClient,
    args: argparse.Namespace,
    inputs: GenerateInputs,
    out: TextIO,
    err: TextIO,
    show: Callable[[TokenReply | ControlResult], None],
) -> None:
    replies = client.generate(
        prompt=args.prompt,
        input_ids=inputs.input_ids,
        images=inputs.images,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stream=args.stream,
        request_id=args.request_id,
    )
    async for reply in replies:
        show(reply)
        if args.json:
            continue
        if isinstance(reply, TokenReply):
            out.write(reply.text)
            out.flush()
        else:
            if not args.stream:
                out.write(reply.text)
            out.write("\n")
            err.write(render(reply) + "\n")


def _lock_cell(replica: ReplicaStatus) -> str:
    """The lock's reasons; a replica that is not decoding takes no KV migrations, with no reason set."""
    if replica.lock_reasons:
        return ",".join(replica.lock_reasons)
    return "not decoding" if replica.locked else "-"


def render(result: ControlResult) -> str:
    """A short readable form of a final reply."""
    match result:
        case GenerateResult():
            timing = result.timings
            parts = [f"request {result.request_id}", f"{len(result.token_ids)} tokens", result.finish_reason]
            if timing.ttft_s is not None:
                parts.append(f"ttft {timing.ttft_s * 1000:.1f} ms")
            if timing.e2e_s is not None:
                parts.append(f"e2e {timing.e2e_s * 1000:.1f} ms")
            if result.relay is not None:
                relay = result.relay
                parts.append(f"relayed {relay.new_prefill}->{relay.old_prefill} after layer {relay.layer}")
            parts += [
                f"{t.kind}{'' if t.layers is None else ' ' + str(t.layers)} {t.source}->{t.destination} "
                f"{t.rounds} rounds {t.bytes} B"
                for t in result.transfers
            ]
            return "[" + ", ".join(parts) + "]"
        case StatusResult():
            header = (
                f"{'replica':<16} {'state':<18} {'used':>6} {'cached':>6} {'total':>6} {'lock':<18} "
                f"{'work':>5} {'migr':>5} {'layers':>7} {'weights':<8} {'paired':<10}  last_error"
            )
            rows = [header] + [
                f"{r.name:<16} {r.state:<18} {r.used_blocks:>6} {r.cached_blocks:>6} {r.total_blocks:>6} "
                f"{_lock_cell(r):<18} {r.work_queue:>5} {r.migration_queue:>5} "
                f"{f'{r.loaded_layers}/{r.total_layers}':>7} {r.weights_source or '-':<8} "
                f"{','.join(r.paired_with) or '-':<10}  {r.last_error or '-'}"
                for r in result.replicas
            ]
            if result.cluster is not None:
                view = result.cluster
                pids = {r.node: r.pid for r in result.replicas}
                rows.append(
                    f"cluster: node {view.node} ({view.state}), leader {view.leader or '-'}, nodes "
                    + ", ".join(f"{n} (pid {pids.get(n) or '-'})" for n in view.nodes)
                )
            return "\n".join(rows + ([] if result.accepting else ["(not accepting: shutting down)"]))
        case MetricsResult():
            fields = msgspec.to_builtins(result)
            fields.pop("type", None)
            fields.pop("id", None)
            return "\n".join(f"{key}: {msgspec.json.encode(value).decode()}" for key, value in fields.items())
        case _:
            fields = msgspec.to_builtins(result)
            return " ".join(f"{key}={value}" for key, value in fields.items() if key not in ("type", "id"))


def _check_usage(args: argparse.Namespace) -> None:
    """A malformed address or timeout is bad usage (exit 2), not a connection that failed. ValueError."""
    parse_address(args.address)
    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout}: must be a positive number of seconds")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args = build_parser(environ).parse_args(argv)
    address, note = default_address(environ)
    if note is not None and args.address == address:
        sys.stderr.write(f"{note}\n")
    try:
        _check_usage(args)
        token_file = args.control_token_file
        args.token = None if token_file is None else load_secret(token_file, "--control-token-file")
        inputs = read_generate_inputs(args) if args.op == "generate" else None
    except (ValueError, OSError, CredentialError) as exc:
        sys.stderr.write(f"{exc}\n")
        return EXIT_USAGE
    try:
        return trio.run(run, args, inputs, sys.stdout, sys.stderr)
    except ControlError as exc:
        sys.stderr.write(f"error {exc.code}: {exc.message}\n")
        return EXIT_ERROR_REPLY
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"cannot reach the node at {args.address}: {exc}\n")
        return EXIT_CONNECTION
    except ControlClientError as exc:
        sys.stderr.write(f"{type(exc).__name__} from {args.address}: {exc}\n")
        return EXIT_CONNECTION
    except trio.TooSlowError:
        sys.stderr.write(f"no answer within --timeout {args.timeout} s\n")
        return EXIT_CONNECTION
