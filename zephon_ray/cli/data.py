"""The recipe, batch, dataset and job commands of ``zephon-ray``: digest, show, corpus, bench, validate,
fingerprint, audit, ledger compact, inspect, pretokenize, materialize (``digest --via service`` is in service.py).

Usage: :func:`zephon_ray.cli.build_parser` registers them (``add_batch_commands``, ``add_recipe_commands``,
``add_job_commands``); ``zephon-ray <command> --help`` lists each one's flags. Guarantee: ``digest`` prints the same
``step <s> <sha256>`` lines whichever path serves the steps. Limits: each command returns its exit code or raises; bad input raises :class:`~zephon_ray.errors.UserInputError` (or a
library ``ValueError``) naming the flag, path or value at fault, and ``main`` prints it as one line, exit 2
(errors.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from zephon_ray.checks import check_int
from zephon_ray.cli.schedule import SCHEDULE_FROM_HELP, load_recipe, recipe_with_schedule
from zephon_ray.errors import UserInputError
from zephon_ray.log_filters import quiet_command
from zephon_ray.recipe import Recipe

if TYPE_CHECKING:
    from zephon_ray.batch import GlobalBatch


def parse_steps(text: str) -> range:
    """``A:B`` is steps A..B-1 (Python slice convention); a single ``S`` is just step S."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            steps = range(int(a), int(b))
        else:
            steps = range(int(text), int(text) + 1)
    except ValueError:
        raise UserInputError(f"--steps {text!r}: expected A:B (steps A..B-1) or a single step") from None
    if steps.start < 0 or len(steps) == 0:
        raise UserInputError(f"--steps {text!r}: expected 0 <= A < B")
    return steps


