"""The shell commands the user-facing docs show, and how a test runs them here as written.

``commands()`` extracts every command from the fenced ```bash, ```sh and ```console blocks of README.md,
docs/*.md, examples/README.md and service/README.md, in document order: a logical line (``\\`` continuations
joined), its trailing ``  # comment`` dropped; in a console block only the ``$ `` lines. Every fence must name
its language (tests/test_docs_run.py::test_every_fence_names_its_language), so a command cannot hide in an
unlabeled block. ``inline_commands()`` extracts the commands pages name inline, outside those blocks (a figure's
benchmark command); tests/test_docs.py parses each without running it (tests/doc_parse_check.py).

``as_run_here(command, ctx)`` is the command a test runs. It changes only what would reach outside the test:

- ``. .venv/bin/activate`` sources the activate script of the virtualenv running the tests;
- the shared paths ``/tmp/...`` and ``/shared/...`` become the same paths under the test's private directory;
- ``127.0.0.1:8265`` and ``127.0.0.1:6379`` (a user's head node) become the private head's dashboard and GCS
  addresses, and ``ray start --head`` gets that head's private ``--temp-dir`` and free ports.

Limits: a command is keyed by its text alone, so the same command in two documents is covered once; the
rewriting above is textual, so a doc path spelled another way (``$TMPDIR``) is not redirected.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "examples" / "README.md",
    ROOT / "service" / "README.md",
]
SHELL_LANGS = ("bash", "sh", "console")
FENCE_RE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class DocCommand:
    doc: str  # relative to the repository root
    line: int  # of the command's first line
    text: str  # continuations joined, comment dropped, whitespace collapsed

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def fences(doc: Path) -> list[tuple[str, int, str]]:
    """(language, line of the opening fence, body) of every fenced block of a document."""
    text = doc.read_text()
    return [(m.group(1), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE_RE.finditer(text)]


def _strip_comment(line: str) -> str:
    """Drop a trailing ``#`` comment: one after whitespace, outside quotes (``torch://``, ``'#'`` survive)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(docs=DOCS) -> list[DocCommand]:
    found = []
    for doc in docs:
        for lang, fence_line, body in fences(doc):
            if lang not in SHELL_LANGS:
                continue
            pending, start = "", 0
            for offset, raw in enumerate(body.splitlines(), start=fence_line + 1):
                if lang == "console" and not pending:
                    if not raw.startswith("$ "):
                        continue
                    raw = raw[2:]
                line = _strip_comment(raw)
                if not pending:
                    start = offset
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                line = " ".join((pending + line).split())
                pending = ""
                if line:
                    found.append(DocCommand(str(doc.relative_to(ROOT)), start, line))
    return found


@dataclass
class Here:
    """Where a test runs doc commands: its private directory, and the private Ray head, if it started one."""

    tmp: Path
    dashboard: str | None = None  # "127.0.0.1:PORT"
    gcs: str | None = None
    head_flags: str = ""


def as_run_here(text: str, here: Here) -> str:
    text = re.sub(r"(?<![\w.])/(tmp|shared)/", lambda m: f"{here.tmp}/{m.group(1)}/", text)
    # after the /tmp rewrite: the test's own virtualenv may itself live under /tmp (a fresh clone, CI)
    activate = Path(sys.executable).with_name("activate")
    text = re.sub(r"(^|\s)\. \.venv/bin/activate\b", lambda m: f"{m.group(1)}. {activate}", text)
    if here.dashboard:
        text = text.replace("127.0.0.1:8265", here.dashboard)
    if here.gcs:
        text = text.replace("127.0.0.1:6379", here.gcs)
    if text.startswith("ray start --head"):
        text += " " + here.head_flags
    return text


def shell_env(extra: dict | None = None) -> dict:
    """The environment of a user whose virtualenv is active in the checkout: its bin first on PATH (``python``,
    ``zephon-ray``, ``ray``, ``torchrun``), the checkout first on PYTHONPATH (a worktree's code, not the editable
    install's)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


MARK = "@@zr-doc-command@@"


def run_in_order(cmds: list[DocCommand], here: Here, env: dict, timeout: float) -> list[tuple[DocCommand, str]]:
    """Run ``cmds`` in one bash (``set -e``: exports and variables carry over, as in a user's shell) from the
    repository root, and return each command with what it printed. A failing command fails with its output."""
    import subprocess

    script = "set -eo pipefail\n" + "".join(
        f"echo {MARK}{i}\n{as_run_here(c.text, here)}\n" for i, c in enumerate(cmds)
    )
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    parts = re.split(rf"^{MARK}(\d+)\n", done.stdout, flags=re.MULTILINE)
    outs = {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}
    last = max(outs, default=-1)
    assert done.returncode == 0, (
        f"{cmds[last] if last >= 0 else 'the script'} exited {done.returncode}:\n"
        f"{outs.get(last, '')[-3000:]}\n{done.stderr[-3000:]}"
    )
    return [(c, outs.get(i, "")) for i, c in enumerate(cmds)]


INLINE_RE = re.compile(r"`([^`\n]+)`")
INLINE_START = re.compile(r"^(zephon-ray|python (?:benchmarks|examples)/\w+\.py|\w+\.py)(?=\s|$)")


def inline_commands(docs=DOCS) -> list[DocCommand]:
    """The commands that pages name inline, outside fenced blocks: `zephon-ray ...`, `python benchmarks/x.py ...`,
    `python examples/x.py ...`, and a page's shorthand `bench_x.py ...` for a script of benchmarks/ (or examples/);
    each part of an ``&&`` chain separately. A span that is only a command's name (`zephon-ray audit`) is one too."""
    found = []
    for doc in docs:
        text = doc.read_text()
        prose = FENCE_RE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in INLINE_RE.finditer(prose):
            for part in m.group(1).split("&&"):
                part = " ".join(part.split())
                head = INLINE_START.match(part)
                if not head:
                    continue
                if head.group(1).endswith(".py") and not head.group(1).startswith("python "):
                    script = next(
                        (
                            f"{d}/{head.group(1)}"
                            for d in ("benchmarks", "examples")
                            if (ROOT / d / head.group(1)).is_file()
                        ),
                        None,
                    )
                    if script is None:
                        continue  # a module's file name (`node.py`), not a script
                    part = f"python {script}{part[head.end() :]}"
                found.append(DocCommand(str(doc.relative_to(ROOT)), prose.count("\n", 0, m.start()) + 1, part))
    return found
