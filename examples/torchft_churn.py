"""Per-step elasticity with torchft on CPU: replica groups are SIGKILLed and rejoin, every committed step trains on
the same global batch, and the churned run ends with the weights of a run without failures.

    python examples/torchft_churn.py --groups 3 --steps 16 --kill 1@4 --kill 2@9 --rejoin 1@7
    python examples/torchft_churn.py ... --sampler torchft     # the same churn with torchft's DistributedSampler
    python examples/torchft_churn.py ... --source service      # rows from a DataService instead of Parquet

It runs a torchft Lighthouse in this process (``torchft.coordination.LighthouseServer``) and each replica group as
a process of its own (its own TCPStore, ``ProcessGroupGloo``, a torchft ``Manager``), each training the same small
bigram model (SGD with momentum) on the rows of ``zephon_ray.stream.ft.FtSlices``: at every step, after the quorum,
group p of the P live participants reads ``slice(step, p, P)`` of global batch ``manager.current_step()``.

``--kill G@S``: group G computes its gradients at step S, stops before the all-reduce, and this script SIGKILLs its
process; the others' step S fails to commit and is served again with one participant fewer. ``--rejoin G@S``: the
live groups wait at the start of step S until a new process of group G has asked the Lighthouse for a quorum, so
that step S's quorum includes it; it heals its model and optimizer from a peer (torchft's checkpoint transport) and
reads its share of step S with no data checkpoint.

Then it runs the same script without kills (the failure-free run) and prints, for every committed step, the global
digest (the participants' slices, gathered and joined in participant order), and at the end:

    identical global batches: YES|NO          (every committed step against GlobalBatchSource's digests)
    final weights equal the failure-free run: YES|NO (max abs diff X)

It exits 1 on NO. ``--ledger DIR``: every group's FtSlices writes the churned run's ledger there (``commit`` after
each committed optimizer step; the ledger head travels in the state torchft heals a group with), and the run ends
with ``zephon-ray audit`` of it against the recipe's rows; a finding exits 1 too (``--ledger-flush-records N``: each
group moves its spooled parts into a batch file once more than N wait; a killed group's spool is flushed by its next
life, or read where it is). ``--sampler torchft`` replaces FtSlices by torchft's ``DistributedSampler`` over a map-style view
of the same rows (sharded over the maximum group count, as torchft documents it) and reports the rows it lost or
repeated; it prints NO by design. Default recipe: recipes/elastic.toml (B = 24 rows). Any P up to B works: at a P that
does not divide B the groups hold different row counts, and each scales its summed token loss by
``batch.loss_scale("mean")`` (P over the global batch's valid tokens), so torchft's averaging all-reduce gives the
global batch's mean gradient at every P and the final weights do not depend on the churn.
Tests: tests/test_ft.py (one kill, one rejoin, in CI's heavy tier).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = str(ROOT / "recipes" / "elastic.toml")
WEIGHT_TOLERANCE = 1e-5  # gradients are averaged over P groups: the summation order changes with P
HEARTBEAT_TIMEOUT_MS = 1000  # a SIGKILLed group leaves the quorum after this
JOIN_TIMEOUT_MS = 2000  # the first quorum waits this long for every ready group
EVENT_TIMEOUT_S = 120.0
_RUST_LOG = "RUST_LOG"
_RUST_LOG_SET_HERE = False


def quiet_torchft_info() -> None:
    """torchft's Rust side (the Lighthouse in this process) logs every quorum poll at INFO: about 90% of this
    script's output, and harmless. torchft reads ``RUST_LOG`` when it is imported; default it to ``warn`` so its
    warnings and errors still show. A ``RUST_LOG`` you set wins (``RUST_LOG=info`` brings the quorum lines back).
    The replica processes get your setting, not this default: their logs are files read when something fails.
    Test: tests/test_log_filters.py::test_torchft_info_is_quiet_by_default_and_rust_log_wins."""
    global _RUST_LOG_SET_HERE
    if _RUST_LOG not in os.environ:
        os.environ[_RUST_LOG] = "warn"
        _RUST_LOG_SET_HERE = True


# ---------------------------------------------------------------------------------------------- replica group
def _bigram(vocab: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab))


def _wait_for(path: Path, timeout: float = EVENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:.0f} s")
        time.sleep(0.02)


def replica(args: argparse.Namespace) -> int:
    """One replica group (a process): the torchft training loop over FtSlices (or torchft's sampler)."""
    from datetime import timedelta

    import numpy as np
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    from zephon_ray.recipe import Recipe
    from zephon_ray.tokenizers import build_tokenizer

    g, work, life = args.group, Path(args.work), args.life
    recipe = Recipe.from_toml(args.recipe)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = _bigram(int(build_tokenizer(recipe.tokenizer).vocab_size))
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    def load_state(state):
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        if source is not None:  # the ledger head travels with the model when torchft heals this group
            source.load_state_dict(state["data"])

    def state_dict():
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        if source is not None:
            state["data"] = source.state_dict()
        return state

    source = None

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        min_replica_size=1,
        load_state_dict=load_state,
        state_dict=state_dict,
        replica_id=f"group_{g}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=EVENT_TIMEOUT_S),
    )
    kills = {int(s) for s in args.die_at} if life == 0 else set()
    if args.sampler == "torchft":
        source, rows = None, _sampler_batches(args, recipe, g)
    else:
        from zephon_ray.stream.ft import FtSlices
        from zephon_ray.stream.loader import LoaderConfig

        if args.source == "service":
            import ray

            ray.init(address=args.ray_address, namespace="zr-torchft-churn", log_to_driver=False)
            config = LoaderConfig(
                recipe=args.recipe,
                mode="service",
                service_name=args.service,
                service_namespace="zr-torchft-churn",
                run_id="churn",
                ledger_dir=args.ledger,
            )
        else:
            config = LoaderConfig(
                recipe=args.recipe, mode="dataset", dataset_dir=args.dataset_dir, run_id="churn", ledger_dir=args.ledger
            )
        source = FtSlices(config, manager=manager, recipe=recipe, ledger_flush_records=args.ledger_flush_records)
    records = open(work / f"records-g{g}-life{life}.jsonl", "a")
    (work / f"ready-g{g}-life{life}").write_text(str(os.getpid()))
    _wait_for(work / "go")
    attempt = 0
    try:
        while manager.current_step() < args.steps:
            gate = work / f"hold-{manager.current_step()}"
            if gate.exists():
                (work / f"waiting-g{g}-{manager.current_step()}").touch()
                while gate.exists():
                    time.sleep(0.02)
            manager.start_quorum()
            step = manager.current_step()
            if step >= args.steps:
                break
            participants, p = manager.num_participants(), manager.participating_rank()
            if source is not None:
                batch = source.next()
                if batch is None:
                    raise RuntimeError("not participating under a synchronous quorum")
                tokens, positions = batch.slice.tokens, batch.slice.positions
                ((inputs, labels),) = batch.microbatches
                row_ids = None
            else:
                row_ids, tokens, positions = next(rows)
                t = torch.from_numpy(tokens.astype(np.int64))
                inputs, labels = {"input": t[:, :-1]}, t[:, 1:]
            logits = model(inputs["input"])
            if source is not None:  # exact at any P, uneven slices included: the AVG all-reduce of summed losses
                loss = torch.nn.functional.cross_entropy(  # scaled by P / (the global batch's valid tokens)
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum", ignore_index=-100
                ) * batch.loss_scale("mean")
            else:
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss.backward()
            if step in kills:  # the parent SIGKILLs this process now, in the middle of the step
                (work / f"dying-g{g}-{step}").write_text(str(os.getpid()))
                while True:
                    time.sleep(1)
            for param in model.parameters():
                manager.allreduce(param.grad).wait()
            committed = manager.should_commit()
            if committed:
                optim.step()
                if source is not None:
                    source.commit(step)  # the ledger: this group applied this step
            optim.zero_grad(set_to_none=True)
            name = f"rows-s{step}-g{g}-life{life}-a{attempt}.npz"
            np.savez(work / name, tokens=tokens, positions=positions)
            records.write(
                json.dumps(
                    {
                        "group": g,
                        "life": life,
                        "attempt": attempt,
                        "step": step,
                        "participants": participants,
                        "participant": p,
                        "committed": committed,
                        "rows": name,
                        "row_ids": row_ids,
                        "loss": float(loss),
                    }
                )
                + "\n"
            )
            records.flush()
            attempt += 1
        torch.save(model.state_dict(), work / f"weights-g{g}-life{life}.pt")
        summary = {"group": g, "life": life, "steps": manager.current_step()}
        if source is not None:
            checks = sorted(source.check_seconds)
            changes = sorted(source.change_seconds) or [0.0]
            summary.update(
                check_us_p50=1e6 * checks[len(checks) // 2],
                check_us_max=1e6 * checks[-1],
                change_ms_max=1e3 * changes[-1],
                membership_changes=source.membership_changes,
                served_again=source.served_again,
            )
        (work / f"done-g{g}-life{life}.json").write_text(json.dumps(summary))
    finally:
        if source is not None:
            source.close()
        manager.shutdown(wait=False)
    return 0


def _sampler_batches(args: argparse.Namespace, recipe, group: int):
    """torchft's own data path: ``torchft.data.DistributedSampler`` over a map-style view of the same rows (row i is
    row i % B of global batch i // B), sharded over the maximum number of replica groups, batch B / groups rows. A
    rejoining process starts its sampler from the beginning (no data checkpoint), as torchft's examples do."""
    import numpy as np
    import torch
    from torchft.data import DistributedSampler

    from zephon_ray.formats.materialized import MaterializedSource

    B = recipe.global_batch_rows
    with MaterializedSource(args.dataset_dir, recipe=recipe) as source:
        tokens = np.concatenate([source.batch(s).tokens for s in range(args.steps)])
        positions = np.concatenate([source.batch(s).positions for s in range(args.steps)])

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(tokens)

        def __getitem__(self, i):
            return i

    sampler = DistributedSampler(
        Rows(), replica_rank=group, num_replica_groups=args.groups, group_rank=0, num_replicas=1, shuffle=False
    )
    ids = list(sampler)
    per = B // args.groups
    while True:  # epochs, as a DataLoader over the sampler would run them
        for k in range(0, len(ids), per):
            chunk = ids[k : k + per]
            yield chunk, tokens[chunk], positions[chunk]


# ---------------------------------------------------------------------------------------------- the parent
def _event(text: str) -> tuple[int, int]:
    group, _, step = text.partition("@")
    try:
        return int(group), int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GROUP@STEP (e.g. 1@4), got {text!r}") from None


def _spawn(
    args: argparse.Namespace, work: Path, group: int, life: int, lighthouse: str, die_at: list[int], extra: dict
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--replica",
        "--group",
        str(group),
        "--life",
        str(life),
        "--work",
        str(work),
        "--lighthouse",
        lighthouse,
        "--recipe",
        args.recipe,
        "--steps",
        str(args.steps),
        "--groups",
        str(args.groups),
        "--sampler",
        args.sampler,
        "--source",
        args.source,
    ]
    for s in die_at:
        cmd += ["--die-at", str(s)]
    for key, value in extra.items():
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    if _RUST_LOG_SET_HERE:
        env.pop(_RUST_LOG)  # see quiet_torchft_info
    log = open(work / f"replica-g{group}-life{life}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def run(
    args: argparse.Namespace, work: Path, kills: list[tuple[int, int]], rejoins: list[tuple[int, int]], extra: dict
) -> dict:
    """One run: every group from step 0, the kills and rejoins; returns the records and the final weights."""
    from torchft.coordination import LighthouseServer

    work.mkdir(parents=True)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS
    )
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    lives = {g: 0 for g in range(args.groups)}
    try:
        for _, step in rejoins:
            (work / f"hold-{step}").touch()
        for g in range(args.groups):
            procs[(g, 0)] = _spawn(args, work, g, 0, lighthouse.address(), [s for kg, s in kills if kg == g], extra)
        for g in range(args.groups):
            _wait_ready(work / f"ready-g{g}-life0", procs[(g, 0)])
        (work / "go").touch()
        pending_kills, pending_rejoins = sorted(kills, key=lambda e: e[1]), sorted(rejoins, key=lambda e: e[1])
        deadline = time.monotonic() + 10 * EVENT_TIMEOUT_S
        while pending_kills or pending_rejoins:
            if time.monotonic() > deadline:
                raise TimeoutError(f"events never happened: kills {pending_kills}, rejoins {pending_rejoins}")
            for g, s in list(pending_kills):
                marker = work / f"dying-g{g}-{s}"
                if marker.exists():
                    procs[(g, lives[g])].send_signal(signal.SIGKILL)
                    procs[(g, lives[g])].wait()
                    print(f"  killed group {g} (SIGKILL) in the middle of step {s}", flush=True)
                    pending_kills.remove((g, s))
            for g, s in list(pending_rejoins):
                live = [x for x in range(args.groups) if procs[(x, lives[x])].poll() is None and x != g]
                if all((work / f"waiting-g{x}-{s}").exists() for x in live):
                    lives[g] += 1
                    procs[(g, lives[g])] = _spawn(args, work, g, lives[g], lighthouse.address(), [], extra)
                    _wait_ready(work / f"ready-g{g}-life{lives[g]}", procs[(g, lives[g])])
                    _wait_joined(lighthouse.address(), g, procs[(g, lives[g])])
                    (work / f"hold-{s}").unlink()
                    print(f"  group {g} rejoined at step {s} (a new process, no data checkpoint)", flush=True)
                    pending_rejoins.remove((g, s))
            for (g, life), proc in procs.items():
                if proc.poll() not in (None, 0, -signal.SIGKILL):
                    raise RuntimeError(
                        f"group {g} (life {life}) exited with {proc.returncode}: "
                        f"{(work / f'replica-g{g}-life{life}.log').read_text()[-3000:]}"
                    )
            time.sleep(0.02)
        for (g, life), proc in procs.items():
            if proc.wait(timeout=EVENT_TIMEOUT_S) not in (0, -signal.SIGKILL):
                raise RuntimeError(
                    f"group {g} (life {life}) exited with {proc.returncode}: "
                    f"{(work / f'replica-g{g}-life{life}.log').read_text()[-3000:]}"
                )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    return _collect(work)