def _positive(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    """An argparse type: the one integer validator (zephon_ray.checks), its message under argparse's flag name."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    return check_int("the value", value, low=low, error=argparse.ArgumentTypeError)


def cmd_digest(args: argparse.Namespace) -> int:
    recipe = load_recipe(args)
    steps = parse_steps(args.steps)
    if args.via == "dataset":
        return digest_via_dataset(recipe, steps, args)
    if args.via == "local":
        from zephon_ray.source import GlobalBatchSource

        with GlobalBatchSource(recipe) as source:
            advance_with_progress(source, steps.start)
            for step in steps:
                print(f"step {step} {source.batch(step).digest}", flush=True)
        return 0
    from zephon_ray.cli.service import digest_via_service

    return digest_via_service(recipe, steps, args)


def cmd_show(args: argparse.Namespace) -> int:
    from zephon_ray.source import GlobalBatchSource
    from zephon_ray.tokenizers import build_tokenizer

    if args.plot:
        from zephon_ray.plots import check_plot_path

        check_plot_path(args.plot, "--plot")  # before any work
    if not args.docs and (args.steps is not None or args.rank is not None or args.world is not None or args.json):
        raise UserInputError("--steps, --rank, --world and --json go with --docs (the documents of the rows)")
    if args.steps is not None and args.step is not None:
        raise UserInputError("give --step S or --steps A:B, not both")
    if (args.rank is None) != (args.world is None):
        raise UserInputError("give both --rank R and --world W, or neither")
    recipe = load_recipe(args)
    if args.steps is not None:
        return show_docs_summary(recipe, check_step_range(parse_steps(args.steps)), args)
    step = 0 if args.step is None else args.step
    if args.rank is not None:
        from zephon_ray.batch import slice_bounds

        try:
            slice_bounds(recipe.global_batch_rows, args.rank, args.world)
        except ValueError as exc:
            raise UserInputError(f"--rank {args.rank} --world {args.world}: {exc}") from None
    tokenizer = build_tokenizer(recipe.tokenizer)
    with GlobalBatchSource(recipe) as source:
        advance_with_progress(source, step)
        batch = source.batch(step)
        provenance = source.provenance(step) if args.docs else None
    if args.docs:
        return show_docs(recipe, batch, provenance, tokenizer, args)
    print(f"recipe      {recipe.describe()}")
    print(f"step        {batch.step}")
    print(f"digest      {batch.digest}")
    print(
        f"rows        {batch.num_rows} x {recipe.row_length} tokens "
        f"({recipe.lanes} lanes x {recipe.microbatches_per_lane} microbatches x {recipe.rows_per_microbatch} rows)"
    )
    print(f"tokens/step {recipe.tokens_per_step}")  # the count `validate` gives: seq_len per row
    if recipe.phases:
        index = recipe.phase_index(batch.step)
        print(f"phase       {recipe.segment_name(index)} (from step {recipe.segment_start(index)})")
    shares = ", ".join(f"{name} {share:.1%}" for name, share in batch.source_share().items())
    print(f"sources     {shares}")
    for row in range(min(args.rows, batch.num_rows)):
        text = tokenizer.decode(batch.tokens[row][: args.chars * 2])[: args.chars]
        print(f"row {row:<4} lane {int(batch.lanes[row]):<3} {text!r}")
    if args.plot:
        from zephon_ray.plots import plot_batch

        print(f"plot        {plot_batch(batch, args.plot, title=f'{recipe.describe()}  step {batch.step}')}")
    return 0


def show_docs(recipe: Recipe, batch, provenance, tokenizer, args: argparse.Namespace) -> int:
    """``show --docs``: each row's pieces (source, shard, record, span, offset in the document) and the first
    ``--chars`` characters of each piece's text, decoded from the row; ``--json`` the same as one JSON object."""
    import json

    from zephon_ray.provenance import slice_provenance

    part = slice_provenance(provenance, args.rank, args.world)
    doc = part.to_json(recipe)
    for entry in doc["rows"]:
        row = entry["row"]
        entry["lane"] = int(batch.lanes[row])
        for piece in entry["pieces"]:
            piece["text"] = tokenizer.decode(batch.tokens[row][piece["start"] : piece["end"]])[: args.chars]
    if args.json:
        print(
            json.dumps(
                {
                    "recipe": str(recipe.path),
                    "fingerprint": recipe.fingerprint,
                    "digest": batch.digest,
                    **({"rank": args.rank, "world": args.world} if args.rank is not None else {}),
                    **doc,
                }
            )
        )
        return 0
    print(f"recipe      {recipe.describe()}")
    print(f"step        {batch.step}")
    print(f"digest      {batch.digest}")
    rows = f"{part.first_row}..{part.first_row + len(part.rows) - 1} of {batch.num_rows}"
    print(f"rows        {rows}" + (f" (rank {args.rank} of {args.world})" if args.rank is not None else ""))
    for entry in doc["rows"]:
        print(f"row {entry['row']:<4} lane {entry['lane']}")
        for p in entry["pieces"]:
            print(
                f"  tokens {p['start']:>5}:{p['end']:<5} {p['source']}/{p['shard']} record {p['record']} "
                f"from token {p['offset']}  {p['text']!r}"
            )
    return 0


def show_docs_summary(recipe: Recipe, steps: range, args: argparse.Namespace) -> int:
    """``show --steps A:B --docs``: tokens, pieces, documents begun (pieces at offset 0) and distinct records per
    source and per shard over the range (rows of ``--rank R --world W`` only, when given)."""
    import json
    from collections import defaultdict

    from tqdm import tqdm

    from zephon_ray.provenance import slice_provenance
    from zephon_ray.source import GlobalBatchSource

    totals: dict[tuple[str, ...], list] = defaultdict(lambda: [0, 0, 0, set()])
    with GlobalBatchSource(recipe) as source:
        advance_with_progress(source, steps.start)
        for step in tqdm(steps, desc="provenance", unit="step", disable=None, leave=False):
            part = slice_provenance(source.provenance(step), args.rank, args.world)
            for pieces in part.rows:
                for p in pieces:
                    for key in ((p.source,), (p.source, p.shard)):
                        entry = totals[key]
                        entry[0] += p.length
                        entry[1] += 1
                        entry[2] += p.offset == 0
                        entry[3].add((p.shard, p.record))
    everything = sum(v[0] for k, v in totals.items() if len(k) == 1) or 1
    rows = [
        {
            "source": k[0],
            **({"shard": k[1]} if len(k) == 2 else {}),
            "tokens": v[0],
            "share": v[0] / everything,
            "pieces": v[1],
            "documents_begun": v[2],
            "records": len(v[3]),
        }
        for k, v in sorted(totals.items())
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "recipe": str(recipe.path),
                    "fingerprint": recipe.fingerprint,
                    "steps": [steps.start, steps.stop],
                    "tokens": everything,
                    "by": rows,
                }
            )
        )
        return 0
    print(f"recipe      {recipe.describe()}")
    print(
        f"steps       {steps.start}:{steps.stop} ({len(steps)} steps, {everything} tokens)"
        + (f", rank {args.rank} of {args.world}" if args.rank is not None else "")
    )
    for r in rows:
        what = f"source {r['source']}" if "shard" not in r else f"  shard {r['source']}/{r['shard']}"
        print(
            f"{what}: {r['tokens']} tokens ({r['share']:.1%}), {r['pieces']} pieces, {r['records']} records, "
            f"{r['documents_begun']} documents begun"
        )
    return 0


MAX_SHOW_STEPS = 100_000
"""``show --steps`` computes every step's provenance in this process: bounded."""


