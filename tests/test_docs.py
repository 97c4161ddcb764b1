"""The docs stay in step with the code.

- Every relative link in README.md, docs/ and examples/README.md resolves, and every #anchor names a heading.
- Every test, benchmark or example cited as evidence (down to ``file.py::test_name``) exists, in those documents and
  in every module docstring of the package.
- Every command the README shows parses: each ``zephon-ray <subcommand>`` and ``python <script>`` answers
  ``--help``, each ``make <target>`` is a target of the Makefile.
- Every command a page names inline (a figure's benchmark command, `zephon-ray bench RECIPE`) parses as written. Running every doc command as written, or saying
  why it cannot run here, is tests/test_docs_run.py's job.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT

README = ROOT / "README.md"
DOCS = [README, ROOT / "examples" / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
MODULES = sorted((ROOT / "zephon_ray").rglob("*.py"))
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_RE = re.compile(r"\b((?:tests|benchmarks|examples)/[\w/]+\.py)(?:::(\w+))?")
FENCE_RE = re.compile(r"```bash\n(.*?)```", re.DOTALL)
COMMANDS = ("zephon-ray", "python", "make")


def _docstrings(path) -> str:
    tree = ast.parse(path.read_text())
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "\n".join(ast.get_docstring(n) or "" for n in nodes)


def _cited(text: str, where: str) -> list[str]:
    missing = []
    for path, name in CITED_RE.findall(text):
        source = ROOT / path
        if not source.is_file():
            missing.append(f"{where}: {path}")
        elif name and not re.search(rf"^(?:async )?def {name}\b", source.read_text(), re.MULTILINE):
            missing.append(f"{where}: {path}::{name}")
    return missing


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in LINK_RE.findall(doc.read_text()):
            if "://" not in target and not target.startswith("mailto:") and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


ANCHOR_RE = re.compile(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)")


def _slugs(doc) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return {
        re.sub(r"[^\w\- ]", "", m.lower()).replace(" ", "-")
        for m in re.findall(r"^#+\s+(.+?)\s*$", doc.read_text(), re.MULTILINE)
    }


def test_anchors_name_a_heading():
    broken = []
    for doc in DOCS:
        for target, anchor in ANCHOR_RE.findall(doc.read_text()):
            page = (doc.parent / target) if target else doc
            if page.is_file() and anchor not in _slugs(page):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken


def test_cited_tests_benchmarks_and_examples_exist():
    missing = []
    for doc in DOCS:
        missing += _cited(doc.read_text(), str(doc.relative_to(ROOT)))
    for module in MODULES:
        missing += _cited(_docstrings(module), str(module.relative_to(ROOT)))
    assert not missing, missing


def _readme_commands() -> list[list[str]]:
    """The commands in the README's ```bash blocks, as argv lists (comments and continuations handled)."""
    commands = []
    for block in FENCE_RE.findall(README.read_text()):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"\s*(?:&&|;)\s*", line):
                if part.split(" ", 1)[0] in COMMANDS:
                    commands.append(shlex.split(part))
    return commands


def test_readme_is_short_and_shows_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert any(c[:2] == ["make", "test"] for c in _readme_commands())
    assert any(c[:2] == ["make", "demo"] for c in _readme_commands())


@pytest.mark.parametrize("argv", _readme_commands(), ids=lambda argv: " ".join(argv[:3]))
def test_every_readme_command_runs(argv):
    if argv[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert argv[1] in targets, f"make {argv[1]}: no such target in the Makefile"
        return
    if argv[0] == "zephon-ray":
        subcommand = [a for a in argv[1:2] if not a.startswith("-")]
        cmd = [sys.executable, "-m", "zephon_ray.cli", *subcommand, "--help"]
    else:
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]}: no such script"
        cmd = [sys.executable, str(script), "--help"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)} --help exited {done.returncode}: {done.stderr[-500:]}"
    assert "usage" in done.stdout.lower(), done.stdout[:300]


PLACEHOLDER_RE = re.compile(r"^[A-Z][A-Z0-9_]*(?::[A-Z][A-Z0-9_]*)?$")  # RECIPE, DIR, S, A:N, STATE_DIR


