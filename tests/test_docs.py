"""docs/ stays in step with the code: every relative link resolves, and every test, benchmark or example it cites
as evidence exists (down to ``file.py::test_name``)."""

from __future__ import annotations

import re

from conftest import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "service" / "README.md"]
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_RE = re.compile(r"\b((?:tests|benchmarks|examples)/[\w/]+\.py)(?:::(\w+))?")


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in LINK_RE.findall(doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_cited_tests_benchmarks_and_examples_exist():
    missing = []
    for doc in DOCS:
        for path, name in CITED_RE.findall(doc.read_text()):
            source = ROOT / path
            if not source.is_file():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
            elif name and not re.search(rf"^def {name}\b", source.read_text(), re.MULTILINE):
                missing.append(f"{doc.relative_to(ROOT)}: {path}::{name}")
    assert not missing, missing