def check_step_range(steps: range) -> range:
    check_int("--steps: the number of steps", len(steps), low=1, high=MAX_SHOW_STEPS, error=UserInputError)
    return steps


def cmd_locate(args: argparse.Namespace) -> int:
    """``zephon-ray locate``: see :mod:`zephon_ray.jobs.locate`."""
    import json
    import time

    from zephon_ray.jobs.locate import check_groups, check_range, locate, record_ref, training_step
    from zephon_ray.service.client.session import ray_session

    recipe = load_recipe(args)
    target = record_ref(recipe, args.source, args.shard, args.record)
    steps = check_range(parse_steps(args.steps))
    check_groups(recipe, args.groups)  # every check before Ray starts
    started = time.monotonic()
    with ray_session(args.address, private_if_none=True), quiet_command():
        hits = locate(
            recipe,
            target,
            steps,
            groups=args.groups,
            cpus_per_actor=args.cpus_per_actor,
            work_dir=args.work_dir,
            progress=not args.quiet,
        )
    took = time.monotonic() - started
    trained = {h.step: training_step(recipe, h.step) for h in hits}  # data step -> (training step, skip name)
    if args.json:
        out = []
        for h in hits:
            item: dict[str, Any] = h.to_json()
            if recipe.skips:
                item["training_step"], item["skipped_by"] = trained[h.step]
            out.append(item)
        print(
            json.dumps(
                {
                    "recipe": str(recipe.path),
                    "fingerprint": recipe.fingerprint,
                    "record": {"source": target.source, "shard": target.shard, "record": target.record},
                    "steps": [steps.start, steps.stop],
                    "hits": out,
                    "seconds": round(took, 3),
                }
            )
        )
        return 0
    for h in hits:
        note = ""
        if recipe.skips:
            step, skip = trained[h.step]
            note = (
                f"  (data skipped by '{skip}': no training step of the run reads it)"
                if skip
                else f"  (training step {step})"
            )
        print(f"step {h.step} row {h.row} tokens {h.start}:{h.end} offset {h.offset}{note}")
    print(
        f"{target.describe()}: {len(hits)} piece(s) in {len({h.step for h in hits})} step(s) of "
        f"{steps.start}:{steps.stop} ({args.groups} lane group(s), {took:.1f} s)"
    )
    return 0


def cmd_corpus(args: argparse.Namespace) -> int:
    from zephon_ray.corpus import write_corpus

    counts = write_corpus(args.out_dir, formats=tuple(args.formats.split(",")), limit=args.limit, progress=True)
    print(f"wrote {args.out_dir}: " + ", ".join(f"{name} {n} records" for name, n in counts.items()))
    return 0


# ---------------------------------------------------------------------- progress
PROGRESS_MIN_STEPS = 16
"""Replays shorter than this finish too fast to deserve a bar."""


def advance_with_progress(source, step: int) -> None:
    """Produce the steps before ``step`` with a tqdm bar (stderr, terminals only); ``source.batch(step)`` would
    produce them anyway, silently."""
    todo = range(source.position, step)
    if len(todo) < PROGRESS_MIN_STEPS:
        return
    from tqdm import tqdm

    for s in tqdm(todo, desc=f"replaying to step {step}", unit="step", disable=None, leave=False):
        source.batch(s)


# ---------------------------------------------------------------------- validate / fingerprint / inspect
def recipe_report(recipe: Recipe) -> dict:
    """Fingerprint and geometry: L, k, m, B, seq_len, tokens per step, and the data-parallel sizes W that work
    (service/dataset: any W up to B, ``even_world_sizes`` those dividing B; local mode: W dividing L), the padding
    rows per step that equal shapes cost at each W that does not divide B (``pad_slices``), and the torchft
    participant counts P per replica-group dp degree (any P with P * dp <= B:
    zephon_ray.stream.ft.supported_participants)."""
    from zephon_ray.stream.ft import supported_participants
    from zephon_ray.stream.geometry import check_geometry

    B = recipe.global_batch_rows
    padding = {
        w: check_geometry(
            recipe, global_batch_size=None, local_batch_size=0, dp_world_size=w, seq_len=None, pad=True
        ).padding_rows
        for w in range(1, B + 1)
        if B % w
    }
    return {
        "recipe": str(recipe.path) if recipe.path else None,
        "fingerprint": recipe.fingerprint,
        "lanes": recipe.lanes,
        "microbatches_per_lane": recipe.microbatches_per_lane,
        "rows_per_microbatch": recipe.rows_per_microbatch,
        "global_batch_rows": B,
        "seq_len": recipe.seq_len,
        "tokens_per_step": recipe.tokens_per_step,
        "world_sizes": list(range(1, B + 1)),
        "even_world_sizes": [w for w in range(1, B + 1) if B % w == 0],
        "local_world_sizes": [w for w in range(1, recipe.lanes + 1) if recipe.lanes % w == 0],
        "padding_rows": padding,
        "ft_participants": {dp: supported_participants(recipe, dp=dp) for dp in (1, 2, 4, 8) if dp <= B},
        "tokenizer": recipe.tokenizer,
        "packing": recipe.packing,
        "sources": {
            s.name: {
                "weight": s.weight,
                "format": s.format,
                "shards": len(s.shards),
                "bytes": sum(_shard_size(x) for x in s.shards),
                "path": str(s.path),
            }
            for s in recipe.sources
        },
        "phases": [
            {
                "name": recipe.segment_name(i),
                "start_step": recipe.segment_start(i),
                "weights": dict(zip(recipe.source_names, recipe.segment_weights(i))),
            }
            for i in range(1, len(recipe.phases) + 1)
        ],
    }


