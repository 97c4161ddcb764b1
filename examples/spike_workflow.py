"""The loss-spike workflow of docs/operations.md, end to end on a shipped recipe, with the CLI for every look.

    python examples/spike_workflow.py [--recipe tiny] [--save-at 6] [--spike 9] [--no-locate]

1. **The run** (local mode, W = 1, a ledger): reads steps 0..spike, confirming each; its checkpoint at ``--save-at``
   keeps the loader state (``state-<a>.json``), as a trainer checkpoint would. The "loss spike" is at ``--spike``.
2. **What did the model see?** ``zephon-ray show RECIPE --step S --docs`` (rank 0 of 4's rows, to keep it short) and
   ``--steps a:S+1 --docs`` (per source and per shard over the steps that led into it).
3. **Roll back and skip:** a copy of the recipe with ``[[skips]] name = "spike-1", start_step = a, end_step = S+1``
   (training steps a.. read the data after the spike), resumed from ``state-<a>.json`` **at W = 2** (two local-mode
   readers in threads, meeting in an aggregate directory); it reads as many steps as were rolled back.
4. **The audit:** ``zephon-ray audit STATE --ledger DIR --recipe SKIPPING``: the skip is a note, exit 0. The same
   ledger against the plain recipe, without the run's schedule, is findings (exit 1): an undeclared skip.
5. **Where did a document go?** ``zephon-ray locate`` of the first document of the spike step's row 0 over steps
   0..end with ``--schedule-from`` the final state: each hit names the training step that read it, or the skip
   that skipped it (a private local Ray; ``--no-locate`` leaves it out).

Exit code 1 if a check fails. ``tests/test_spike_workflow.py`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cli(*args: str) -> tuple[int, str]:
    """Run ``zephon-ray ARGS`` in this process; print the command and its output; return (exit code, stdout)."""
    from zephon_ray.cli import main

    print(f"\n$ zephon-ray {' '.join(args)}", flush=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(list(args))
        except SystemExit as exc:  # a user error: one line on stderr, exit 2
            code = int(exc.code or 0)
    print(out.getvalue(), end="", flush=True)
    return code, out.getvalue()


def skipping_recipe(recipe_path: Path, out: Path, start: int, end: int) -> Path:
    """``recipe_path`` with its relative source paths made absolute and a ``[[skips]]`` entry appended."""
    text = recipe_path.read_text()
    text = re.sub(
        r'^path = "(?![a-z0-9]+://|/)([^"]+)"',
        lambda m: f'path = "{(recipe_path.parent / m[1]).resolve()}"',
        text,
        flags=re.M,
    )
    out.write_text(text + f'\n[[skips]]\nname = "spike-1"\nstart_step = {start}\nend_step = {end}\n')
    return out


def read_steps(config, world: int, state: dict | None, steps: int) -> tuple[list[int], dict]:
    """``world`` local-mode readers (threads) load ``state``, read and confirm ``steps`` steps and save: the data
    step each training step read, and the (identical) state."""
    from zephon_ray import Loader

    data_steps: list[list[int]] = [[] for _ in range(world)]
    states: list = [None] * world
    errors: list[BaseException] = []

    def read(rank: int) -> None:
        try:
            with Loader(config, rank=rank, world=world) as loader:
                if state is not None:
                    loader.load_state_dict(json.loads(json.dumps(state)))
                it = iter(loader)
                for _ in range(steps):
                    batch = next(it)
                    data_steps[rank].append(batch.slice.step)
                    loader.commit(batch.step)
                states[rank] = json.loads(json.dumps(loader.state_dict()))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("the readers did not finish within 300 s")
    if any(s != states[0] for s in states) or any(d != data_steps[0] for d in data_steps):
        raise AssertionError("the readers disagree on the state or the data steps")
    return data_steps[0], states[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny", help="a recipe path or a packaged recipe's name")
    parser.add_argument("--save-at", type=int, default=6, help="the step of the checkpoint the run rolls back to")
    parser.add_argument("--spike", type=int, default=9, help="the step of the loss spike")
    parser.add_argument("--no-locate", action="store_true", help="leave out step 5 (it starts a private Ray)")
    args = parser.parse_args()
    a, spike = args.save_at, args.spike
    if not 0 < a <= spike:
        parser.error("need 0 < --save-at <= --spike")

    from zephon_ray import LoaderConfig, Recipe

    recipe = Recipe.from_toml(args.recipe)
    ok = True
    with tempfile.TemporaryDirectory(prefix="zr-spike-") as tmp:
        work = Path(tmp)
        ledger = str(work / "ledger")
        # 1. the run, up to the spike; the checkpoint at step a keeps its loader state
        config = LoaderConfig(recipe=str(recipe.path), mode="local", run_id="spike", ledger_dir=ledger)
        read, state_a = read_steps(config, 1, None, a)
        (work / f"state-{a}.json").write_text(json.dumps(state_a))
        more, _ = read_steps(config, 1, state_a, spike + 1 - a)  # steps a..spike: the branch that is rolled back
        print(
            f"the run read steps 0..{spike}; its checkpoint at step {a} is {work / f'state-{a}.json'}; "
            f"loss spike at step {spike}"
        )

        # 2. what did the model see?
        code, out = cli(
            "show", str(recipe.path), "--step", str(spike), "--docs", "--rank", "0", "--world", "4", "--chars", "40"
        )
        ok &= code == 0 and "record" in out
        code, out = cli("show", str(recipe.path), "--steps", f"{a}:{spike + 1}", "--docs")
        ok &= code == 0
        code, out = cli("show", str(recipe.path), "--step", str(spike), "--docs", "--json")
        first = json.loads(out)["rows"][0]["pieces"][0]

        # 3. roll back to step a and skip the data of steps a..spike, resuming at W = 2
        skipping = skipping_recipe(Path(recipe.path), work / "skipping.toml", a, spike + 1)
        code, _ = cli("validate", str(skipping), "--no-build")
        ok &= code == 0
        config2 = LoaderConfig(
            recipe=str(skipping),
            mode="local",
            run_id="spike",
            ledger_dir=ledger,
            aggregate_dir=str(work / "aggregate"),
            checkpoint_every=2,
        )
        resumed, final = read_steps(config2, 2, state_a, spike + 1 - a)
        (work / "state-final.json").write_text(json.dumps(final))
        want = [Recipe.from_toml(skipping).data_step(t) for t in range(a, spike + 1)]
        print(f"\nresumed at W = 2 from step {a}: training steps {a}..{spike} read data steps {resumed}")
        ok &= resumed == want and resumed[0] == spike + 1

        # 4. the audit: the skip is a note, not a finding
        code, out = cli("audit", str(work / "state-final.json"), "--ledger", ledger, "--recipe", str(skipping))
        ok &= code == 0 and "skipped by schedule entry 'spike-1'" in out
        code, _ = cli("audit", ledger, "--recipe", str(recipe.path))  # the skip undeclared
        ok &= code == 1

        # 5. where did a document of the spike step go?
        if not args.no_locate:
            end = spike + 1 + (spike + 1 - a)
            code, out = cli(
                "locate",
                str(recipe.path),
                "--source",
                first["source"],
                "--shard",
                first["shard"],
                "--record",
                str(first["record"]),
                "--steps",
                f"0:{end}",
                "--schedule-from",
                str(work / "state-final.json"),
                "--quiet",
            )
            ok &= (
                code == 0
                and f"step {spike} row 0 tokens {first['start']}:{first['end']}" in out
                and "data skipped by 'spike-1'" in out
            )
        del read, more
    print("\nspike workflow: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
