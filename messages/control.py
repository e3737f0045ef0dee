"""Control-socket requests (architecture §7): one JSON object per line, tagged by ``op``.

Every request carries ``id``, the client's correlation id, echoed on every reply (the replies live in
`messages.control_replies`). Numeric bounds are part of the protocol (docs/control-protocol.md lists
them): a value outside them is a `bad_request` before any replica sees it. Checks that need the model
(vocabulary size, context length) belong to the node. Messages hold no logic beyond validation.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

from messages.base import Record
from messages.grammar import Grammar

# ---------------------------------------------------------------------------------------------- bounds
MAX_ID_CHARS = 256
MAX_PROMPT_CHARS = 16 * 1024 * 1024
MAX_INPUT_IDS = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1
MAX_IMAGES = 64
MAX_IMAGE_SIDE = 8192
MAX_NEW_TOKENS = 1 << 20
MAX_TEMPERATURE = 10.0
MAX_SEED = (1 << 63) - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's `top_logprobs` and vLLM's default `max_logprobs`
MAX_SCALE_REPLICAS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

ClientId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
# `{role}-{index}`; in a cluster `{node}/{role}-{index}` (the bare form names a replica of the node asked,
# or the one replica of that name in the cluster).
ReplicaName = Annotated[
    str, msgspec.Meta(max_length=64, pattern=r"^(?:[a-z0-9][a-z0-9_-]{0,31}/)?[a-z]+-[0-9]+$")
]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
MAX_LOGIT_BIAS = 1024  # token ids one logit_bias may name
# vLLM's ranges: presence and frequency in [-2, 2], repetition > 0 (1: off), a bias in [-100, 100].
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=1e6)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]

# ---------------------------------------------------------------------------------------------- names
Op = Literal[
    "generate", "status", "cancel", "transition", "lock", "unlock", "scale", "metrics", "shutdown", "release"
]
OPS: tuple[Op, ...] = get_args(Op)

ErrorCode = Literal[
    "bad_request",
    "not_found",
    "invalid_transition",
    "not_supported",
    "overloaded",
    "transfer_failed",
    "transfer_timeout",
    "replica_failed",
    "cancelled",
    "shutting_down",
    "stale_lease",
    "unauthorized",
    "internal",
]
ERROR_CODES: tuple[ErrorCode, ...] = get_args(ErrorCode)

ReplicaRole = Literal["encode", "prefill", "decode"]
# The names of architecture §6, as written there; `replicas.states.ReplicaState` holds the same values.
ReplicaStateName = Literal[
    "Inactive",
    "LoadingPrefill",
    "LoadingDecode",
    "LoadingEncode",
    "Prefill",
    "Decode",
    "Encode",
    "NewPrefill",
    "OldPrefill",
    "RefractoryPrefill",
    "MutatingToDecode",
    "AusPrefill",
    "AusDecode",
    "ShuttingPrefill",
    "ShuttingDecode",
    "ShuttingEncode",
    "ShuttingNull",
]
LockReason = Literal["manual", "controller"]
FinishReason = Literal["stop", "length", "cancelled"]
# Where a replica's weights come from (architecture §8); `resident`: a copy already on the device.
WeightsSource = Literal["resident", "peer", "host", "disk"]
SourceChoice = Literal["auto", "peer", "host", "disk"]
ScaleMode = Literal["zigzag", "stop_the_world"]
TransferKind = Literal["embedding", "kv", "relay", "weights"]


# ---------------------------------------------------------------------------------------------- requests
class ControlRequestBase(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="op"
):
    """Every request: `id` is the client's correlation id, unique among its in-flight requests."""

    id: ClientId


class ImageInput(Record, frozen=True):
    """Raw RGB bytes, row-major, 3 bytes per pixel; base64 in JSON under ``pixels_b64``."""

    width: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGE_SIDE)]
    height: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGE_SIDE)]
    pixels: bytes = msgspec.field(name="pixels_b64")

    def __post_init__(self) -> None:
        expected = self.width * self.height * 3
        if len(self.pixels) != expected:
            raise ValueError(
                f"pixels_b64 decodes to {len(self.pixels)} bytes, but a {self.width}x{self.height} RGB "
                f"image needs width*height*3 = {expected}"
            )