def _shard_size(shard) -> int:
    return int(shard.size if hasattr(shard, "size") else shard[1])  # ShardIdentity, or a (name, size) pair


def cmd_validate(args: argparse.Namespace) -> int:
    import json

    recipe = load_recipe(args, verify_content=args.verify_content or None)  # one RecipeError line
    report = recipe_report(recipe)
    if not args.no_build:
        report["step0_digest"] = build_step_zero(recipe)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"ok          {report['recipe']}")
    print(f"fingerprint {report['fingerprint']}")
    print(
        f"geometry    L={report['lanes']} lanes x k={report['microbatches_per_lane']} microbatches x "
        f"m={report['rows_per_microbatch']} rows = B={report['global_batch_rows']} rows of seq_len "
        f"{report['seq_len']}+1"
    )
    print(f"tokens/step {report['tokens_per_step']}")
    B = report["global_batch_rows"]
    print(
        f"W (service) 1-{B}, any count up to B (dataset mode too); every rank gets B/W rows at W = "
        f"{' '.join(map(str, report['even_world_sizes']))}"
    )
    print(f"W (local)   {' '.join(map(str, report['local_world_sizes']))}")
    shown = list(report["padding_rows"].items())[:12]
    if shown:
        more = " ..." if len(report["padding_rows"]) > len(shown) else ""
        print(
            "padding     rows per step for equal shapes (pad_slices) at W = "
            + ", ".join(f"{w}: {rows} ({rows / B:.0%})" for w, rows in shown)
            + more
        )
    print(
        "P (torchft) "
        + "; ".join(
            f"dp={dp}: 1-{ps[-1]}" if ps == list(range(1, ps[-1] + 1)) else f"dp={dp}: {' '.join(map(str, ps))}"
            for dp, ps in report["ft_participants"].items()
            if ps
        )
    )
    print(f"tokenizer   {report['tokenizer']}  packing {report['packing']}")
    for name, src in report["sources"].items():
        print(
            f"source      {name}: weight {src['weight']:g}, {src['shards']} {src['format']} shards, "
            f"{src['bytes']} B in {src['path']}"
        )
    for ph in report["phases"]:
        print(
            f"phase       {ph['name']}: from step {ph['start_step']}, weights "
            + ", ".join(f"{k} {v:.3g}" for k, v in ph["weights"].items())
        )
    for skip, first, end in recipe.skipped_data():
        print(
            f"skip        {skip.name}: training step {skip.start_step} on reads data step "
            f"{recipe.data_step(skip.start_step)} on (data steps {first}..{end - 1} skipped)"
        )
    if "step0_digest" in report:
        print(f"step 0      {report['step0_digest']} (the pipeline builds)")
    return 0


def build_step_zero(recipe: Recipe) -> str:
    """Build the Zephon pipeline and step 0: what loading alone cannot check (Zephon's own operator options, the
    tokenizer on real records). Any failure becomes one ValueError naming the recipe."""
    from zephon_ray.source import GlobalBatchSource

    try:
        with GlobalBatchSource(recipe) as source:
            return source.batch(0).digest
    except Exception as exc:  # noqa: BLE001 - whatever Zephon raises, the user gets one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserInputError(
            f"{recipe.path}: the recipe loads, but building step 0 failed: {type(exc).__name__}: {first}"
        ) from None


def cmd_fingerprint(args: argparse.Namespace) -> int:
    print(Recipe.from_toml(args.recipe, verify_content=args.verify_content or None).fingerprint)
    return 0


def inspect_state_dir(state_dir: str) -> dict:
    """What a service left under ``state_dir`` (a path or URI): the state format's owner reads it
    (:func:`zephon_ray.formats.service_state.inspect`; no Ray, no recipe)."""
    from zephon_ray.formats.service_state import inspect

    return inspect(state_dir)


