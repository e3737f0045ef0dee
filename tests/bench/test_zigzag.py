"""`python -m engine.bench zigzag --json --quick` runs end to end (four node processes and the weight-copy
node) and prints rows of the shape every benchmark prints. Only the shape is checked: no figure is
compared with a speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench.rows import Row

TTFT_CASES = {"burst3x-emulated", "burst3x-uncapped"}
MODEL_CASES = {  # the emulated runs against the ideal models of the same arrivals (baseline: the model)
    "burst3x-emulated-vs-ideal": "ideal-zigzag-model",
    "burst3x-emulated-vs-instant": "instant-model",
    "burst3x-emulated-stw-vs-model": "stop-the-world-model",
}
COPY_CASES = {"weights_copy_peer", "weights_copy_host", "weights_copy_disk"}


@pytest.mark.slow
def test_quick_run_prints_the_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "ttft.svg"
    command = [sys.executable, "-m", "engine.bench", "zigzag", "--json", "--quick"]
    command += ["--logs", str(tmp_path / "logs"), "--plot", str(picture)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=160)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert {field for r in rows for field in r} == set(Row.__struct_fields__)
    by_case: dict[str, set[str]] = {}
    for r in rows:
        by_case.setdefault(r["case"], set()).add(r["metric"])
        assert r["bench"] == "zigzag"
        assert math.isfinite(r["project"]) and math.isfinite(r["baseline"]) and r["project"] > 0
        assert r["ratio"] == pytest.approx(r["project"] / r["baseline"])
    assert by_case == {
        **{case: {"ttft_p50_s", "ttft_p99_s"} for case in TTFT_CASES | set(MODEL_CASES)},
        **{case: {"GB/s"} for case in COPY_CASES},
    }
    for r in rows:
        if r["case"] in MODEL_CASES:
            assert (r["better"], r["baseline_name"], r["unit"]) == ("lower", MODEL_CASES[r["case"]], "s")
            assert "each run's own copy" in r["note"]
        elif r["case"] in TTFT_CASES:
            assert (r["better"], r["baseline_name"], r["unit"]) == ("lower", "stop_the_world", "s")
            assert ("emulated" in r["note"]) == r["case"].endswith("-emulated")
        else:
            assert (r["better"], r["unit"]) == ("higher", "GB/s")
            assert r["baseline_name"] and "goal >= 0.8" in r["note"]
    p99 = next(r for r in rows if r["case"] == "burst3x-emulated" and r["metric"] == "ttft_p99_s")
    assert "goal <= 0.5" in p99["note"]
    assert picture.read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in (tmp_path / "logs").glob("burst3x-*.jsonl")) == [
        f"burst3x-{kind}-{mode}-1.jsonl"
        for kind in ("emulated", "uncapped")
        for mode in ("stop_the_world", "zigzag")
    ]