class GenerateRequest(ControlRequestBase, frozen=True, tag="generate"):
    """Generate from `prompt` (text; each ``<image>`` marks where the next image goes) or `input_ids`.

    `request_id` is optional: a name of the client's choosing (unique among the node's live requests) so
    that any connection can `cancel` it; the node assigns one when it is absent. `temperature` 0 is greedy;
    sampling randomness is a function of (`seed`, position). `logprobs`: each generated token's
    log-probability with that many most likely alternatives; `prompt_logprobs`: the same for each prompt
    token (the first one's is null) — the model's raw distribution, before temperature and top-p. `presence_penalty`,
    `frequency_penalty` (over the generated tokens), `repetition_penalty` (over prompt and generated
    tokens) and `logit_bias` (token id → value added to its logit) adjust the logits as vLLM's do.
    `grammar`: the output's structure (`messages.grammar`: a JSON schema, a regex, a choice, a grammar);
    one that does not compile is a `bad_request` naming why.
    """

    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    input_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_INPUT_IDS)] | None = None
    images: Annotated[list[ImageInput], msgspec.Meta(max_length=MAX_IMAGES)] = []
    # None (`null`): what the node's context leaves after the prompt.
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)] | None = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_NEW_TOKENS)] = 0
    stop: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = []
    add_special_tokens: bool = True
    stream: bool = False
    request_id: RequestId | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: Annotated[dict[TokenId, LogitBias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = {}
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.input_ids is None):
            given = "both were given" if self.prompt is not None else "neither was given"
            raise ValueError(f"generate needs exactly one of `prompt` or `input_ids`; {given}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")


class StatusRequest(ControlRequestBase, frozen=True, tag="status"):
    """One entry per configured replica."""


class CancelRequest(ControlRequestBase, frozen=True, tag="cancel"):
    """Cancel a live generate by its node-wide `request_id` (from its token replies, or chosen by the client)."""

    request_id: RequestId


class TransitionRequest(ControlRequestBase, frozen=True, tag="transition"):
    """Command `replica` into state `to` (a commanded move of the architecture §6 table)."""

    replica: ReplicaName
    to: ReplicaStateName
    # Loading*: where the weights come from; NewPrefill / OldPrefill: the replica to relay with (chosen
    # by the node when absent).
    source: SourceChoice = "auto"
    paired_with: ReplicaName | None = None


class LockRequest(ControlRequestBase, frozen=True, tag="lock"):
    """Set the manual lock: `replica` accepts no new KV migrations until `unlock`."""

    replica: ReplicaName


class UnlockRequest(ControlRequestBase, frozen=True, tag="unlock"):
    """Clear the manual lock (a controller lock, if any, stays until the controller clears it)."""

    replica: ReplicaName


class ScaleRequest(ControlRequestBase, frozen=True, tag="scale"):
    """Set the number of serving replicas of `role`."""

    role: ReplicaRole
    replicas: Annotated[int, msgspec.Meta(ge=0, le=MAX_SCALE_REPLICAS)]
    # Default: `zigzag` for prefill when a prefill replica is serving, else `stop_the_world`.
    mode: ScaleMode | None = None
    source: SourceChoice = "auto"
    # In a cluster: the node whose replicas to scale (default: this one while it has a free replica slot).
    node: Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[a-z0-9][a-z0-9_-]*$")] | None = None
    # ZigZag: the OldPrefill partner of each new replica. `auto`: a replica of the node the scale runs
    # on, else (`mode: zigzag` named) one of another node; or a replica by name, of any node.
    partner: Annotated[str, msgspec.Meta(min_length=1, max_length=100)] = "auto"


class MetricsRequest(ControlRequestBase, frozen=True, tag="metrics"):
    """Counters and gauges since the node started."""


class ShutdownRequest(ControlRequestBase, frozen=True, tag="shutdown"):
    """Stop admitting, drain in-flight work within the configured deadline, check pools, exit.
    `cluster`: every node of the cluster does (the others first)."""

    cluster: bool = False


class ReleaseRequest(ControlRequestBase, frozen=True, tag="release"):
    """End the holds of fault hook `fault` in progress now (`hold_weights`: weight copies held before a
    layer; each would otherwise last its `seconds`). A test lets a held copy go once it saw what it
    waited for."""

    fault: Literal["hold_weights"] = "hold_weights"


ControlRequest = (
    GenerateRequest
    | StatusRequest
    | CancelRequest
    | TransitionRequest
    | LockRequest
    | UnlockRequest
    | ScaleRequest
    | MetricsRequest
    | ShutdownRequest
    | ReleaseRequest
)


def request_decoder() -> msgspec.json.Decoder[ControlRequest]:
    """A decoder of one request line (tagged by ``op``)."""
    return msgspec.json.Decoder(ControlRequest)