def cmd_inspect(args: argparse.Namespace) -> int:
    import datetime
    import json

    from zephon_ray import storage
    from zephon_ray.formats.service_state import SERVICE_FILE

    loc = storage.location(args.state_dir)
    if not storage.is_file(loc.join(SERVICE_FILE)) and (
        storage.is_file(loc) or storage.is_file(loc.join("zephon_loader.json"))
    ):
        return inspect_loader_state(loc, args.json)
    report = inspect_state_dir(args.state_dir)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    created = report["created"]
    when = (
        datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(timespec="seconds")
        if isinstance(created, (int, float))
        else "?"
    )
    ck, co = report["checkpoints"], report["commits"]
    steps = ck["steps"]
    shown = " ".join(map(str, steps if len(steps) <= 12 else steps[:4] + ["..."] + steps[-6:]))
    print(f"state_dir   {report['state_dir']}  ({report['format']}, created {when})")
    print(f"fingerprint {report['fingerprint']}")
    print(
        f"recipe      lanes {report['lanes']}, "
        + ", ".join(f"{k} {v}" for k, v in report["recipe"].items() if k != "lanes")
        + f"; sources {', '.join(map(str, report['sources']))}"
    )
    print(f"checkpoints {ck['count']} (latest before step {ck['latest']}): {shown}")
    for i, seg in enumerate(report.get("schedule") or []):  # the mixture schedule: sources' weights, then phases
        weights = ", ".join(
            f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in (seg.get("weights") or {}).items()
        )
        print(
            f"{'schedule' if i == 0 else '':<12}from step {seg.get('start_step')}: {seg.get('name')} ({weights})"
            + ("  [added while running]" if seg.get("added") else "")
        )
    print(f"commits     {co['count']} (latest step {co['latest_step']})")
    for consumer, step in sorted(co["by_consumer"].items()):
        print(f"  {consumer}: resumes at step {step}")
    return 0


def inspect_loader_state(loc, as_json: bool) -> int:
    """``zephon-ray inspect`` of a loader state: its step, ledger head and the run's recorded schedule."""
    import json

    from zephon_ray import storage
    from zephon_ray.formats.loader_state import check_state, run_schedule

    state_file = loc if storage.is_file(loc) else loc.join("zephon_loader.json")
    state = storage.read_json(state_file, error=UserInputError, what="loader state")
    if not isinstance(state, dict):
        raise UserInputError(f"{state_file.uri}: not a loader state (a JSON {type(state).__name__})")
    check_state(
        state, run_id=state.get("run_id"), fingerprint=cast(str, state.get("fingerprint")), recipe_name="its own"
    )
    schedule = run_schedule(state)
    if as_json:
        print(
            json.dumps(
                {
                    **{k: v for k, v in state.items() if k not in ("zephon", "run_schedule")},
                    "run_schedule": schedule,
                    "zephon": bool(state["zephon"]),
                },
                indent=2,
                sort_keys=True,
            )
        )
        return 0
    print(f"loader state {state_file.uri} (format {state['version']})")
    print(
        f"run_id      {state['run_id'] or '-'}; next_step {state['next_step']}; fingerprint "
        f"{state['fingerprint'][:12]} (the schedule of the data read so far)"
    )
    print(
        f"ledger      {state['ledger'] or '-'}; replayed_steps {state['replayed_steps']}; zephon checkpoint "
        f"{'yes' if state['zephon'] else 'no'}"
    )
    for phase in schedule["phases"]:
        weights = ", ".join(f"{k} {v:g}" for k, v in phase["weights"].items())
        print(f"phase       {phase['name']}: from step {phase['start_step']} ({weights})  [decided while running]")
    if not schedule["phases"]:
        print("phases      none beyond the recipe file's")
    for skip in schedule["skips"]:
        print(
            f"skip        {skip['name']}: training steps from {skip['start_step']} read the data "
            f"{skip['end_step'] - skip['start_step']} steps later"
        )
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """``zephon-ray audit``: see :mod:`zephon_ray.jobs.audit`."""
    from contextlib import ExitStack

    from zephon_ray.jobs.audit import Finding, audit, locate

    ledger_dir, head, state = locate(args.path, args.ledger)
    base = Recipe.from_toml(args.recipe) if args.recipe else None
    recipe = base
    if base is not None and (state is not None or args.schedule_from):
        from zephon_ray.formats.loader_state import run_recipe

        # the run's schedule: the phases it decided while it trained, from its state (or --schedule-from)
        recipe = run_recipe(state, base) if state is not None else recipe_with_schedule(base, args.schedule_from)
    if args.dataset and args.service:
        raise UserInputError("give at most one of --dataset DIR and --service NAME")
    if (args.dataset or args.service) and recipe is None:
        raise UserInputError(
            f"{'--dataset DIR' if args.dataset else '--service NAME'} needs --recipe R (the recipe the run trained on)"
        )
    with ExitStack() as stack:
        if args.service:
            from zephon_ray.service.client import DataService
            from zephon_ray.service.client.session import ray_session

            stack.enter_context(ray_session(args.address, private_if_none=False))
            source = DataService.connect(args.service, namespace=args.namespace)
            assert recipe is not None  # --service needs --recipe (checked above)
            if source.recipe.fingerprint != recipe.fingerprint:
                raise UserInputError(
                    f"service {args.service!r} serves recipe fingerprint "
                    f"{source.recipe.fingerprint[:12]}, not {recipe.describe()}"
                )
            batch_of: Callable[[int], GlobalBatch] = source.batch  # ad hoc reads: no consumer cursor moves
        elif args.dataset:
            from zephon_ray.formats.materialized import MaterializedSource

            batch_of = stack.enter_context(MaterializedSource(args.dataset, recipe=recipe)).batch
        elif recipe is not None:
            from zephon_ray.source import GlobalBatchSource

            batch_of = stack.enter_context(GlobalBatchSource(recipe)).batch

        def reference(step: int):  # a training step's rows: those of the data step it read
            batch = batch_of(cast(Recipe, recipe).data_step(step))  # called only with a recipe
            return batch.tokens, batch.positions

        report = audit(
            ledger_dir,
            head,
            fingerprint=base.fingerprint if base else None,
            run_id=state["run_id"] if state else None,
            reference=reference if recipe is not None else None,
            rows=recipe.global_batch_rows if recipe else None,
        )
    if state is not None and state["next_step"] != report.next_step:
        report.findings.append(
            Finding(
                min(state["next_step"], report.next_step),
                max(state["next_step"], report.next_step) - 1,
                "lineage",
                f"the loader state is at step {state['next_step']} but its segment {head} ends at {report.next_step}",
            )
        )
    if recipe is not None:
        from zephon_ray.jobs.audit import skip_notes

        report.notes.extend(skip_notes(recipe, report.next_step))
    for line in report.notes:
        print(f"note: {line}")
    for finding in report.findings:
        print(finding.line)
    print(report.verdict())
    return 0 if report.clean else 1


