"""Build examples/notebook.ipynb from the cells below, then execute it headless (nbclient) and save the outputs.

    python scripts/build_notebook.py            # rebuild + execute + write examples/notebook.ipynb

The committed notebook carries its outputs so that it reads well on GitHub; tests/test_notebook.py executes the
committed copy again on a private local Ray and checks that every cell runs and the plots render.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"

CELLS: list[tuple[str, str]] = [
    ("markdown", """# zephon-ray in a notebook

Look at what a training run will see, step by step, without disturbing the run.

- start (or connect to) a data service on a Ray cluster;
- look at a global batch and decode its rows;
- plot the per-source token share over steps, document lengths and packing;
- compare two recipes' batches;
- export steps to a Ray Dataset and to Parquet;
- the service's `status()` as a table.

**Reads made here never move a training job's cursor**: `DataService.batch()` and `to_dataset()` are ad-hoc reads
that register no cursor unless you pass `track=True`, so this notebook cannot hold a trainer's window back. The
status table at the end shows "no live cursor" after all the reads above (`tests/test_notebook.py`,
`tests/test_window.py::test_untracked_reads_never_move_the_window`)."""),
    ("code", """import logging
import warnings

import ray
import ray.data

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm without ipywidgets
ray.data.DataContext.get_current().enable_progress_bars = False
logging.getLogger("ray.data").setLevel(logging.WARNING)             # keep Ray Data's progress log out of the cells

# The one-liner for a notebook on your laptop: a private local Ray that this kernel starts and owns.
# On a cluster, use ray.init() (inside a Ray job or head node) or ray.init("ray://head:10001").
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
         logging_level=logging.ERROR)"""),
    ("code", """from pathlib import Path
import tempfile

from zephon_ray import DataService, GlobalBatchSource, Recipe
from zephon_ray.tokenizers import build_tokenizer

RECIPE = Path("../recipes/tiny.toml")      # the committed fixture recipe: 8 lanes, 16 rows x 65 tokens per step
recipe = Recipe.from_toml(RECIPE)
print(recipe.describe())
print(f"lanes L={recipe.lanes}, rows per step B={recipe.global_batch_rows}, seq_len={recipe.seq_len}, "
      f"tokens per step={recipe.tokens_per_step}")"""),
    ("markdown", """## Start a service

`DataService.start` launches a named, detached coordinator and M producer actors. From another notebook, job or
Ray Train worker of the same cluster, `DataService.connect(name, namespace=...)` finds it."""),
    ("code", """svc = DataService.start(recipe, name="notebook-demo", namespace="zr-notebook", producers=2, window=4,
                        run_id="notebook-demo", aggregate_store="torch://",  # 2 producers meet in a TCPStore
                        state_dir=tempfile.mkdtemp(prefix="zr-notebook-"))
svc.status()["producers"]"""),
    ("markdown", """## Look at one step

`batch(s)` is global batch `s`: all B rows in canonical lane-major order. Its digest is the sha256 that every
delivery path (in-process, service, materialised) agrees on."""),
    ("code", """batch = svc.batch(3)
tokenizer = build_tokenizer(recipe.tokenizer)
print("step", batch.step, "digest", batch.digest)
print("rows", batch.tokens.shape, "per-source token share", {k: round(v, 3) for k, v in batch.source_share().items()})
for row in range(2):
    print(f"--- row {row} (lane {batch.lanes[row]}) ---")
    print(tokenizer.decode(batch.tokens[row])[:300])"""),
    ("code", """with GlobalBatchSource(recipe) as local:          # the in-process path: same rows, same digest
    assert local.batch(3).digest == batch.digest