def _wait_ready(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = path.parent / f"{path.name.replace('ready-', 'replica-')}.log"
            raise RuntimeError(
                f"{path.name}: the replica exited or hung before it was ready: "
                f"{log.read_text()[-3000:] if log.exists() else ''}"
            )
        time.sleep(0.05)


_JOINED = re.compile(r"Next quorum status:.*?\[\d+/(\d+) participants healthy\]", re.S)


def _wait_joined(lighthouse: str, g: int, proc: subprocess.Popen) -> None:
    """Wait until the rejoining group has asked the Lighthouse for a quorum. torchft issues a quorum as soon as every
    member of the previous one has asked again (its "fast quorum"), so the live groups, held at the rejoin step, are
    released only once the new group is among the askers: then the rejoin step's quorum includes it whatever the
    load. Until they ask, it is the only asker: the Lighthouse's status page (torchft 0.2.0) counts it."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while True:
        page = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
        found = _JOINED.search(page)
        if found is None:
            raise RuntimeError(
                f"the Lighthouse's status page at {lighthouse}/status no longer says who asked for a quorum"
            )
        if int(found.group(1)) >= 1:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"group {g} (a new process) never asked the Lighthouse for a quorum")
        time.sleep(0.02)


def _collect(work: Path) -> dict:
    import torch

    records = [json.loads(line) for p in sorted(work.glob("records-*.jsonl")) for line in p.read_text().splitlines()]
    done = [json.loads(p.read_text()) for p in sorted(work.glob("done-*.json"))]
    weights = {p.stem: torch.load(p, weights_only=True) for p in sorted(work.glob("weights-*.pt"))}
    return {"records": records, "done": done, "weights": weights, "work": work}


def global_batches(result: dict, B: int) -> dict[int, dict]:
    """Per committed step: the participants' slices joined in participant order (or why that is impossible)."""
    import numpy as np

    from zephon_ray.batch import compute_digest

    by_step: dict[int, list[dict]] = {}
    for r in result["records"]:
        if r["committed"]:
            by_step.setdefault(r["step"], []).append(r)
    out = {}
    for step, recs in sorted(by_step.items()):
        recs.sort(key=lambda r: r["participant"])
        P = {r["participants"] for r in recs}
        problem = None
        if len(P) != 1 or [r["participant"] for r in recs] != list(range(next(iter(P)))):
            problem = f"committed by participants {[(r['participant'], r['participants']) for r in recs]}"
        parts = [np.load(result["work"] / r["rows"]) for r in recs]
        tokens = np.concatenate([p["tokens"] for p in parts])
        positions = np.concatenate([p["positions"] for p in parts])
        if tokens.shape[0] != B and problem is None:
            problem = f"{tokens.shape[0]} rows, not {B}"
        out[step] = {
            "digest": compute_digest(tokens, positions),
            "participants": len(recs),
            "groups": [r["group"] for r in recs],
            "problem": problem,
            "row_ids": [i for r in recs for i in (r["row_ids"] or [])],
        }
    return out


def _prepare_source(args: argparse.Namespace, work: Path) -> tuple[dict, object]:
    """Materialise the run's steps (dataset) or start a DataService (service) on a private Ray."""
    import ray

    from zephon_ray.recipe import Recipe

    extra: dict = {}
    cleanup = None
    if args.dataset_dir:
        extra["dataset_dir"] = args.dataset_dir
        return extra, cleanup
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(work / "ray"),
        namespace="zr-torchft-churn",
    )
    recipe = Recipe.from_toml(args.recipe)
    if args.source == "service":
        from zephon_ray import DataService

        service = DataService.start(
            recipe, name="churn", namespace="zr-torchft-churn", producers=1, state_dir=str(work / "svc")
        )
        extra.update(service="churn", ray_address=ray.get_runtime_context().gcs_address)
        if args.sampler == "torchft":  # the sampler's map-style view needs the rows on disk
            raise SystemExit("--sampler torchft reads a materialised directory: use --source dataset")
        return extra, service
    from zephon_ray.jobs.materialize import materialize

    directory = work / "materialized"
    materialize(recipe, directory, range(0, args.steps), producers=1, segment_steps=16, progress=False)
    ray.shutdown()
    extra["dataset_dir"] = str(directory)
    return extra, cleanup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill", type=_event, action="append", default=[], metavar="G@S")
    parser.add_argument("--rejoin", type=_event, action="append", default=[], metavar="G@S")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--source", choices=("dataset", "service"), default="dataset")
    parser.add_argument(
        "--dataset-dir",
        default=None,
        help="an existing materialised directory of the recipe "
        "covering steps 0..steps-1 (default: materialise one on a private Ray)",
    )
    parser.add_argument("--sampler", choices=("zephon", "torchft"), default="zephon")
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument(
        "--ledger",
        default=None,
        help="FtSlices write the churned run's ledger here; the run ends with `zephon-ray audit` of it",
    )
    parser.add_argument(
        "--ledger-flush-records",
        type=int,
        default=1024,
        help="each group's ledger moves its spooled parts into a batch file once more than this many wait (FtSlices)",
    )
    # replica-process arguments (internal)
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--life", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--die-at", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--service", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ray-address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica:
        return replica(args)

    quiet_torchft_info()  # before torchft is imported: it reads RUST_LOG once, at import
    args.recipe = str(Path(args.recipe).resolve())
    _check_events(parser, args)
    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.stream.ft import supported_participants

    recipe = Recipe.from_toml(args.recipe)
    B = recipe.global_batch_rows
    supported = supported_participants(recipe)
    print(
        f"torchft churn: {args.groups} replica groups, {args.steps} steps, recipe {args.recipe} (B={B}, "
        f"supported participant counts 1-{supported[-1]}), kills {args.kill}, rejoins {args.rejoin}, rows from "
        f"{'torchft DistributedSampler' if args.sampler == 'torchft' else 'FtSlices (' + args.source + ')'}",
        flush=True,
    )
    base = Path(tempfile.mkdtemp(prefix="zr-torchft-churn-"))
    t0 = time.time()
    service = None
    try:
        extra, service = _prepare_source(args, base)
        churned = run(
            args,
            base / "churn",
            args.kill,
            args.rejoin,
            {**extra, "ledger": args.ledger, "ledger_flush_records": args.ledger_flush_records},
        )
        print(f"  churned run done ({time.time() - t0:.0f} s); failure-free run ...", flush=True)
        reference = run(args, base / "reference", [], [], extra)
        with GlobalBatchSource(recipe) as source:
            expected = [source.batch(s).digest for s in range(args.steps)]
        ok_batches, lines = _report_batches(churned, B, expected, args.steps)
        for line in lines:
            print(line)
        diff = _weights_diff(churned["weights"], reference["weights"])
        ok_weights = diff <= WEIGHT_TOLERANCE
        lost, repeated = _rows_lost_repeated(churned, B, args.steps) if args.sampler == "torchft" else (0, 0)
        checks = [d for d in churned["done"] if "check_us_p50" in d]
        rejected = sum(1 for r in churned["records"] if not r["committed"])
        print(
            f"attempts that should_commit() rejected: {rejected} ("
            + (
                "the sampler moves on: their rows are dropped)"
                if args.sampler == "torchft"
                else "each served again at the next quorum)"
            )
        )
        if checks:
            print(
                f"membership check per step: p50 {max(d['check_us_p50'] for d in checks):.1f} us (worst group), "
                f"max {max(d['check_us_max'] for d in checks):.1f} us; membership changes "
                f"{sum(d['membership_changes'] for d in checks)} (switch at most "
                f"{max(d['change_ms_max'] for d in checks):.1f} ms), same-membership re-serves "
                f"{sum(d['served_again'] for d in checks)}"
            )
        if args.sampler == "torchft":
            print(
                f"torchft DistributedSampler: {lost} rows of steps 0..{args.steps - 1} never trained, {repeated} "
                "trained more than once"
            )
        print(f"identical global batches: {'YES' if ok_batches else 'NO'}")
        print(f"final weights equal the failure-free run: {'YES' if ok_weights else 'NO'} (max abs diff {diff:.3g})")
        audited = 0
        if args.ledger:
            from zephon_ray.cli import main as cli

            print("zephon-ray audit of the churned run's ledger:", flush=True)
            audited = cli(
                ["audit", args.ledger, "--recipe", args.recipe]
                + (["--dataset", extra["dataset_dir"]] if extra.get("dataset_dir") else [])
            )
        print(f"({time.time() - t0:.0f} s)")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "identical_global_batches": ok_batches,
                        "final_weights_equal": ok_weights,
                        "max_abs_diff": diff,
                        "rows_lost": lost,
                        "rows_repeated": repeated,
                        "done": churned["done"],
                        "steps": {str(s): v for s, v in global_batches(churned, B).items()},
                        "expected": expected,
                    },
                    indent=1,
                )
            )
        return 0 if ok_batches and ok_weights and not audited else 1
    finally:
        if service is not None:
            service.stop()
        try:
            import ray

            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(base, ignore_errors=True)