def test_inline_doc_commands_parse():
    """Every command a page names inline (`zephon-ray bench RECIPE`, a benchmark's `python benchmarks/x.py --rounds
    2`, a page's shorthand `bench_x.py --parts calls`) parses as written: its subcommand, flags and values, without
    running it (tests/doc_parse_check.py). Running the fenced commands is tests/test_docs_run.py's job; these name
    measurements that take minutes to hours.

    Accepted as written: a span that names a command or one of its flags without the rest (``zephon-ray audit``,
    ``zephon-ray serve --materialized-dir DIR``: only required arguments missing), a placeholder in capitals in a
    value's place (``--step S``), and an elided span (``...``). A script that does not use argparse only has to
    exist."""
    import doc_commands

    argvs, missing, where = [], [], {}
    for command in doc_commands.inline_commands():
        if "..." in command.text:
            continue
        argv = shlex.split(command.text)
        if argv[0] == "python":
            script = ROOT / argv[1]
            if not script.is_file():
                missing.append(f"{command}: no such script")
                continue
            if "ArgumentParser" not in script.read_text():
                continue
        argvs.append(argv)
        where.setdefault(" ".join(argv), command)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "doc_parse_check.py")],
        input=json.dumps(argvs),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = []
    for text, error in json.loads(done.stdout).items():
        placeholders = [t for t in shlex.split(text) if PLACEHOLDER_RE.match(t)]
        if "the following arguments are required" in error or any(f"'{p}'" in error for p in placeholders):
            continue
        failed.append(f"{where[text]}: {error}")
    assert not missing + failed, missing + failed


def test_api_md_lists_every_public_name():
    """docs/api.md gives every public name its stability: zephon_ray.__all__, the service's, TorchTitan's and Ray
    Train's exports and every command, each in backticks in a table row that names a level."""
    import argparse

    import zephon_ray
    import zephon_ray.service
    import zephon_ray.torchtitan
    from zephon_ray import ray_train
    from zephon_ray.cli import build_parser

    rows = [
        line
        for line in (ROOT / "docs" / "api.md").read_text().splitlines()
        if line.startswith("| `") and re.search(r"\| (stable|beta|alpha) \|", line)
    ]
    listed = {name for line in rows for name in re.findall(r"`([\w-]+)[`(]", line.split("|")[1])}
    commands = [
        name
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]
    public = {
        *zephon_ray.__all__,
        *zephon_ray.service.__all__,
        *zephon_ray.torchtitan.__all__,
        *ray_train.__all__,
        *commands,
    }
    assert not sorted(public - listed), f"docs/api.md does not list {sorted(public - listed)}"


def _layout_entries() -> dict[str, str]:
    """README's "## Layout" block as {package directory: the text that describes it}."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    entries: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, path) of the directories above the current line
    current = None
    for line in block.splitlines():
        head = line.split()[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if head.endswith("/") and indent < 20:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            current = "/".join([p for _, p in stack] + [head.rstrip("/")])
            stack.append((indent, head.rstrip("/")))
            entries[current] = line[len(head) + indent :]
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def test_the_readme_layout_names_every_package_and_module_of_the_tree():
    """The README's layout block is the map a new engineer reads: every package of zephon_ray is an entry, and each
    entry names every module in its package, so a module added or renamed without the map fails here."""
    entries = _layout_entries()
    packages = sorted(
        str(p.parent.relative_to(ROOT)) for p in (ROOT / "zephon_ray").rglob("__init__.py") if "assets" not in p.parts
    )
    missing_packages = [p for p in packages if p not in entries and p.rsplit("/", 1)[0] not in entries]
    assert not missing_packages, f"packages the README's layout does not show: {missing_packages}"
    unnamed = []
    for package, words in entries.items():
        if not package.startswith("zephon_ray"):
            continue
        named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", words))
        for module in sorted((ROOT / package).glob("*.py")):
            if module.stem not in ("__init__", "__main__") and module.stem not in named:
                unnamed.append(f"{package}/{module.name}")
    assert not unnamed, f"modules the README's layout does not name in their package's entry: {unnamed}"