def cmd_ledger_compact(args: argparse.Namespace) -> int:
    """``zephon-ray ledger compact DIR``: see :func:`zephon_ray.formats.ledger.compact`."""
    from zephon_ray.formats.ledger import compact

    result = compact(args.ledger_dir)
    done = (
        f"packed {result.parts} part(s), {result.records} record(s) into {result.pack}"
        if result.pack
        else "nothing to merge"
    )
    print(f"{args.ledger_dir}: {done}; {result.files_before} -> {result.files_after} ledger file(s)")
    return 0


VERIFY_CONTENT_HELP = (
    "hash the bytes of every object-store shard (a download) instead of trusting the store's "
    "ETags; same as the recipe key verify_content"
)


def add_recipe_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a recipe and build its step 0; print fingerprint and geometry")
    p.add_argument("recipe")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-build", action="store_true", help="only load the recipe; do not build step 0")
    p.add_argument("--schedule-from", metavar="STATE", help=SCHEDULE_FROM_HELP)
    p.add_argument("--verify-content", action="store_true", help=VERIFY_CONTENT_HELP)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("fingerprint", help="print a recipe's fingerprint")
    p.add_argument("recipe")
    p.add_argument("--verify-content", action="store_true", help=VERIFY_CONTENT_HELP)
    p.set_defaults(func=cmd_fingerprint)

    p = sub.add_parser(
        "audit",
        help="check a checkpoint's ledger: every step in [0, s) trained exactly once, on the "
        "recipe's rows; one line per finding, exit 1 on any",
    )
    p.add_argument(
        "path",
        metavar="CHECKPOINT_OR_LEDGER",
        help="a loader state (zephon_loader.json, or a directory holding one) or a ledger directory",
    )
    p.add_argument("--ledger", metavar="DIR", help="the run's ledger directory (needed with a loader state)")
    p.add_argument(
        "--recipe",
        metavar="R",
        help="check every slice against this recipe's global batches (computed "
        "in-process) and that the lineage was trained on it",
    )
    p.add_argument("--dataset", metavar="DIR", help="read the global batches from this materialised directory")
    p.add_argument(
        "--schedule-from",
        metavar="STATE",
        help=SCHEDULE_FROM_HELP + " (a loader state given as the checkpoint is used by itself)",
    )
    p.add_argument("--service", metavar="NAME", help="ask this running DataService for the global batches")
    p.add_argument("--namespace", default="zephon-ray", help="the service's Ray namespace (with --service)")
    p.add_argument(
        "--address",
        default=None,
        help="the Ray cluster of the service (with --service; default: RAY_ADDRESS or the ambient cluster)",
    )
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("ledger", help="maintain a ledger directory")
    ledger_sub = p.add_subparsers(dest="ledger_command", required=True)
    p = ledger_sub.add_parser(
        "compact",
        help="merge the ledger's loose parts, torchft batches and smaller packs "
        "into one pack (safe to kill and re-run; docs/audit.md)",
    )
    p.add_argument("ledger_dir", metavar="DIR", help="the ledger directory (a path or URI)")
    p.set_defaults(func=cmd_ledger_compact)

    p = sub.add_parser("inspect", help="report a service's durable state_dir, or a loader state, offline (no Ray)")
    p.add_argument("state_dir", metavar="STATE_DIR_OR_LOADER_STATE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)


def cmd_bench(args: argparse.Namespace) -> int:
    """This node's production rate for a recipe (:mod:`zephon_ray.bench`)."""
    import json

    from zephon_ray.bench import format_report, run_bench

    recipe = Recipe.from_toml(args.recipe)
    rounds = args.rounds if args.rounds is not None else 3 if args.via == "both" else 1  # both: paths alternate
    report = run_bench(
        recipe,
        steps=args.steps,
        warmup=args.warmup,
        via=args.via,
        rounds=rounds,
        producers=args.producers,
        name=args.name,
        namespace=args.namespace,
        address=args.address,
        progress=None if args.json else lambda line: print(line, flush=True),
    )
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(format_report(report)))
    return 0


