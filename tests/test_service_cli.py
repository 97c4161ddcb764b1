"""`zephon-ray digest --via service` (M = 2) prints the committed golden digests (tests/golden/, made by the
independent oracle); CLI errors are clean.

The service run starts its own private local Ray (no --address), so these tests need no fixture cluster. M = 1 and
M = 2 giving the same batches through the service is tests/test_service.py::test_digests_and_slices_match_reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
pytestmark = pytest.mark.timeout(400)


def _env():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args):
    return [sys.executable, "-m", "zephon_ray.cli", *args]


@pytest.mark.heavy
@pytest.mark.spawns
def test_digest_via_service_prints_the_golden_digests(reference_digests):
    proc = subprocess.run(
        _cli("digest", str(TINY), "--steps", "0:12", "--via", "service", "--producers", "2"),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=360,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stdout.splitlines() == [f"step {i} {reference_digests[i]}" for i in range(12)]


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5", ""])
def test_rescale_with_a_bad_count_is_one_line(capsys, value):
    """Checked before Ray is touched: no cluster needed, nothing changed anywhere."""
    code, out, err = _main(capsys, "rescale", value, "--name", "nowhere", "--namespace", "nowhere")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"zephon-ray: error: rescale: producers must be a positive integer (a "
        f"divisor of the recipe's lanes), got {value!r}"
    ]


@pytest.mark.parametrize("weight", ["prose", "=1", "prose=x"])
def test_add_phase_with_a_bad_weight_is_one_line(capsys, weight):
    """Checked before Ray is touched."""
    code, out, err = _main(capsys, "add-phase", "p", "--start-step", "9", "--weight", weight, "--name", "nowhere")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"zephon-ray: error: add-phase: --weight {weight!r} is not SOURCE=WEIGHT (e.g. --weight prose=0.2)"
    ]


def test_service_cli_errors_are_one_line():
    proc = subprocess.run(
        _cli("digest", str(TINY), "--steps", "0:2", "--via", "service", "--producers", "3"),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("zephon-ray: error: ")
    assert "producers=3 does not divide" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


# ---------------------------------------------------------------------- serve flags, status, rescale, release, inspect
def _main(capsys, *args):
    """The CLI in-process, attached to the test's private cluster: (exit code, stdout, stderr)."""
    from zephon_ray.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# Proves cli/service.py: `serve` has one flag per ServiceConfig field.
def test_serve_has_a_flag_for_every_service_config_field():
    import dataclasses
    import typing

    from zephon_ray.cli import build_parser
    from zephon_ray.cli.service import service_config_fields
    from zephon_ray.service.config import ServiceConfig

    def leaves(cls, prefix=""):  # every field, nested dataclasses (resources) as "resources.<field>"
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from leaves(hints[f.name], prefix + f.name + ".")
            else:
                yield prefix + f.name

    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    missing = [name for name in leaves(ServiceConfig) if "--" + name.replace("_", "-") not in help_text]
    assert not missing, f"serve lacks flags for ServiceConfig fields {missing}"
    # Each flag's help is its field's docstring (every field has one), as one line of plain text.
    from zephon_ray.docstrings import attribute_docs
    from zephon_ray.service.config import ActorResources

    flat = "".join(help_text.split())  # argparse wraps at spaces and hyphens
    for cls in (ServiceConfig, ActorResources):
        for name in {f.name for f in dataclasses.fields(cls)} - {"resources"}:
            doc = attribute_docs(cls).get(name)
            assert doc, f"{cls.__name__}.{name} has no docstring"
            assert "".join(doc.replace("``", "").split()) in flat, f"serve --help lacks the docstring of {name}"

    args = build_parser().parse_args(["serve", "tiny"])  # defaults: exactly ServiceConfig's
    assert ServiceConfig(**service_config_fields(args)) == ServiceConfig()
    args = build_parser().parse_args(
        [
            "serve",
            "tiny",
            "--window",
            "3",
            "--consumer-ttl-s",
            "7.5",
            "--run-id",
            "r",
            "--resources.producer-num-cpus",
            "0.125",
        ]
    )
    fields = service_config_fields(args)
    assert (fields["window"], fields["consumer_ttl_s"], fields["run_id"]) == (3, 7.5, "r")
    assert fields["resources"].producer_num_cpus == 0.125


