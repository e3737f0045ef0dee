"""The tests wait only through `tests/waiting.py`: a scan of every test source, and the helpers' own tests.

The scan fails, naming file:line, on
- a bare polling loop: a `while` loop whose body sleeps or checkpoints (`trio.sleep`,
  `trio.lowlevel.checkpoint`, `time.sleep`, ...) — it waits for its condition with no deadline, and a
  condition it misses (a state that comes and goes between two looks) hangs the test until
  pytest-timeout's last net kills the worker, naming nothing. Poll with `wait_until` instead, or wait
  for a signal (an event, a channel) under `deadline`;
- a `while` loop that spins (its body only `pass`): the same, burning a core;
- a `for` loop that sleeps and breaks (or returns) on a condition: the same poll, bounded by a count;
- `trio.fail_after` / `trio.fail_at`: their `TooSlowError` names nothing; `deadline(what, seconds)`
  says what did not happen.

A loop that sleeps to pace itself, not to wait (a stream that yields between items), is written so
that it is no `while` loop, e.g. `for index in itertools.count():`.
"""

from __future__ import annotations

import ast
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.waiting import deadline, wait_until, wait_until_blocking

TESTS = Path(__file__).resolve().parent
HELPER = TESTS / "waiting.py"
# What a polling loop calls to wait between two looks, as written in the tests (module.function or a
# name imported from trio or time).
PAUSES = frozenset(
    {
        "trio.sleep",
        "trio.sleep_until",
        "trio.lowlevel.checkpoint",
        "trio.lowlevel.cancel_shielded_checkpoint",
        "trio.testing.wait_all_tasks_blocked",
        "wait_all_tasks_blocked",
        "checkpoint",
        "time.sleep",
        "sleep",
        "asyncio.sleep",
    }
)
UNNAMED_DEADLINES = frozenset({"trio.fail_after", "trio.fail_at", "fail_after", "fail_at"})


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _loop_body(loop: ast.While | ast.For | ast.AsyncFor) -> Iterator[ast.AST]:
    """Every node of the loop's body, but not of functions defined in it or of `while` loops nested in
    it (those are loops of their own)."""
    pending: list[ast.AST] = [*loop.body, *loop.orelse]
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef | ast.While):
            continue
        pending.extend(ast.iter_child_nodes(node))


def _pauses(loop: ast.While | ast.For | ast.AsyncFor) -> bool:
    return any(isinstance(node, ast.Call) and _dotted(node.func) in PAUSES for node in _loop_body(loop))


def _spins(loop: ast.While) -> bool:
    """A body of nothing but `pass` or `...`: it only looks at its condition, as fast as it can."""
    return all(
        isinstance(statement, ast.Pass)
        or (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))
        for statement in loop.body
    )


def _leaves_early(loop: ast.For | ast.AsyncFor) -> bool:
    """The loop's own `break` or a `return`: it stops once something it looked at holds."""
    return any(isinstance(node, ast.Return) for node in _loop_body(loop)) or any(
        isinstance(node, ast.Break) for node in _own_statements(loop.body)
    )


def _own_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a loop's body, into `if`/`with`/`try`/`match` blocks, not into nested loops."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.For | ast.AsyncFor | ast.While):
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(statement, field, [])
            for child in children:
                if isinstance(child, ast.ExceptHandler | ast.match_case):
                    yield from _own_statements(child.body)
                elif isinstance(child, ast.stmt):
                    yield from _own_statements([child])