def _check_events(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.groups < 1 or args.steps < 1:
        parser.error("--groups and --steps must be >= 1")
    alive = {g: True for g in range(args.groups)}
    for kind, (g, s) in sorted(
        [("kill", e) for e in args.kill] + [("rejoin", e) for e in args.rejoin], key=lambda x: (x[1][1], x[0] == "kill")
    ):
        if not 0 <= g < args.groups or not 0 <= s < args.steps:
            parser.error(f"--{kind} {g}@{s}: group must be in [0, {args.groups}) and step in [0, {args.steps})")
        if kind == "kill" and not alive[g]:
            parser.error(f"--kill {g}@{s}: group {g} is not running then (kill it once per life)")
        if kind == "rejoin" and alive[g]:
            parser.error(f"--rejoin {g}@{s}: group {g} is running then (rejoin after its kill)")
        alive[g] = kind == "rejoin"
        if not any(alive.values()):
            parser.error(f"--kill {g}@{s} leaves no group alive")
    if len([g for g, _ in args.kill]) != len(set(args.kill)):
        parser.error("the same kill twice")


def _report_batches(result: dict, B: int, expected: list[str], steps: int) -> tuple[bool, list[str]]:
    batches = global_batches(result, B)
    lines, ok = [], sorted(batches) == list(range(steps))
    for step in range(steps):
        got = batches.get(step)
        if got is None:
            lines.append(f"step {step:>3}  never committed")
            ok = False
            continue
        same = got["problem"] is None and got["digest"] == expected[step]
        ok &= same
        note = "ok" if same else "DIFFERS" + (": " + got["problem"] if got["problem"] else "")
        if not same and got["row_ids"] and sorted(got["row_ids"]) == list(range(step * B, (step + 1) * B)):
            note += " (the step's rows, in another order)"
        lines.append(f"step {step:>3}  P={got['participants']}  groups {got['groups']}  {got['digest'][:16]}  {note}")
    return ok, lines


def _weights_diff(churned: dict, reference: dict) -> float:
    if not churned or not reference:
        return float("inf")
    import torch

    ref = next(iter(reference.values()))
    worst = 0.0
    for weights in list(churned.values()) + list(reference.values()):
        for name, value in ref.items():
            worst = max(worst, float(torch.max(torch.abs(weights[name] - value))))
    return worst


def _rows_lost_repeated(result: dict, B: int, steps: int) -> tuple[int, int]:
    from collections import Counter

    counts = Counter(i for r in result["records"] if r["committed"] for i in r["row_ids"])
    lost = sum(1 for i in range(steps * B) if counts[i] == 0)
    repeated = sum(n - 1 for n in counts.values() if n > 1)
    return lost, repeated


if __name__ == "__main__":
    sys.exit(main())
