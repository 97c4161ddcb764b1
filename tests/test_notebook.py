"""examples/notebook.ipynb runs headless, top to bottom, on a private local Ray that the notebook starts itself, and
what it computes is right: checked against the independent oracle (tests/oracle.py), not against strings it prints.

The committed copy carries its outputs (built by scripts/build_notebook.py); this test executes it again with one
probe cell inserted before the last cell (which stops the service). The probe prints, as JSON, the values the
notebook computed: the 16 service batches' digests and per-source token shares it plots, the 90/10 variant's
digests, both fingerprints, the exported Parquet rows, and the mixture-schedule section's phased digests, phases and
shares. The test recomputes each of them with the oracle, which imports nothing from zephon_ray (the phased digests:
against the committed goldens, which test_oracle.py recomputes with it). If the notebook renames one of those variables, the probe fails with a NameError
naming it: update PROBE with the notebook.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path

import nbformat
import numpy as np
import oracle
import pytest
from conftest import RAY_START_TIMEOUT, TINY
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"
PHASED = Path(__file__).resolve().parents[1] / "recipes" / "phased.toml"
STEPS = 16  # the notebook's `steps = range(16)`
PROBE_MARK = "NOTEBOOK-PROBE "
PROBE = f"""import json as _json
print({PROBE_MARK!r} + _json.dumps({{
    "step3_digest": batch.digest, "step3_shape": list(batch.tokens.shape),
    "digests": [b.digest for b in batches], "names": list(names), "shares": shares.tolist(),
    "variant_digests": [b.digest for b in variant_batches],
    "fingerprints": [recipe.fingerprint, variant.fingerprint],
    "export_steps": table.column("step").to_pylist(), "export_digests": table.column("digest").to_pylist(),
    "phased_digests": [b.digest for b in phased_batches], "phased_phases": phased_phases,
    "phased_shares": phased_shares.tolist(),
}}))"""


def _text(cell) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def _pngs(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def test_committed_notebook_has_outputs_and_plots():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert _pngs(nb) >= 2, "commit the notebook executed (python scripts/build_notebook.py) so it reads on GitHub"


def _variant_toml(tmp_path: Path) -> Path:
    """The notebook's 90/10 variant of the tiny recipe, written for the oracle (which reads TOML itself)."""
    raw = tomllib.loads(TINY.read_text())
    text = TINY.read_text()
    for source, weight in zip(raw["sources"], (0.9, 0.1)):
        text = text.replace(
            f'path = "{source["path"]}"\nweight = {source["weight"]}',
            f'path = "{(TINY.parent / source["path"]).resolve()}"\nweight = {weight}',
        )
    assert text.count("weight = 0.9") == 1 and text.count("weight = 0.1") == 1, text
    out = tmp_path / "variant.toml"
    out.write_text(text)
    return out


def _execute(nb) -> None:
    """Run every cell (raises on any cell error). Only a notebook whose ``ray.init`` hit Ray's fixed start-up timeout
    runs once more, in a fresh kernel: that is the machine's load, not the notebook; any other error fails."""
    from nbclient.exceptions import CellExecutionError

    for attempt in (1, 2):
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs = []
        try:
            NotebookClient(
                nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
            ).execute()
            return
        except CellExecutionError as exc:
            if attempt == 2 or RAY_START_TIMEOUT not in str(exc):
                raise
            print("notebook: Ray did not start within its fixed 30 s; running the notebook once more")


@pytest.mark.heavy
@pytest.mark.spawns
@pytest.mark.timeout(900)
def test_notebook_executes_and_computes_what_the_oracle_computes(tmp_path):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    nb = copy.deepcopy(committed)
    last_code = max(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(last_code, nbformat.v4.new_code_cell(PROBE))
    _execute(nb)  # clears the committed outputs first
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    probe = json.loads(next(line for line in text.splitlines() if line.startswith(PROBE_MARK))[len(PROBE_MARK) :])

    tiny = oracle.read_recipe(TINY)
    want = oracle.global_batches(tiny, STEPS)
    golden = oracle.load_golden(TINY)["digests"]
    assert probe["step3_digest"] == want[3].digest == golden[3]
    assert probe["step3_shape"] == list(want[3].tokens.shape)
    assert probe["digests"] == [b.digest for b in want]
    names = tuple(s.name for s in tiny.sources)
    assert tuple(probe["names"]) == names
    expected_shares = [[b.source_share(names)[n] for n in names] for b in want]
    np.testing.assert_allclose(probe["shares"], expected_shares, rtol=0, atol=1e-12)

    variant = oracle.global_batches(oracle.read_recipe(_variant_toml(tmp_path)), STEPS)
    assert probe["variant_digests"] == [b.digest for b in variant]
    identical = sum(a.digest == b.digest for a, b in zip(want, variant))
    assert f"identical steps: {identical} of {STEPS}" in text
    assert probe["fingerprints"][0] != probe["fingerprints"][1]
    assert re.search(rf"fingerprints differ: {probe['fingerprints'][1][:12]} vs {probe['fingerprints'][0][:12]}", text)

    rows = tiny.rows
    assert sorted(probe["export_steps"]) == sorted(s for s in range(8) for _ in range(rows))
    assert all(d == want[s].digest for s, d in zip(probe["export_steps"], probe["export_digests"]))
    assert f"{8 * rows} rows written" in text

    assert "padding share over 16 steps: 0.0 " in text  # wrap packing: the oracle's rows hold no pad id either
    assert not any((b.tokens == oracle.make_tokenizer(tiny.tokenizer).pad_token_id).any() for b in want)
    # the mixture schedule section: each step's phase, and the rows of the phased recipe's committed goldens (which
    # test_oracle.py recomputes with the oracle; not again here: 7 s); anneal draws prose only: no code token
    assert probe["phased_digests"] == oracle.load_golden(PHASED)["digests"][:8]
    assert probe["phased_phases"] == ["sources", "sources", "main", "main", "anneal", "anneal", "anneal", "anneal"]
    assert [row[1] for row in probe["phased_shares"][4:]] == [0.0] * 4
    np.testing.assert_allclose([sum(row) for row in probe["phased_shares"]], [1.0] * 8, rtol=0, atol=1e-12)
    assert "no live cursor" in text  # dozens of notebook reads, and not one cursor that could hold a trainer back
    assert _pngs(nb) >= 2
