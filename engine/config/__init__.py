"""The node's configuration: one typed tree (msgspec Structs), from TOML, environment and flags.

`parse_node_config(argv, environ)` is the only way in: defaults < ``--config FILE.toml`` (or
``ZIGZAG_CONFIG``) < ``ZIGZAG_*`` environment variables < command-line flags. Every leaf option has one
TOML key (``section.name``), one flag and one environment variable, generated from this tree by
`engine.cli`; the descriptions below are the ``--help`` text. docs/configuration.md lists them all.
Errors name the option, where its value came from, and the bad value (`ConfigError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Final, Literal, assert_never

import msgspec

from engine.config.address import Address, exposed, parse_address, parse_http
from engine.config.base import ConfigError as ConfigError
from engine.config.base import ReplicaCounts, Section, _doc
from engine.config.executor import ExecutorConfig
from engine.config.prefix import PrefixConfig
from engine.config.scaling import AutoscaleConfig, ClusterConfig
from messages.control import MAX_SEED
from messages.faults import Fault
from replicas.emulation import EmulatedSpeed
from transport.config import UcxCopies
from transport.kinds import TransportChoice
from transport.kinds import unavailable as transport_unavailable

Level = Literal["debug", "info", "warning", "error"]
ToolCallParser = Literal["hermes", "llama3_json"]  # engine.http.tools.parsers
MIB: Final = 1024 * 1024
TLS_TRANSPORTS: Final = ("tcp", "inproc", "auto")  # inproc and auto become tcp in a cluster
MAX_BLOCKS: Final = 1 << 24  # a pool's blocks at most, given (--kv-pool-blocks) or sized
Blocks = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class LogConfig(Section, frozen=True, kw_only=True):
    file: Annotated[str | None, _doc("append JSON-lines events to this file (docs/logging.md)")] = None
    level: Annotated[
        Level,
        _doc(
            "lowest event level written to the file; the console shows warnings and errors, the start "
            "line and the summary (every event at debug)"
        ),
    ] = "info"
    console: Annotated[bool, _doc("readable events on stderr")] = True
    summary_period: Annotated[
        float,
        msgspec.Meta(ge=0, le=86400),
        _doc("seconds between the one-line serving summaries (0: none)"),
    ] = 10.0


class KvConfig(Section, frozen=True, kw_only=True):
    block_size: Annotated[int, msgspec.Meta(ge=1, le=4096), _doc("tokens per KV block")] = 16
    pool_blocks: Annotated[
        Blocks | None,
        _doc(
            "KV blocks per decode/prefill replica; given, it wins over --gpu-memory-utilization (default: "
            "on cpu one maximum-context request, on cuda what --gpu-memory-utilization leaves)"
        ),
    ] = None


class EmbeddingConfig(Section, frozen=True, kw_only=True):
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16), _doc("tokens per embedding block")] = 128
    default_blocks: Annotated[
        int, msgspec.Meta(ge=1, le=1 << 20), _doc("blocks of the round-0 grant when the length is unknown")
    ] = 8
    pool_blocks: Annotated[
        Blocks | None,
        _doc("embedding landing blocks per language replica (default: one maximum-context request)"),
    ] = None
    max_grant_blocks: Annotated[
        Blocks | None,
        _doc("cap on the blocks granted per REQUEST_MORE_CACHE round (default: unlimited)"),
    ] = None

    def __post_init__(self) -> None:
        if self.pool_blocks is not None and self.default_blocks > self.pool_blocks:
            raise ValueError(
                f"default_blocks ({self.default_blocks}) exceeds pool_blocks ({self.pool_blocks}): "
                "the round-0 grant could never be allocated"
            )


class SchedulerConfig(Section, frozen=True, kw_only=True):
    max_batch_tokens: Annotated[
        int,
        msgspec.Meta(ge=1, le=1 << 20),
        _doc("prompt tokens per prefill batch (a longer prompt runs in chunks: --prefill-chunk-tokens)"),
    ] = 4096
    prefill_chunk_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | None,
        _doc(
            "chunked prefill: a longer prompt runs in chunks of at most this many tokens, each started "
            "prompt's next chunk first (none: max_batch_tokens, at least 8192; 0: off, whole prompts)"
        ),
    ] = None
    max_batch_size: Annotated[int, msgspec.Meta(ge=1, le=4096), _doc("sequences per batch")] = 64
    max_queue: Annotated[
        int, msgspec.Meta(ge=1, le=1 << 20), _doc("requests admitted at once; more get `overloaded`")
    ] = 1024
    queue_wait: Annotated[
        float,
        msgspec.Meta(gt=0, le=86400),
        _doc("seconds a request may wait for a prefill (or encode) replica to take it; then `overloaded`"),
    ] = 60.0
    migration_wait: Annotated[
        float,
        msgspec.Meta(gt=0, le=86400),
        _doc("seconds a prefilled request may wait for a decode replica to take its KV; then `overloaded`"),
    ] = 60.0
    old_prefill_serves_queue: Annotated[
        bool, _doc("ZigZag: an OldPrefill replica also takes new requests between relays (docs/zigzag.md)")
    ] = True


class TransferConfig(Section, frozen=True, kw_only=True):
    progress_timeout: Annotated[
        float, msgspec.Meta(gt=0, le=3600), _doc("seconds without progress before a transfer fails")
    ] = 30.0
    grant_wait_timeout: Annotated[
        float, msgspec.Meta(gt=0, le=3600), _doc("seconds a receiver waits for free blocks to grant")
    ] = 10.0
    heartbeat_interval: Annotated[
        float, msgspec.Meta(gt=0, le=600), _doc("seconds between heartbeats on an idle network link")
    ] = 1.0
    ucx_copies: Annotated[
        UcxCopies,
        _doc(
            "ucx, from a process on this host: who copies into the receiver's rows. cma: the receiver "
            "reads pieces of 16 KiB and more itself (all of a write's, when at most 64 are smaller), many "
            "per system call (else as mixed); mixed: it reads "
            "big pieces through UCX, small rows land in place; receiver: it copies everything, so no block "
            "waits for the sender process; sender: the sender writes big pieces too (docs/transports.md)"
        ),
    ] = "cma"
    tls: Annotated[
        bool,
        _doc(
            "tcp transfer links between nodes speak TLS with the --peer-*-file certificates (docs/security.md; "
            "its cost: docs/benchmarks.md)"
        ),
    ] = False
    ucx_read_lanes: Annotated[
        int,
        msgspec.Meta(ge=1, le=64),
        _doc(
            "ucx with cma: threads that read one large piece of a transfer together (the receiver's own "
            "and the rest from a thread pool); 1 reads on the receiver's thread alone"
        ),
    ] = 2

    def __post_init__(self) -> None:
        if self.heartbeat_interval >= self.progress_timeout:
            raise ValueError(
                f"heartbeat_interval ({self.heartbeat_interval}) must be below progress_timeout "
                f"({self.progress_timeout}), or idle links would time out"
            )


class ControlConfig(Section, frozen=True, kw_only=True):
    max_line_bytes: Annotated[
        int,
        msgspec.Meta(ge=1024, le=1 << 30),
        _doc("longest request line; a longer one closes its connection"),
    ] = 64 * MIB
    max_outbound_replies: Annotated[
        int,
        msgspec.Meta(ge=1, le=1 << 20),
        _doc("replies queued per client before its requests are cancelled as too slow"),
    ] = 1024
    client_write_timeout: Annotated[
        float,
        msgspec.Meta(gt=0, le=3600),
        _doc("seconds a reply write may stall before the client is dropped"),
    ] = 30.0
    control_token_file: Annotated[
        str | None,
        _doc(
            "a file holding the control socket's token: each connection's first line must be "
            '{"token": "..."}; required when --listen is not loopback (docs/security.md)'
        ),
    ] = None


class ShutdownConfig(Section, frozen=True, kw_only=True):
    drain_deadline: Annotated[
        float, msgspec.Meta(ge=0, le=3600), _doc("seconds in-flight requests get to finish at shutdown")
    ] = 30.0


class ControllerConfig(Section, frozen=True, kw_only=True):
    reject_loop: Annotated[bool, _doc("run the reject-KV loop that locks overloaded decode replicas")] = True
    reject_period: Annotated[float, msgspec.Meta(gt=0, le=60), _doc("seconds between reject-loop passes")] = (
        0.1
    )
    lock_ratio: Annotated[
        float, msgspec.Meta(gt=1, le=100), _doc("lock when used blocks exceed this times the others' mean")
    ] = 2.0
    lock_capacity_fraction: Annotated[
        float, msgspec.Meta(gt=0, le=1), _doc("... and exceed this fraction of the replica's own capacity")
    ] = 0.5
    unlock_hysteresis: Annotated[
        float, msgspec.Meta(ge=0, lt=1), _doc("unlock only below (1 - this) times both thresholds")
    ] = 0.1
    report_period: Annotated[
        float, msgspec.Meta(gt=0, le=3600), _doc("seconds between block, flow and GPU reports")
    ] = 1.0


class NodeConfig(Section, frozen=True, kw_only=True):
    listen: Annotated[str, _doc("control socket: HOST:PORT or unix:PATH")] = "127.0.0.1:7340"
    http: Annotated[
        str, _doc("OpenAI-compatible HTTP API: HOST:PORT (port 0: a free one) or off (docs/http-api.md)")
    ] = "127.0.0.1:8000"
    host: Annotated[
        NonEmpty | None,
        _doc("the HTTP API's host, in place of --http's (as vLLM's --host; default: --http's)"),
    ] = None
    port: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=65535)] | None,
        _doc("the HTTP API's port, in place of --http's (0: a free one; default: --http's)"),
    ] = None
    served_model_name: Annotated[
        NonEmpty | None,
        _doc(
            "the name(s) HTTP clients give as `model`, comma-separated; replies carry the first "
            "(default: the model's name)"
        ),
    ] = None
    max_model_len: Annotated[
        Annotated[int, msgspec.Meta(ge=2, le=1 << 24)] | None,
        _doc(
            "the context a request may fill, prompt + max_tokens; at most the model's (a larger value is "
            "refused at start, naming the model's) (default: the model's context)"
        ),
    ] = None
    seed: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None,
        _doc(
            "seeds the sampling of requests that give no seed of their own, in arrival order: a node "
            "started again with it samples the same requests the same (default: random)"
        ),
    ] = None
    chat_template: Annotated[
        NonEmpty | None,
        _doc("a Jinja chat template file (or the template itself) in place of the model's"),
    ] = None
    api_key: Annotated[
        str | None, _doc("when set, HTTP /v1 requests must send `Authorization: Bearer <key>`")
    ] = None
    tool_call_parser: Annotated[
        ToolCallParser | None,
        _doc(
            "parse HTTP replies for function calls when a request has tools and tool_choice auto: hermes "
            "(<tool_call> tags: Qwen2.5, Hermes) or llama3_json (Llama 3.x); without it such requests are "
            "refused (docs/http-api.md#tools)"
        ),
    ] = None
    disable_log_requests: Annotated[
        bool, _doc("no access line per HTTP request (on the console and in the log file)")
    ] = False
    model: Annotated[
        str,
        msgspec.Meta(min_length=1),
        _doc("`tiny` (built in), `smollm2` (a packaged GGUF), a .gguf file or a checkpoint directory"),
    ] = "tiny"
    model_cache: Annotated[
        str,
        msgspec.Meta(min_length=1),
        _doc(
            "where GGUF files are converted, once per content, to checkpoints (under gguf/); stale ones are pruned"
        ),
    ] = "~/.cache/zigzag"
    replicas: Annotated[
        ReplicaCounts | None,
        _doc(
            "replicas per role, e.g. prefill=1,decode=1 (default: the model's: encode=1 with a vision encoder)"
        ),
    ] = None
    device: Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda|cuda:[0-9]+)$"), _doc("cpu, cuda or cuda:N")] = (
        "cpu"
    )
    dtype: Annotated[
        Literal["auto", "float32", "float", "float16", "half", "bfloat16"] | None,
        _doc(
            "compute dtype, as vLLM spells it: auto (float32 on cpu, bfloat16 on cuda), float32 or float, "
            "float16 or half, bfloat16"
        ),
    ] = None
    tensor_parallel_size: Annotated[
        int,
        msgspec.Meta(ge=1, le=1024),
        _doc(
            "vLLM's option: 1 (a replica runs on one device; more replicas scale out, not tensor parallelism)"
        ),
    ] = 1
    gpu_memory_utilization: Annotated[
        float,
        msgspec.Meta(gt=0, le=1),
        _doc(
            "vLLM's option, in (0, 1]: on cuda, the share of the device's memory the node may fill; what "
            "the loaded weights and everything else in use leave of it sizes the KV pools, divided among "
            "the prefill and decode replicas (docs/gpu.md#kv-pool-sizing); --kv-pool-blocks wins over it; "
            "on cpu it does not apply"
        ),
    ] = 0.9
    transport: Annotated[
        TransportChoice,
        _doc("how replicas move blocks: inproc, tcp, ucx, cuda-ipc or auto (docs/transports.md)"),
    ] = "inproc"
    demo: Annotated[bool, _doc("start, run the built-in workload through the socket, report, exit")] = False
    faults: Annotated[
        list[Fault], _doc("fault-injection hooks, KIND:key=value,... (repeatable; off by default)")
    ] = msgspec.field(default_factory=list)
    emulated_speed: Annotated[
        EmulatedSpeed | None,
        _doc(
            "emulate accelerators for scaling benches: prefill_tokens_per_s=N,decode_steps_per_s=N,"
            "weights_gb_per_s=N, and per weight source peer_gb_per_s=N,host_gb_per_s=N,disk_gb_per_s=N "
            "(each optional; computes and copies are padded to it; docs/zigzag.md)"
        ),
    ] = None
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    kv: KvConfig = msgspec.field(default_factory=KvConfig)
    prefix: PrefixConfig = msgspec.field(default_factory=PrefixConfig)
    embedding: EmbeddingConfig = msgspec.field(default_factory=EmbeddingConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    control: ControlConfig = msgspec.field(default_factory=ControlConfig)
    shutdown: ShutdownConfig = msgspec.field(default_factory=ShutdownConfig)
    controller: ControllerConfig = msgspec.field(default_factory=ControllerConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    autoscale: AutoscaleConfig = msgspec.field(default_factory=AutoscaleConfig)
    executor: ExecutorConfig = msgspec.field(default_factory=ExecutorConfig)

    def __post_init__(self) -> None:
        if self.transfer.tls and (
            self.cluster.peer_cert_file is None or self.transport not in TLS_TRANSPORTS
        ):
            raise ValueError(
                "--transfer-tls encrypts the tcp transfer links of a cluster with the peer certificates: it "
                f"needs --peer-cert-file (and its CA and key) and --transport tcp, not {self.transport}"
            )
        if exposed(parse_address(self.listen)) and self.control.control_token_file is None:
            raise ValueError(
                f"the control socket on {self.listen} (--listen) is reachable from other hosts: give "
                "--control-token-file, or listen on a loopback address or a unix socket (docs/security.md)"
            )
        if parse_http(self.http) is None and (self.host is not None or self.port is not None):
            raise ValueError("--host and --port place the HTTP API, but --http is off")
        if self.served_model_name is not None and not self.served_model_names:
            raise ValueError(f"--served-model-name {self.served_model_name!r} names no model")
        problem = device_unavailable(self.device) or transport_unavailable(self.transport, device=self.device)
        if problem is not None:
            raise ValueError(problem)
        if self.replicas is not None and self.replicas.total == 0 and self.cluster.cluster is None:
            raise ValueError(
                f"--replicas {self.replicas}: no replica to start; only a node that joins a cluster "
                "(--cluster) may start with none, as capacity that `scale … node=` fills"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"--tensor-parallel-size {self.tensor_parallel_size}: zigzag runs each replica on one device "
                "and has no tensor parallelism; serve more with more replicas (--replicas, the scale op) "
                "or nodes, and leave the flag at 1"
            )
        if self.executor.batch_invariant and self.device == "cpu":
            raise ValueError("--batch-invariant runs Triton GPU kernels: it needs --device cuda")

    @property
    def compute_dtype(self) -> Literal["float32", "float16", "bfloat16"]:
        """`dtype` resolved: vLLM's synonyms mapped, `auto` (or none) by device."""
        match self.dtype:
            case None | "auto":
                return "float32" if self.device == "cpu" else "bfloat16"
            case "float32" | "float":
                return "float32"
            case "float16" | "half":
                return "float16"
            case "bfloat16":
                return "bfloat16"
            case _:
                assert_never(self.dtype)

    @property
    def listen_address(self) -> Address:
        return parse_address(self.listen)

    @property
    def http_address(self) -> tuple[str, int] | None:
        """Where the HTTP API listens: `--http`, its host and port replaced by `--host` and `--port`
        where given; None when it is off."""
        http = parse_http(self.http)
        if http is None:
            return None
        host, port = http
        return (
            host if self.host is None else self.host.strip("[]"),
            port if self.port is None else self.port,
        )

    @property
    def served_model_names(self) -> list[str]:
        """`--served-model-name`'s names, in order (empty when not given)."""
        names = (self.served_model_name or "").split(",")
        return list(dict.fromkeys(name.strip() for name in names if name.strip()))


