"""The two trees a comparison runs: this checkout as it is, and a revision exported beside it."""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

# The repository's root: engine/bench/compare/trees.py → four levels up.
ROOT: Final = Path(__file__).resolve().parents[3]


@final
@dataclass(frozen=True, slots=True)
class Tree:
    """A tree whose code a benchmark runs: `label` names it in the rows, `path` holds its packages."""

    label: str
    path: Path


class RevisionError(Exception):
    """A revision that git cannot resolve or export (the message says which and why)."""


def resolve(rev: str, *, root: Path = ROOT) -> str:
    """The commit `rev` names (raises `RevisionError`)."""
    done = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RevisionError(f"git cannot resolve {rev!r} to a commit in {root}")
    return done.stdout.strip()


@contextmanager
def exported(rev: str, *, root: Path = ROOT) -> Iterator[Tree]:
    """The files of commit `rev` in a temporary directory (`git archive`: no worktree to clean up in
    the repository), removed on exit."""
    commit = resolve(rev, root=root)
    with tempfile.TemporaryDirectory(prefix=f"zigzag-{commit[:10]}-") as tmp:
        archive = Path(tmp) / "tree.tar"
        done = subprocess.run(
            ["git", "archive", "--format=tar", "-o", str(archive), commit],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RevisionError(f"git archive {commit[:10]} failed: {done.stderr.strip()}")
        path = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(path, filter="data")
        archive.unlink()
        yield Tree(label=rev, path=path)


def current(*, root: Path = ROOT) -> Tree:
    """This checkout, uncommitted changes included."""
    return Tree(label="this tree", path=root)