def add_batch_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("digest", help="print 'step <s> <sha256>' for each step")
    p.add_argument("recipe")
    p.add_argument("--steps", required=True, help="A:B for steps A..B-1")
    p.add_argument("--via", choices=("local", "service", "dataset"), default="local")
    p.add_argument("--dataset", default=None, help="materialised directory (--via dataset)")
    p.add_argument("--producers", type=_positive, default=1, help="producer actors (service only)")
    p.add_argument("--name", default=None, help="use a running service by name instead of starting one")
    p.add_argument("--namespace", default="zephon-ray")
    p.add_argument("--address", default=None, help="Ray address; default starts a private local Ray")
    p.add_argument("--schedule-from", metavar="STATE", help=SCHEDULE_FROM_HELP)
    p.set_defaults(func=cmd_digest)

    p = sub.add_parser("show", help="summarise one global batch; --docs: the documents of every row")
    p.add_argument("recipe")
    p.add_argument("--step", type=_non_negative, default=None, help="the step (default 0)")
    p.add_argument("--rows", type=_non_negative, default=4)
    p.add_argument("--chars", type=_non_negative, default=72)
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="also write a PNG: per-source token share, document-piece lengths, packing per row",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="each row's document pieces: source, shard, record, token span, offset in the document, text",
    )
    p.add_argument(
        "--steps",
        default=None,
        metavar="A:B",
        help="with --docs: tokens, pieces and records per source and per shard over steps A..B-1",
    )
    p.add_argument("--rank", type=_non_negative, default=None, help="with --docs: only rank R's rows (with --world)")
    p.add_argument("--world", type=_positive, default=None, help="with --docs: the reader count W")
    p.add_argument("--json", action="store_true", help="with --docs: one JSON object")
    p.add_argument("--schedule-from", metavar="STATE", help=SCHEDULE_FROM_HELP)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "locate", help="every step, row and token span of a step range that holds one record (a Ray Data scan)"
    )
    p.add_argument("recipe")
    p.add_argument("--source", required=True, help="the source's name in the recipe")
    p.add_argument("--shard", required=True, help="the shard's name (as `validate --json` lists it) or full path")
    p.add_argument("--record", type=_non_negative, required=True, help="the record's 0-based index in the shard")
    p.add_argument("--steps", default="0:1000", metavar="A:B", help="the data steps to search (default 0:1000)")
    p.add_argument(
        "--groups",
        type=_positive,
        default=1,
        help="lane groups scanning in parallel (must divide the lanes; one actor each)",
    )
    p.add_argument("--cpus-per-actor", type=float, default=0.5)
    p.add_argument(
        "--work-dir",
        default=None,
        help="where lane groups meet at phase boundaries (default: temp dir; shared storage on a multi-node cluster)",
    )
    p.add_argument("--address", default=None, help="Ray address; default starts a private local Ray")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--schedule-from",
        metavar="STATE",
        help=SCHEDULE_FROM_HELP + "; with its skips, each hit also "
        "names the training step that read it, or the skip that skipped it",
    )
    p.set_defaults(func=cmd_locate)

    p = sub.add_parser("corpus", help="write the stdlib prose/code corpus as JSONL and Parquet shards")
    p.add_argument("out_dir")
    p.add_argument("--formats", default="jsonl,parquet")
    p.add_argument("--limit", type=_positive, default=None, help="at most this many records per source")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("bench", help="measure this node's production rate for a recipe (tokens/s, step latency)")
    p.add_argument("recipe")
    p.add_argument("--steps", type=_positive, default=32, help="steps timed per round (default 32)")
    p.add_argument("--warmup", type=_non_negative, default=2, help="steps read first and timed apart (default 2)")
    p.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="rounds (default 1; 3 with --via both, which alternates the paths)",
    )
    p.add_argument("--via", choices=("local", "service", "both"), default="local")
    p.add_argument("--producers", type=_positive, default=1, help="producer actors of the service it starts")
    p.add_argument("--name", default=None, help="measure a running service by name instead of starting one")
    p.add_argument("--namespace", default="zephon-ray-bench")
    p.add_argument("--address", default=None, help="Ray address; default starts a private local Ray")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_bench)