@pytest.mark.heavy
def test_serve_status_rescale_release_stop_then_inspect_offline(ray_cluster, capsys, tmp_path, reference_digests):
    import json

    from zephon_ray import DataService

    state_dir = tmp_path / "state"
    where = ("--name", "cli-ops", "--namespace", "cli-tests")
    code, out, err = _main(
        capsys,
        "serve",
        "tiny",
        *where,
        "--state-dir",
        state_dir,
        "--checkpoint-every",
        "2",
        "--window",
        "4",
        "--consumer-ttl-s",
        "90",
        "--run-id",
        "cli-ops",
        "--aggregate-store",
        "torch://",
        "--resources.producer-num-cpus",
        "0.125",
    )
    assert code == 0, err
    assert "serving" in out and "'cli-ops'" in out
    svc = DataService.connect("cli-ops", namespace="cli-tests", consumer="trainer")
    try:
        cfg = svc.config  # every flag reached the running service's config
        assert (cfg.window, cfg.checkpoint_every, cfg.consumer_ttl_s, cfg.resources.producer_num_cpus) == (
            4,
            2,
            90,
            0.125,
        )
        for step in range(5):
            assert svc.slice(step, 0, 1, track=True).tokens.shape[0] == 16
        svc.commit(4)

        code, out, err = _main(capsys, "status", *where)
        assert code == 0, err
        for needle in (
            "producers   1",
            "window ",
            "steps ready at or ahead of the slowest live cursor (step 4)",
            "cursors     1",
            "trainer",
            "throughput ",
            "checkpoints ",
            "commits ",
            f"fingerprint {svc.recipe.fingerprint}",
        ):
            assert needle in out, (needle, out)
        code, out, _ = _main(capsys, "status", *where, "--json")
        status = json.loads(out)
        assert status["fingerprint"] == svc.recipe.fingerprint and len(status["producers"]) == 1

        code, out, err = _main(capsys, "rescale", "3", *where)  # 3 does not divide 8 lanes: one line, no change
        assert code == 2 and "producers=3 does not divide" in err and len(err.strip().splitlines()) == 1
        code, out, err = _main(capsys, "rescale", "2", *where)
        assert code == 0 and "to 2 producers" in out, err
        assert svc.batch(6).digest == reference_digests[6]
        assert len(svc.status()["producers"]) == 2

        # add-phase: refused at or before a step the consumer read (one line naming it), then accepted ahead
        add = ("add-phase", "anneal", "--weight", "prose=1", *where)
        code, out, err = _main(capsys, *add, "--start-step", "3")
        assert code == 2 and "consumer 'trainer' has read step 4" in err and len(err.strip().splitlines()) == 1
        code, out, err = _main(capsys, *add, "--start-step", "40")
        assert code == 0 and "phase 'anneal' from step 40 added" in out, err

        code, out, err = _main(capsys, "release", "nobody", *where)  # never read, never committed: refused
        assert code == 2 and "has no consumer 'nobody'" in err and "'trainer'" in err, err
        assert len(err.strip().splitlines()) == 1
        code, out, err = _main(capsys, "release", "trainer", *where)
        assert code == 0, err
        assert not [c for c in svc.status()["cursors"] if c["consumer"] == "trainer" and c["live"]]
    finally:
        code, out, err = _main(capsys, "stop", *where)
    assert code == 0 and "stopped" in out, err
    code, _, err = _main(capsys, "status", *where)
    assert code == 2 and "cli-ops" in err

    # Offline: a fresh interpreter that never imports Ray reads what the service left behind.
    probe = (
        "import json, sys; from zephon_ray.cli import main; rc = main(['inspect', sys.argv[1], '--json']); "
        "assert 'ray' not in sys.modules, 'inspect imported ray'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(state_dir)], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    added = svc.recipe.with_phase("anneal", 40, {"prose": 1.0})
    assert report["fingerprint"] == added.fingerprint and report["lanes"] == 8
    assert [(p["name"], p["start_step"], p["added"]) for p in report["schedule"]] == [
        ("sources", 0, False),
        ("anneal", 40, True),
    ]
    assert report["checkpoints"]["count"] >= 1 and all(s % 2 == 0 for s in report["checkpoints"]["steps"])
    assert report["commits"]["latest_step"] == 4 and report["commits"]["by_consumer"] == {"trainer": 4}
    code, out, _ = _main(capsys, "inspect", state_dir)
    assert code == 0 and "trainer: resumes at step 4" in out
    assert "schedule    from step 0: sources (prose 0.6, code 0.4)" in out
    assert "from step 40: anneal (prose 1, code 0)  [added while running]" in out

    code, _, err = _main(capsys, "inspect", tmp_path / "nothing-here")
    assert code == 2 and "service.json" in err and len(err.strip().splitlines()) == 1