def bad_waits(source: str, filename: str) -> list[str]:
    """`file:line: why` for each bare polling loop and unnamed deadline in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.While) and _pauses(node):
            found.append((node.lineno, "a while loop that sleeps or checkpoints (use wait_until)"))
        elif isinstance(node, ast.While) and _spins(node):
            found.append((node.lineno, "a while loop that spins (use wait_until_blocking)"))
        elif isinstance(node, ast.For | ast.AsyncFor) and _pauses(node) and _leaves_early(node):
            found.append((node.lineno, "a for loop that sleeps until it breaks (use wait_until)"))
        elif isinstance(node, ast.Call) and _dotted(node.func) in UNNAMED_DEADLINES:
            found.append((node.lineno, f"{_dotted(node.func)} names nothing (use deadline)"))
    return [f"{filename}:{line}: {why}" for line, why in sorted(found)]


def test_no_test_polls_or_waits_without_a_named_deadline() -> None:
    found = [
        problem
        for path in sorted(TESTS.rglob("*.py"))
        if path != HELPER
        for problem in bad_waits(path.read_text(), str(path.relative_to(TESTS.parent)))
    ]
    assert not found, "waits outside tests/waiting.py:\n" + "\n".join(found)


# ---------------------------------------------------------------------- the scan finds what it should
BAD = {
    "checkpoint loop": """
        async def f(session):
            while not session.ready:  # found
                await checkpoint()
    """,
    "sleep loop in a deadline": """
        async def f(pool):
            with trio.move_on_after(5):
                while pool.quarantined_blocks:  # found
                    if pool.used_blocks:
                        await trio.sleep(0.01)
    """,
    "imported checkpoint": """
        from trio.lowlevel import checkpoint
        async def f(box):
            while not box:  # found
                await checkpoint()
    """,
    "blocking loop": """
        def f(child):
            while child.poll() is None:  # found
                time.sleep(0.05)
    """,
    "counted poll": """
        async def f(events):
            for _ in range(100):  # found
                if events():
                    break
                await trio.sleep(0.1)
    """,
    "spin": """
        def f(child):
            while child.poll() is None:  # found
                pass
    """,
    "unnamed deadline": """
        async def f(event):
            with trio.fail_after(10):  # found
                await event.wait()
    """,
}
GOOD = {
    "signalled wait": """
        async def f(changed, rounds):
            with deadline("two rounds", 10):
                while len(rounds) < 2:
                    await changed.wait()
    """,
    "helper": """
        async def f(pool):
            await wait_until(lambda: not pool.quarantined_blocks, "every block released", 5)
    """,
    "a reader loop": """
        async def f(stream, buffer):
            while b"\\n" not in buffer:
                buffer += await stream.receive_some()
    """,
    "a paced stream": """
        async def f(send):
            for index in itertools.count():
                send(index)
                await trio.sleep(0)
    """,
    "a fixed pause": """
        async def settle():
            for _ in range(20):
                await trio.sleep(0.01)
    """,
    "a sleep in a function defined in a loop": """
        async def f(nursery, items):
            while items:
                async def later():
                    await trio.sleep(1)
                nursery.start_soon(later)
                items.pop()
    """,
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_scan_finds_a_bare_wait(name: str) -> None:
    """Each bad example has one problem, on the line marked `# found`."""
    source = textwrap.dedent(BAD[name])
    (marked,) = [number for number, line in enumerate(source.splitlines(), 1) if line.endswith("# found")]
    (problem,) = bad_waits(source, "example.py")
    assert problem.startswith(f"example.py:{marked}: ")


@pytest.mark.parametrize("name", sorted(GOOD))
def test_the_scan_passes_a_named_or_signalled_wait(name: str) -> None:
    assert bad_waits(textwrap.dedent(GOOD[name]), "example.py") == []


# ---------------------------------------------------------------------- the helpers
async def test_wait_until_returns_what_the_condition_found() -> None:
    box: list[int] = []

    async def fill() -> None:
        await trio.sleep(0.05)
        box.append(7)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fill)
        assert await wait_until(lambda: box, "the box filled", 10) == [7]


async def test_wait_until_takes_an_async_condition() -> None:
    looks = []

    async def third_look() -> bool:
        looks.append(1)
        await trio.lowlevel.checkpoint()
        return len(looks) >= 3

    assert await wait_until(third_look, "a third look", 10, interval=0) is True
    assert len(looks) == 3


async def test_wait_until_names_what_did_not_happen_and_the_state_last_seen() -> None:
    with pytest.raises(
        AssertionError, match=r"^the pool emptied did not happen within 0.1 s; 3 blocks held$"
    ):
        await wait_until(lambda: False, "the pool emptied", 0.1, detail=lambda: "3 blocks held")


async def test_on_a_mock_clock_the_deadline_is_virtual(autojump_clock: trio.testing.MockClock) -> None:
    """Under `autojump_clock` the seconds are the run's: a condition trio's tasks meet after 100 virtual
    seconds is met within a 200 s wait, and one never met fails after 200 virtual seconds, at once."""
    start = trio.current_time()

    async def later(box: list[int]) -> None:
        await trio.sleep(100)
        box.append(1)

    box: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(later, box)
        await wait_until(lambda: box, "the box filled", 200, interval=1)
    assert 100 <= trio.current_time() - start < 102
    with pytest.raises(AssertionError, match="never did not happen within 200 s"):
        await wait_until(lambda: False, "never", 200)
    assert trio.current_time() - start >= 300


async def test_deadline_names_the_signal_that_did_not_come() -> None:
    never = trio.Event()
    with (
        pytest.raises(AssertionError, match=r"^the handler to start did not happen within 0.05 s$"),
        deadline("the handler to start", 0.05),
    ):
        await never.wait()
    ready = trio.Event()
    ready.set()
    with deadline("ready", 0.05):
        await ready.wait()


async def test_an_inner_deadline_that_runs_out_first_is_its_own_failure() -> None:
    with (
        pytest.raises(AssertionError, match=r"^inner did not happen"),
        deadline("outer", 10),
        deadline("inner", 0.01),
    ):
        await trio.sleep_forever()


def test_wait_until_blocking_uses_real_time() -> None:
    started = time.monotonic()
    assert wait_until_blocking(lambda: time.monotonic() - started > 0.05, "a twentieth of a second", 5)
    with pytest.raises(
        AssertionError, match=r"^a child process exiting did not happen within 0.05 s; pid 1$"
    ):
        wait_until_blocking(lambda: False, "a child process exiting", 0.05, detail=lambda: "pid 1")