# ---------------------------------------------------------------------- Ray Data jobs: pretokenize, materialize
def digest_via_dataset(recipe: Recipe, steps: range, args: argparse.Namespace) -> int:
    """``digest --via dataset --dataset DIR``: digests recomputed from the materialised rows (and checked against
    the manifest), for a directory that must have been materialised from this recipe."""
    from zephon_ray.formats.materialized import MaterializedSource

    if not args.dataset:
        raise UserInputError("--via dataset needs --dataset DIR (a directory written by `zephon-ray materialize`)")
    with MaterializedSource(args.dataset, recipe=recipe) as source:
        for step in steps:
            source.digest(step)  # a step outside the materialised range fails before anything is printed
        for step in steps:
            print(f"step {step} {source.batch(step).digest}", flush=True)
    return 0


def cmd_pretokenize(args: argparse.Namespace) -> int:
    from zephon_ray.jobs.pretokenize import pretokenize
    from zephon_ray.service.client.session import ray_session

    recipe = Recipe.from_toml(args.recipe)
    with ray_session(args.address, private_if_none=True), quiet_command():
        result = pretokenize(
            recipe, args.out_dir, actors=args.actors, cpus_per_actor=args.cpus_per_actor, progress=not args.quiet
        )
    print(
        f"wrote {result.recipe_path}: {result.shards} shards ({result.shards_skipped} already done), "
        f"{result.records} records, {result.tokens} tokens, {result.bytes} bytes"
    )
    return 0


def cmd_materialize(args: argparse.Namespace) -> int:
    from zephon_ray.jobs.materialize import materialize
    from zephon_ray.service.client.session import ray_session

    recipe = load_recipe(args)
    steps = parse_steps(args.steps)
    with ray_session(args.address, private_if_none=True), quiet_command():
        result = materialize(
            recipe,
            args.out,
            steps,
            producers=args.producers,
            segment_steps=args.segment_steps,
            cpus_per_actor=args.cpus_per_actor,
            progress=not args.quiet,
        )
    done = f"wrote steps {result.written.start}:{result.written.stop}" if len(result.written) else "nothing to do"
    print(f"{result.directory}: {done}; holds steps {result.first_step}:{result.end_step}")
    return 0


def add_job_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pretokenize", help="Ray Data job: token-id Parquet copies of a recipe's sources")
    p.add_argument("recipe")
    p.add_argument("out_dir")
    p.add_argument("--actors", type=_positive, default=None, help="tokenizer actors (default: the cluster's CPUs)")
    p.add_argument("--cpus-per-actor", type=float, default=0.5)
    p.add_argument("--address", default=None, help="Ray address; default starts a private local Ray")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pretokenize)

    p = sub.add_parser("materialize", help="Ray Data job: precompute steps A:B into step-keyed Parquet")
    p.add_argument("recipe")
    p.add_argument("--steps", required=True, help="A:B for steps A..B-1")
    p.add_argument("--out", required=True, help="the materialised directory (created, or extended)")
    p.add_argument("--producers", type=_positive, default=1, help="lane-group actors M (must divide the lanes)")
    p.add_argument("--segment-steps", type=_positive, default=16, help="steps per Parquet file (new dirs only)")
    p.add_argument("--cpus-per-actor", type=float, default=0.5)
    p.add_argument("--address", default=None, help="Ray address; default starts a private local Ray")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--schedule-from", metavar="STATE", help=SCHEDULE_FROM_HELP)
    p.set_defaults(func=cmd_materialize)
