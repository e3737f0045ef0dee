"""The node's typed config: TOML < environment < flags, errors that name option, source and value, --help."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cli import format_default, options
from engine.config import FLAG_PREFIXES, ConfigError, NodeConfig, ReplicaCounts, parse_node_config
from engine.config.address import TcpAddress, UnixAddress
from messages.faults import CorruptTransfer, DropLink, FailReplica, StallSender

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_defaults() -> None:
    config = parse_node_config([])
    assert config == NodeConfig()
    assert config.listen_address == TcpAddress(host="127.0.0.1", port=7340)
    assert (config.model, config.replicas, config.device, config.transport) == ("tiny", None, "cpu", "inproc")
    assert (config.kv.block_size, config.kv.pool_blocks) == (16, None)
    assert (
        config.embedding.block_size,
        config.embedding.default_blocks,
        config.embedding.max_grant_blocks,
    ) == (
        128,
        8,
        None,
    )
    assert config.control.max_line_bytes == 64 * 1024 * 1024
    assert config.faults == []


def test_toml_then_environment_then_flags(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text(
        'listen = "unix:/tmp/zz.sock"\nreplicas = "prefill=2,decode=1"\n'
        "[kv]\nblock_size = 32\npool_blocks = 100\n"
        '[log]\nlevel = "debug"\n'
        '[[faults]]\nkind = "stall_sender"\nreplica = "prefill-0"\nseconds = 0.5\n'
    )
    environ = {
        "ZIGZAG_KV_BLOCK_SIZE": "64",
        "ZIGZAG_MAX_QUEUE": "7",
        "ZIGZAG_CONFIG": str(toml),
        "OTHER": "x",
    }
    config = parse_node_config(["--kv-block-size", "8", "--no-log-console"], environ)
    assert config.listen_address == UnixAddress(path="/tmp/zz.sock")
    assert config.replicas == ReplicaCounts(prefill=2, decode=1)
    assert (config.kv.block_size, config.kv.pool_blocks) == (8, 100)  # flag beats environment beats file
    assert config.scheduler.max_queue == 7
    assert (config.log.level, config.log.console) == ("debug", False)
    assert config.faults == [StallSender(replica="prefill-0", seconds=0.5)]
    # --config beats $ZIGZAG_CONFIG; a table works for replicas too.
    other = tmp_path / "other.toml"
    other.write_text("[replicas]\nencode = 1\ndecode = 2\n")
    assert parse_node_config(["--config", str(other)], environ).replicas == ReplicaCounts(encode=1, decode=2)


def test_fault_flags_replace_the_files_faults(tmp_path: Path) -> None:
    config = parse_node_config(
        [
            "--fault",
            "fail_replica:replica=decode-0,after_steps=3",
            "--fault",
            "drop_link:source=prefill-0,destination=decode-0",
            "--fault",
            "corrupt_transfer:transfer=kv,nth=2",
        ]
    )
    assert config.faults == [
        FailReplica(replica="decode-0", after_steps=3),
        DropLink(source="prefill-0", destination="decode-0", after_bytes=0),
        CorruptTransfer(transfer="kv", nth=2),
    ]


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (
            ["--kv-block-size", "abc"],
            {},
            "--kv-block-size (kv.block_size): bad value 'abc' from the command line: Expected `int`, got `str`",
        ),
        (
            ["--kv-block-size", "0"],
            {},
            "--kv-block-size (kv.block_size): bad value '0' from the command line: Expected `int` >= 1",
        ),
        (
            [],
            {"ZIGZAG_MAX_LINE_BYTES": "12"},
            "--max-line-bytes (control.max_line_bytes): bad value '12' from $ZIGZAG_MAX_LINE_BYTES: Expected `int` >= 1024",
        ),
        (
            ["--replicas", "gpu=1"],
            {},
            "--replicas (replicas): bad value 'gpu=1' from the command line: unknown role 'gpu'; roles are encode, prefill, decode",
        ),
        (
            ["--replicas", "prefill=1,prefill=2"],
            {},
            "--replicas (replicas): bad value 'prefill=1,prefill=2' from the command line: role 'prefill' is given twice",
        ),
        (
            ["--replicas", "prefill"],
            {},
            "--replicas (replicas): bad value 'prefill' from the command line: 'prefill' is not ROLE=COUNT (e.g. prefill=1)",
        ),
        (
            ["--replicas", "decode=0"],
            {},
            "[node] options: --replicas encode=0,prefill=0,decode=0: no replica to start; only a node that joins "
            "a cluster (--cluster) may start with none, as capacity that `scale … node=` fills",
        ),
        (
            ["--listen", "7340"],
            {},
            "--listen (listen): bad value '7340' from the command line: address '7340': expected HOST:PORT (e.g. 127.0.0.1:7340) or unix:PATH",
        ),
        (
            ["--listen", "host:99999"],
            {},
            "--listen (listen): bad value 'host:99999' from the command line: address 'host:99999': port '99999' is not a number from 0 to 65535",
        ),
        (
            ["--device", "tpu"],
            {},
            "--device (device): bad value 'tpu' from the command line: Expected `str` matching regex '^(cpu|cuda|cuda:[0-9]+)$'",
        ),
        (
            ["--transport", "pigeon"],
            {},
            "--transport (transport): bad value 'pigeon' from the command line: Invalid enum value 'pigeon'; choices: auto, cuda-ipc, inproc, tcp, ucx",
        ),
        (
            ["--fault", "explode:now=1"],
            {},
            "--fault (faults): bad value ['explode:now=1'] from the command line: unknown fault kind 'explode'; kinds are fail_replica, drop_link, stall_sender, corrupt_transfer, hold_weights, block_keepalive",
        ),
        (
            ["--fault", "fail_replica:after_steps=2"],
            {},
            "--fault (faults): bad value 'fail_replica:after_steps=2' from the command line (at [0]): Object missing required field `replica`",
        ),
        (
            ["--transfer-heartbeat-interval", "60"],
            {},
            "[transfer] options: heartbeat_interval (60.0) must be below progress_timeout (30.0), or idle links would time out (given: transfer.heartbeat_interval='60' from the command line)",
        ),
        (
            ["--embedding-pool-blocks", "4"],
            {},
            "[embedding] options: default_blocks (8) exceeds pool_blocks (4): the round-0 grant could never be allocated (given: embedding.pool_blocks='4' from the command line)",
        ),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag (see --help)"),
        (
            [],
            {"ZIGZAG_CONFIG": "/nonexistent/node.toml"},
            "config file '/nonexistent/node.toml': No such file or directory",
        ),
    ],
)
def test_errors_name_option_source_and_value(argv: list[str], environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_node_config(argv, environ)
    assert str(info.value) == message


def test_toml_errors(tmp_path: Path) -> None:
    cases = {
        "[kv]\nblok_size = 4\n": "unknown option 'kv.blok_size'; did you mean 'kv.block_size'?",
        "[kv]\nblock_size = -4\n": "--kv-block-size (kv.block_size): bad value -4 from {path}: Expected `int` >= 1",
        "model = \n": "is not valid TOML: Invalid value (at line 1, column 9)",
        "kv = 5\n": "'kv' is a section, a table of options: write [kv] and its keys below it "
        "(e.g. block_size = ...), not a number",
        "[[kv]]\nblock_size = 4\n": "'kv' is a section, a table of options: write [kv] and its keys below it "
        "(e.g. block_size = ...), not an array",
        '[[faults]]\nkind = "fail_replica"\nreplica = "Decode 0"\n': "--fault (faults): bad value {{'kind': "
        "'fail_replica', 'replica': 'Decode 0'}} from {path} (at [0].replica): Expected `str` matching regex",
    }
    for text, expected in cases.items():
        path = tmp_path / "bad.toml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            parse_node_config(["--config", str(path)])
        assert expected.format(path=path) in str(info.value), str(info.value)


def test_a_toml_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'model = "tiny"\n# caf\xe9\n')
    with pytest.raises(ConfigError) as info:
        parse_node_config(["--config", str(path)])
    assert (
        str(info.value) == f"config file {str(path)!r} is not valid TOML: not UTF-8 (byte 0xe9 at offset 20)"
    )


def test_help_lists_every_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_node_config(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for option in options(NodeConfig, FLAG_PREFIXES):
        assert option.flag in text
        if option.repeatable:  # read from flags and TOML only
            assert f"; {option.toml_key})" in text and f"${option.env}" not in text
        else:
            assert f"{option.toml_key}, ${option.env})" in text
        if "default:" not in option.description:
            assert f"default: {format_default(option)}; {option.toml_key}" in text


def test_every_option_is_documented() -> None:
    docs = DOCS.read_text()
    for option in options(NodeConfig, FLAG_PREFIXES):
        row = rf"| `{option.flag}` | `{option.toml_key}` | `{format_default(option)}` |"
        assert row in docs, f"docs/configuration.md lacks the row {row!r}"


def test_a_device_this_host_lacks_is_refused_at_configuration() -> None:
    """`--device cuda` without a usable GPU fails with the reason and what to do, not a torch traceback
    at startup; on a GPU host the same holds for an index past the last device."""
    import torch

    device, count = "cuda", torch.cuda.device_count() if torch.version.cuda else 0
    if torch.version.cuda is None:
        reason = f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch, or use --device cpu"
    elif count == 0:
        reason = "no CUDA device is visible (no GPU or driver, or CUDA_VISIBLE_DEVICES hides them); use --device cpu"
    else:
        device = f"cuda:{count}"
        reason = f"this host has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    with pytest.raises(ConfigError) as info:
        parse_node_config(["--device", device, "--transport", "cuda-ipc"])
    assert str(info.value) == f"[node] options: --device {device}: {reason}"
    assert parse_node_config(["--device", "cpu"]).device == "cpu"


def test_vllm_spellings_of_dtype_and_batch_limits() -> None:
    """`--dtype` takes vLLM's synonyms; `--max-num-seqs` and `--max-num-batched-tokens` set the batch
    limits; `--tensor-parallel-size` is accepted at 1 and refused otherwise, saying why."""
    spelled = {"auto": "float32", "float": "float32", "half": "float16", "bfloat16": "bfloat16"}
    for flag, resolved in spelled.items():
        assert parse_node_config(["--dtype", flag]).compute_dtype == resolved
    assert parse_node_config([]).compute_dtype == "float32"
    config = parse_node_config(["--max-num-seqs", "8", "--max-num-batched-tokens", "1024"])
    assert (config.scheduler.max_batch_size, config.scheduler.max_batch_tokens) == (8, 1024)
    assert parse_node_config(["--tensor-parallel-size", "1"]).tensor_parallel_size == 1
    with pytest.raises(
        ConfigError, match=r"--tensor-parallel-size 2: zigzag runs each replica on one device"
    ):
        parse_node_config(["--tensor-parallel-size", "2"])