def device_unavailable(device: str) -> str | None:
    """Why `--device` `device` cannot hold the model and pools here, as a sentence; None when it can (a
    node asked for a GPU it does not have fails at configuration, not with a traceback from torch)."""
    if device == "cpu":
        return None
    import torch  # not at import: `--help` and the config's tests load this module

    if torch.version.cuda is None:
        return (
            f"--device {device}: this torch ({torch.__version__}) is built without CUDA; "
            "install a CUDA build of torch, or use --device cpu"
        )
    count = torch.cuda.device_count()
    if count == 0:
        return (
            f"--device {device}: no CUDA device is visible (no GPU or driver, or CUDA_VISIBLE_DEVICES "
            "hides them); use --device cpu"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return f"--device {device}: this host has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


# Flag prefix per section: ``--kv-block-size`` but ``--max-batch-size`` and ``--max-line-bytes``.
FLAG_PREFIXES: Final[dict[str, str]] = {
    "log": "log-",
    "kv": "kv-",
    "prefix": "prefix-",
    "embedding": "embedding-",
    "scheduler": "",
    "transfer": "transfer-",
    "control": "",
    "shutdown": "shutdown-",
    "controller": "controller-",
    "cluster": "",
    "autoscale": "",
    "executor": "",
}


# vLLM's spellings of the same options (docs/configuration.md).
FLAG_ALIASES: Final[dict[str, tuple[str, ...]]] = {
    "scheduler.max_batch_size": ("--max-num-seqs",),
    "scheduler.max_batch_tokens": ("--max-num-batched-tokens",),
}


def parse_node_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> NodeConfig:
    """The node's config from `argv` (without the program name) and `environ` (the entry point passes
    ``os.environ``; None reads no environment). Raises `ConfigError`; ``--help`` exits 0 after printing
    every option with its default."""
    from engine.cli import load_config  # engine.cli builds on the types of `engine.config.base`

    return load_config(
        NodeConfig, FLAG_PREFIXES, argv, environ or {}, prog="python -m engine.node", aliases=FLAG_ALIASES
    )