print("service == in-process:", True)"""),
    ("markdown", """## Mixture and packing over steps"""),
    ("code", """import numpy as np
import matplotlib.pyplot as plt

steps = range(16)
batches = [svc.batch(s) for s in steps]
names = recipe.source_names
shares = np.array([[b.source_share()[n] for n in names] for b in batches])

def document_lengths(b):
    # positions restart at 0 at every document start; a row's documents are the runs between restarts
    lengths = []
    for pos in b.positions:
        starts = np.flatnonzero(pos == 0)
        edges = np.append(starts, len(pos))
        lengths.extend(np.diff(edges)[edges[:-1] >= 0])
    return np.array(lengths)

def documents_per_row(b):
    return (b.positions == 0).sum(axis=1)

def padding_share(b):
    return 0.0 if b.pad_token_id is None else float((b.tokens == b.pad_token_id).mean())

fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
axes[0].stackplot(list(steps), shares.T, labels=names)
tokens = np.array([[b.source_tokens[n] for n in names] for b in batches])
cumulative = tokens.cumsum(axis=0)[:, 0] / tokens.cumsum(axis=0).sum(axis=1)
axes[0].plot(list(steps), cumulative, color="black", linestyle="--", label=f"{names[0]}, all steps so far")
axes[0].set(title="per-source token share", xlabel="step", ylabel="share", ylim=(0, 1))
axes[0].legend(loc="upper right")
axes[1].hist(np.concatenate([document_lengths(b) for b in batches]), bins=30, color="tab:green")
axes[1].set(title="document pieces per row (tokens)", xlabel="tokens", ylabel="count")
axes[2].hist(np.concatenate([documents_per_row(b) for b in batches]), bins=range(0, 6), color="tab:purple")
axes[2].set(title="packing: documents starting per row", xlabel="documents", ylabel="rows")
print("padding share over 16 steps:", max(padding_share(b) for b in batches), "(wrap packing fills every row)")
fig.tight_layout()"""),
    ("markdown", """**Reading the share plot.** The recipe's weights (`prose` 0.6, `code` 0.4) are over *records*, not tokens.
A step of this tiny recipe holds only 16 rows of 65 tokens, while one code record (a whole Python module) runs to
thousands of tokens, so a single code record can fill every row of several steps in a row: those steps show 0 %
prose. That is the recipe doing what it says, not a bug. The dashed line, the prose share of all tokens so far,
tends to 0.6 x (mean prose length) / (0.6 x mean prose length + 0.4 x mean code length). To control the *token*
mix, set the weights from the mean record lengths.

The middle panel counts the document pieces in the rows (a document cut by a row boundary counts as two pieces);
the right one counts how many documents start in each row: `wrap` packing fills every row and never pads."""),
    ("markdown", """## Compare two recipes

The same data with another mixture (90/10 instead of 60/40): another fingerprint, other rows."""),
    ("code", """import tomllib

raw = tomllib.loads(RECIPE.read_text())
raw["sources"][0]["weight"], raw["sources"][1]["weight"] = 0.9, 0.1
variant = Recipe.from_dict(raw, base_dir=RECIPE.parent)   # relative paths resolve as in the file
print("fingerprints differ:", variant.fingerprint[:12], "vs", recipe.fingerprint[:12])
with GlobalBatchSource(variant) as other:
    variant_batches = [other.batch(s) for s in steps]
fig, ax = plt.subplots(figsize=(6, 3.5))
for label, bs in (("60/40 (recipe)", batches), ("90/10 (variant)", variant_batches)):
    ax.plot(list(steps), [b.source_share()[names[0]] for b in bs], marker="o", label=label)
ax.set(title=f"share of '{names[0]}' tokens per step", xlabel="step", ylabel="share", ylim=(0, 1))
ax.legend()
print("identical steps:", sum(a.digest == b.digest for a, b in zip(batches, variant_batches)), "of", len(batches))"""),
    ("markdown", """## A mixture schedule

`recipes/phased.toml` is tiny with two `[[phases]]`: a code-heavy `main` mix from step 2 and a prose-only `anneal`
from step 4 (docs/recipes.md, "Mixture schedules"). Each step belongs to one phase; steps before the first boundary
are tiny's own steps, byte for byte. A running service takes a new phase the same way, from a step no consumer has
read: `svc.add_phase("anneal", 4, {"prose": 1.0})`."""),
    ("code", """phased = Recipe.from_toml(RECIPE.parent / "phased.toml")
for i in range(len(phased.phases) + 1):
    print(f"from step {phased.segment_start(i)}: {phased.segment_name(i):<8}",
          dict(zip(names, (round(w, 2) for w in phased.segment_weights(i)))))
phased_steps = range(8)
with GlobalBatchSource(phased) as source:
    phased_batches = [source.batch(s) for s in phased_steps]
phased_phases = [phased.segment_name(phased.phase_index(s)) for s in phased_steps]
phased_shares = np.array([[b.source_share()[n] for n in names] for b in phased_batches])
for s, phase, b, share in zip(phased_steps, phased_phases, phased_batches, phased_shares):
    print(f"step {s}  phase {phase:<8} {b.digest[:12]}  same as tiny: {b.digest == batches[s].digest!s:<5}",
          {n: round(float(x), 3) for n, x in zip(names, share)})
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.stackplot(list(phased_steps), phased_shares.T, labels=names, step="post")
for p in phased.phases:
    ax.axvline(p.start_step, color="black", linestyle="--")
    ax.text(p.start_step + 0.08, 0.5, p.name, bbox={"facecolor": "white", "alpha": 0.8})
ax.set(title="per-source token share across the phase boundaries", xlabel="step", ylabel="share", ylim=(0, 1))
ax.legend(loc="lower left")
plt.show()"""),
    ("markdown", """## Export

A lazy Ray Dataset over steps (one row per batch row: `step`, `lane`, `row`, `tokens`, `positions` and the step's
`digest`, the schema of a materialised directory's `to_dataset()` too), then Parquet for an audit. Nothing is read
until the dataset is consumed."""),
    ("code", """ds = svc.to_dataset(range(8))
out = tempfile.mkdtemp(prefix="zr-export-")
ds.write_parquet(out)
import pyarrow.parquet as pq
table = pq.read_table(out)
print(table.num_rows, "rows written;", sorted(set(table.column("step").to_pylist())), "steps")
table.select(["step", "lane", "row", "digest"]).slice(0, 3).to_pandas()"""),
    ("markdown", """## Service status as a table"""),
    ("code", """from zephon_ray.cli.service import format_status   # the table `zephon-ray status` prints

print(format_status(svc.status()))"""),
    ("code", """svc.stop()           # producers and coordinator; durable state stays in state_dir
ray.shutdown()"""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in CELLS:
        nb.cells.append(nbformat.v4.new_markdown_cell(source) if kind == "markdown"
                        else nbformat.v4.new_code_cell(source))
    return nb


def execute(nb: nbformat.NotebookNode, timeout_s: int = 600) -> nbformat.NotebookNode:
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


if __name__ == "__main__":
    notebook = execute(build())
    for cell in notebook.cells:  # library log lines (Ray start-up, tqdm) are noise on GitHub; the test still sees them
        if cell.cell_type == "code":
            cell.outputs = [out for out in cell.outputs if out.get("name") != "stderr"]
            for out in cell.outputs:  # Ray's worker-start warnings reach stdout too
                if out.get("output_type") == "stream":
                    out["text"] = "".join(line for line in out["text"].splitlines(keepends=True)
                                          if "(raylet)" not in line)
    nbformat.write(notebook, NOTEBOOK)
    print(f"wrote {NOTEBOOK.relative_to(ROOT)}", file=sys.stderr)
