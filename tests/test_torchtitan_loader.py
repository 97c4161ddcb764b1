"""ZephonRayDataLoader without a trainer: validation, state, local-mode slices, DCP round trip at another W."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_ranks
from tests.ports import held_ports
from zephon_ray import compute_digest
from zephon_ray.docstrings import attribute_docs

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")


def _config(**kw):
    from zephon_ray.torchtitan import ZephonRayDataLoader

    kw.setdefault("recipe", TINY)
    kw.setdefault("mode", "local")
    return ZephonRayDataLoader.Config(**kw)


@pytest.fixture
def distributed_env(monkeypatch):
    """No aggregation configured anywhere; WORLD_SIZE set to a misleading value (the loader must ignore it)."""
    monkeypatch.setenv("WORLD_SIZE", "7")
    monkeypatch.delenv("ZEPHON_RAY_AGGREGATE_DIR", raising=False)
    return monkeypatch


def _build_dp2(cfg):
    """Build dp rank 0 of 2, as TorchTitan's Trainer does (the dp degree is only known here)."""
    return cfg.build(dp_world_size=2, dp_rank=0, seq_len=64, local_batch_size=2)


# ---------------------------------------------------------------------- validation when the Config / loader is built
def test_distributed_local_run_needs_run_id(distributed_env):
    with pytest.raises(ValueError, match=r"data-parallel degree 2\) needs 'run_id'"):
        _build_dp2(_config(aggregate_dir="/tmp/x"))
    # WORLD_SIZE=7 is not the dp degree: a dp=1 loader (e.g. under tensor parallelism) needs neither.
    _config().build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=2).close()


def test_aggregate_store_and_dir_both_set_is_an_error():
    with pytest.raises(ValueError, match="exactly one of 'aggregate_store' and 'aggregate_dir'.*both"):
        _config(run_id="r", aggregate_store="torch://", aggregate_dir="/tmp/x")


def test_distributed_local_run_needs_an_aggregation_point(distributed_env):
    with pytest.raises(ValueError, match="exactly one of 'aggregate_store'.*neither is set"):
        _build_dp2(_config(run_id="r"))


def test_unreachable_torch_store_is_an_error(distributed_env):
    with held_ports(2) as (master, other):  # held, not listening: no TCPStore answers there, and none can start
        distributed_env.setenv("MASTER_ADDR", "127.0.0.1")
        distributed_env.setenv("MASTER_PORT", str(master))
        with pytest.raises(ValueError, match="no TCPStore is reachable at 127.0.0.1"):
            _build_dp2(_config(run_id="r", aggregate_store="torch://"))
        with pytest.raises(ValueError, match="no TCPStore is reachable"):
            _build_dp2(_config(run_id="r", aggregate_store=f"torch://127.0.0.1:{other}"))


def test_reachable_torch_store_and_env_dir_override(distributed_env, tmp_path):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    distributed_env.setenv("MASTER_ADDR", "127.0.0.1")
    distributed_env.setenv("MASTER_PORT", str(store.port))
    cfg = _config(run_id="r", aggregate_store="torch://")
    assert cfg.resolved_aggregation()[:2] == ("torch://", None)
    _build_dp2(cfg).close()
    # The documented variable switches a torch:// config to directory aggregation from the launch command.
    distributed_env.setenv("ZEPHON_RAY_AGGREGATE_DIR", str(tmp_path))
    assert _config(run_id="r", aggregate_store="torch://").resolved_aggregation()[:2] == (None, str(tmp_path))


def test_bad_mode_and_missing_recipe():
    with pytest.raises(ValueError, match="'mode' must be one of"):
        _config(mode="ray")
    with pytest.raises(ValueError, match="'recipe'"):
        _config(recipe="")


# ---------------------------------------------------------------------- validation when the loader is built
def test_seq_len_mismatch():
    with pytest.raises(ValueError, match="seq_len 128 differs from the recipe's seq_len 64"):
        _config().build(dp_world_size=1, dp_rank=0, seq_len=128, local_batch_size=4)


def test_w_not_dividing_the_global_batch_is_padded_and_asks_for_the_padded_trainer_batch():
    """dp 3 on B = 16: every rank is padded to 6 rows (labels ignored); the trainer's global batch must count them
    (18 = 16 + 2 padding rows), and the error says exactly that; with it set, each rank takes 6 microbatches."""
    with pytest.raises(ValueError, match=r"set training.global_batch_size = 18 = 16 rows \+ 2 padding rows"):
        _config(mode="service", global_batch_size=16).build(dp_world_size=3, dp_rank=0, seq_len=64, local_batch_size=1)
    with pytest.raises(ValueError, match="does not fit the recipe's global batch of 16 rows"):
        _config(mode="service").build(dp_world_size=17, dp_rank=0, seq_len=64, local_batch_size=1)


def test_local_mode_w_not_dividing_lanes(tmp_path):
    # W=16 divides B=16 but not L=8 lanes: only the service can serve it.
    with pytest.raises(ValueError, match="divide the recipe's 8 lanes, got 16"):
        _config(run_id="r", aggregate_dir=str(tmp_path)).build(
            dp_world_size=16, dp_rank=0, seq_len=64, local_batch_size=1
        )


def test_trainer_global_batch_mismatch():
    with pytest.raises(ValueError, match="global batch 32 differs from the recipe's global batch of 16"):
        _config(global_batch_size=32).build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=4)
    # TorchTitan's -1 means local_batch_size x dp (no gradient accumulation): 4 x 2 = 8 rows, not 16.
    with pytest.raises(ValueError, match=r"global batch 8 \(training.global_batch_size is -1.*4 x dp 2\) differs"):
        _config(mode="service", global_batch_size=-1).build(dp_world_size=2, dp_rank=0, seq_len=64, local_batch_size=4)


def test_build_keywords_are_torchtitans_and_required():
    """dp_world_size/dp_rank have no defaults, and a keyword TorchTitan does not pass (say, a renamed one) is one
    TypeError naming it, not silently swallowed."""
    with pytest.raises(TypeError, match="missing .*'dp_world_size'"):
        _config().build(dp_rank=0, seq_len=64, local_batch_size=4)
    with pytest.raises(TypeError, match="missing .*'dp_rank'"):
        _config().build(dp_world_size=1, seq_len=64, local_batch_size=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dp_degree'"):
        _config().build(dp_world_size=1, dp_rank=0, dp_degree=2, seq_len=64, local_batch_size=4)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"dp_world_size": None}, r"build: dp_world_size must be an int in \[1, .*\], got None"),
        ({"dp_world_size": 2.0}, r"build: dp_world_size must be an int in \[1, .*\], got 2.0"),
        ({"dp_rank": None}, r"build: dp_rank must be an int in \[0, dp_world_size=1\), got None"),
        ({"dp_rank": 1}, r"build: dp_rank must be an int in \[0, dp_world_size=1\), got 1"),
        ({"local_batch_size": 0}, r"build: local_batch_size must be an int in \[1, .*\], got 0"),
        ({"snapshot_every_n_steps": "10"}, "build: snapshot_every_n_steps must be an int"),
    ],
)
def test_bad_build_numbers_are_one_line_naming_the_keyword(kw, message):
    with pytest.raises(ValueError, match=message) as info:
        _config().build(**{"dp_world_size": 1, "dp_rank": 0, "seq_len": 64, "local_batch_size": 4, **kw})
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------- state
def test_state_before_iteration_is_json_safe_and_complete():
    from zephon_ray.formats.loader_state import STATE_KEYS

    with _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=4) as loader:
        state = loader.state_dict()
    assert tuple(state) == STATE_KEYS
    assert json.loads(json.dumps(state)) == state
    assert state["next_step"] == 0 and state["zephon"] == ""


def _token_digest(tokens) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).hexdigest()


@pytest.fixture(scope="module")
def reference_tokens(tiny_recipe):
    """sha256 of each step's token rows (what a trainer's microbatches carry) from the in-process reference."""
    from zephon_ray import GlobalBatchSource

    with GlobalBatchSource(tiny_recipe) as source:
        return [_token_digest(source.batch(step).tokens) for step in range(8)]


def test_local_slices_match_reference_and_resume_at_other_w(tmp_path, reference_tokens):
    """W=2 local ranks (directory aggregation) give the reference batches; their states are identical; the state
    resumes at W=1 and W=4 with the same batches; a mid-step checkpoint and a wrong recipe/run_id fail clearly."""
    from zephon_ray.torchtitan import LoaderStateError

    def build(world, agg, run_id="r", lbs=2):
        cfg = _config(run_id=run_id, aggregate_dir=str(agg), checkpoint_every=3)
        return [cfg.build(dp_world_size=world, dp_rank=r, seq_len=64, local_batch_size=lbs) for r in range(world)]

    def run_steps(loaders, iters, n):
        """n steps of every loader (its microbatches, as TorchTitan pulls them); the rows of each step are
        rebuilt from the microbatches: input plus the last label column (the tiny recipe packs with 'wrap')."""
        digests = []
        for _ in range(n):

            def pull(i):
                mbs = [next(iters[i]) for _ in range(loaders[i].microbatches_per_step)]
                return np.concatenate([np.concatenate([x["input"].numpy(), y.numpy()[:, -1:]], axis=1) for x, y in mbs])

            digests.append(_token_digest(np.concatenate(run_ranks(len(loaders), pull))))
        return digests

    loaders = build(2, tmp_path / "a")
    iters = [iter(l) for l in loaders]
    assert run_steps(loaders, iters, 3) == reference_tokens[:3]
    states = run_ranks(2, lambda i: loaders[i].state_dict())
    assert states[0] == states[1] and states[0]["next_step"] == 3 and states[0]["zephon"]
    next(iters[0])  # half of rank 0's step 3 (4 microbatches of 2 rows)
    with pytest.raises(LoaderStateError, match="middle of step 3: 1 of 4 microbatches"):
        loaders[0].state_dict()
    for l in loaders:
        l.close()

    state = json.loads(json.dumps(states[0]))
    for world in (1, 4):
        resumed = build(world, tmp_path / f"w{world}")
        for l in resumed:
            l.load_state_dict(state)
        assert run_steps(resumed, [iter(l) for l in resumed], 3) == reference_tokens[3:6]
        for l in resumed:
            l.close()

    other = build(1, tmp_path / "x", run_id="another-run")[0]
    with pytest.raises(LoaderStateError, match="run_id 'r'.*another-run"):
        other.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="fingerprint"):
        build(1, tmp_path / "y")[0].load_state_dict({**state, "fingerprint": "0" * 64})


def test_different_recipe_on_resume_is_an_error(tmp_path):
    from zephon_ray.torchtitan import LoaderStateError

    tiny = _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=4)
    elastic = _config(run_id="r", recipe=str(ROOT / "recipes" / "elastic.toml")).build(
        dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=4
    )
    with pytest.raises(LoaderStateError, match="recipe fingerprint .* but this run uses .*elastic.toml"):
        elastic.load_state_dict(tiny.state_dict())


# ---------------------------------------------------------------------- DCP at another W
_DCP_WORKER = r"""
import json, os, sys
import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from zephon_ray import compute_digest
from zephon_ray.docstrings import attribute_docs
from zephon_ray.torchtitan import ZephonRayDataLoader

phase, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
loader = ZephonRayDataLoader.Config(recipe=os.environ["RECIPE"], mode="local", run_id="dcp",
                                    aggregate_store="torch://", checkpoint_every=3).build(
    dp_world_size=world, dp_rank=rank, seq_len=64, local_batch_size=16 // world)
if phase == "load":
    state = {"dataloader": loader}
    dcp.load(state, checkpoint_id=ckpt)
it = loader.steps()
digests = []
for _ in range(3):
    s = next(it).slice
    parts = [None] * world
    dist.all_gather_object(parts, (s.tokens, s.positions))
    digests.append(compute_digest(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
if phase == "save":
    dcp.save({"dataloader": loader}, checkpoint_id=ckpt)
state = loader.state_dict()
states = [None] * world
dist.all_gather_object(states, state)
assert all(s == state for s in states), "loader state differs between ranks"
if rank == 0:
    json.dump({"digests": digests, "state": state, "world": world}, open(out, "w"))
loader.close()
dist.destroy_process_group()
"""


@pytest.mark.slow  # two torchruns (~35 s); the default suite saves and loads through DCP at another world with the
# real Trainer: tests/test_torchtitan_train.py::test_resume_at_another_world
def test_dcp_save_and_load_at_another_world(tmp_path, reference_digests):
    script = tmp_path / "dcp_worker.py"
    script.write_text(_DCP_WORKER)
    env = {**os.environ, "RECIPE": TINY, "PYTHONPATH": str(ROOT)}
    env.pop("ZEPHON_RAY_AGGREGATE_DIR", None)

    def torchrun(nproc, phase, out):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            phase,
            str(tmp_path / "ckpt"),
            str(out),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())

    saved = torchrun(2, "save", tmp_path / "save.json")
    assert saved["digests"] == reference_digests[0:3]
    assert saved["state"]["next_step"] == 3 and json.loads(saved["state"]["zephon"])["next_step"] == 3
    loaded = torchrun(1, "load", tmp_path / "load.json")
    assert loaded["digests"] == reference_digests[3:6]
    assert loaded["state"]["next_step"] == 6


def test_local_state_between_checkpoints_restores_and_replays(tmp_path, reference_digests):
    """Checkpoints every 2 steps; a state taken at step 3 carries the step-2 checkpoint and resumes (here at W=2) by
    restoring it and replaying step 2, so the next batch is still step 3."""
    loader = _config(run_id="r", checkpoint_every=2).build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    loader.close()
    assert state["next_step"] == 3 and json.loads(state["zephon"])["next_step"] == 2

    cfg = _config(run_id="r", aggregate_dir=str(tmp_path))
    resumed = [cfg.build(dp_world_size=2, dp_rank=r, seq_len=64, local_batch_size=8) for r in range(2)]
    for l in resumed:
        l.load_state_dict(state)
        assert l.state_dict() == state  # before iteration: the loaded state, unchanged
    iters = [l.steps() for l in resumed]
    for step in (3, 4):
        rows = [next(i).slice for i in iters]
        assert (
            compute_digest(np.concatenate([r.tokens for r in rows]), np.concatenate([r.positions for r in rows]))
            == reference_digests[step]
        )
    for l in resumed:
        l.close()


# ---------------------------------------------------------------------- loud replays
def _one_rank_state_after(steps: int) -> dict:
    """The state of a one-rank loader (checkpointing off) that took ``steps`` steps."""
    loader = _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = loader.state_dict()
    loader.close()
    return state


def test_resume_without_a_zephon_checkpoint_warns_and_reports_the_replay(caplog, reference_digests):
    """Checkpointing off: the state at step 3 carries no Zephon blob, so the resume replays steps 0..2. It says so
    (a warning with the count), ``stats`` and the next state report it, and the batches are still the reference."""
    state = _one_rank_state_after(3)
    assert state["next_step"] == 3 and state["zephon"] == "" and state["replayed_steps"] == 0

    resumed = _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
    with caplog.at_level("WARNING", logger="zephon_ray.stream.loader"):
        resumed.load_state_dict(state)
    assert any(
        "has no Zephon checkpoint" in r.message and "replaying 3 steps from step 0" in r.message for r in caplog.records
    ), [r.message for r in caplog.records]
    assert resumed.stats["resume_replay"] == 3 and resumed.stats["resumed_from_checkpoint"] is None
    assert resumed.state_dict() == state  # nothing replayed yet: the loaded state, unchanged
    piece = next(resumed.steps()).slice
    assert compute_digest(piece.tokens, piece.positions) == reference_digests[3]
    assert resumed.stats["replayed_steps"] == 3
    later = resumed.state_dict()
    assert later["next_step"] == 4 and later["replayed_steps"] == 3  # carried on to the next resume
    resumed.close()


def test_exact_checkpoint_resume_is_quiet(caplog):
    loader = _config(run_id="r", checkpoint_every=2).build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = loader.state_dict()
    loader.close()
    resumed = _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
    with caplog.at_level("WARNING", logger="zephon_ray.stream.loader"):
        resumed.load_state_dict(state)
    assert not [r for r in caplog.records if "replaying" in r.message]
    assert resumed.stats["replayed_steps"] == 0 and resumed.stats["resumed_from_checkpoint"] == 2
    resumed.close()


def test_old_state_version_is_refused_by_key():
    from zephon_ray.torchtitan import LoaderStateError

    with _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16) as loader:
        old = {k: v for k, v in loader.state_dict().items() if k != "replayed_steps"} | {"version": 1}
        with pytest.raises(LoaderStateError, match="key 'version': version 1 is not supported.*replayed_steps"):
            loader.load_state_dict(old)
        with pytest.raises(LoaderStateError, match=r"key 'replayed_steps' must be an int in \[0, .*\], got -1"):
            loader.load_state_dict(loader.state_dict() | {"replayed_steps": -1})


TORCHTITAN_ONLY = "TorchTitan:"
"""How ZephonRayDataLoader.Config's docstring marks a field that it declares beyond, or otherwise than, LoaderConfig."""


def test_the_torchtitan_config_declares_every_loader_config_field():
    """ZephonRayDataLoader.Config is written out (type checkers and tyro read it as declared); this keeps it equal to
    LoaderConfig: every LoaderConfig field with its type, default and docstring, in LoaderConfig's order, except the
    fields whose docstring starts "TorchTitan:" (a default for ``recipe`` for TorchTitan's CLI, padding on by default,
    TorchTitan's checkpoint interval, and TorchTitan's own fields); it passes TorchTitan's Configurable checks (slots,
    keyword only, ``build()`` wired to the loader) and pickles."""
    import pickle
    import typing
    from dataclasses import fields

    from torchtitan.components.dataloader import BaseDataLoader

    from zephon_ray.stream.loader import LoaderConfig
    from zephon_ray.torchtitan import ZephonRayDataLoader

    config_cls = ZephonRayDataLoader.Config
    titan = {f.name: f for f in fields(config_cls)}
    titan_docs, core_docs = attribute_docs(config_cls), attribute_docs(LoaderConfig)
    titan_hints, core_hints = typing.get_type_hints(config_cls), typing.get_type_hints(LoaderConfig)
    own = {name for name, doc in titan_docs.items() if doc.startswith(TORCHTITAN_ONLY)}
    assert own == {"recipe", "checkpoint_every", "pad_slices", "global_batch_size", "infinite"}
    for f in fields(LoaderConfig):
        assert f.name in titan, f"ZephonRayDataLoader.Config lacks LoaderConfig.{f.name}"
        assert titan_hints[f.name] == core_hints[f.name] and titan[f.name].kw_only, f.name
        if f.name not in own:
            assert titan[f.name].default == f.default, (f.name, titan[f.name].default, f.default)
            assert titan_docs[f.name] == core_docs[f.name], f"the docstrings of {f.name} differ"
    assert (titan["recipe"].default, titan["pad_slices"].default) == ("", True)
    ours = [name for name in titan if name not in {f.name for f in fields(BaseDataLoader.Config)}]
    assert ours == [f.name for f in fields(LoaderConfig)] + ["global_batch_size", "infinite"]
    assert "__slots__" in config_cls.__dict__ and config_cls._owner is ZephonRayDataLoader
    assert config_cls.__qualname__ == "ZephonRayDataLoader.Config"
    config = _config(run_id="r")
    assert pickle.loads(pickle.dumps(config)) == config and config.core().run_id == "r"


def test_torchtitan_help_shows_every_field_docstring(monkeypatch, capsys):
    """TorchTitan's CLI parser (tyro) shows each field's docstring in ``--help``."""
    import re
    from dataclasses import fields

    import tyro

    from zephon_ray.torchtitan import ZephonRayDataLoader

    monkeypatch.setenv("COLUMNS", "2000")  # one help line per field, nothing wrapped
    config_cls = ZephonRayDataLoader.Config
    with pytest.raises(SystemExit):
        tyro.cli(config_cls, args=["--help"], default=_config())
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    docs = attribute_docs(config_cls)
    for f in fields(config_cls):
        if f.name in ("dataset", "dataset_path"):  # TorchTitan's own, undocumented there
            continue
        flag = "--" + f.name.replace("_", "-")
        assert re.search(re.escape(flag) + r"\S* \S+ " + re.escape(" ".join(docs[f.name].split())), help_text), (
            flag,
            docs[f.name],
        )


def test_torchtitans_cli_sets_the_config_fields(monkeypatch, capsys):
    """TorchTitan's own parser (ConfigManager, tyro) on the config registry: ``--dataloader.*`` flags reach the
    config, LoaderConfig's fields and TorchTitan's alike; a bad value is LoaderConfig's error (tyro boxes it)."""
    from torchtitan.config import ConfigManager

    from zephon_ray.torchtitan import ZephonRayDataLoader

    base = ["--module", "zephon_ray.integrations.torchtitan", "--config", "zephon_llama3_debugmodel"]
    config = ConfigManager().parse_args(
        base
        + [
            "--dataloader.prefetch",
            "3",
            "--dataloader.no-pad-slices",
            "--dataloader.run-id",
            "cli",
            "--dataloader.infinite",
        ]
    )
    loader = config.dataloader
    assert isinstance(loader, ZephonRayDataLoader.Config)
    assert (loader.prefetch, loader.pad_slices, loader.run_id, loader.core().prefetch) == (3, False, "cli", 3)
    monkeypatch.setenv("COLUMNS", "2000")  # tyro prints the error in a box: one line, nothing wrapped
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(base + ["--dataloader.mode", "nowhere"])
    printed = capsys.readouterr()
    assert "loader config: 'mode' must be one of ('service', 'local', 'dataset'), got 'nowhere'" in (
        printed.out + printed.err
    )


def test_a_trainer_step_other_than_the_loaders_next_step_is_refused_before_the_first_batch():
    """``ZephonTrainer.load_state_dict`` hands the restored step to the loader (``expect_trainer_step``; the real
    Trainer's route: tests/test_torchtitan_train.py::test_a_checkpoint_whose_loader_state_was_not_loaded_is_refused).
    A loader state at step 3 under weights of step 2, or no loader state at all under weights of step 2, stops at
    the first batch naming both numbers; the same step trains on."""
    from zephon_ray.formats.loader_state import LoaderStateError

    state = _one_rank_state_after(3)
    for loaded, trainer, message in [
        (
            state,
            2,
            "the trainer's checkpoint is at step 2 but the data loader's next_step is 3: resuming would "
            "skip 1 step(s); load the loader state saved with those weights (is 'dataloader' in "
            "checkpoint.exclude_from_loading?)",
        ),
        (
            None,
            2,
            "the trainer's checkpoint is at step 2 but the data loader's next_step is 0: resuming would "
            "repeat 2 step(s)",
        ),
    ]:
        resumed = _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
        resumed.expect_trainer_step(trainer)  # TorchTitan's DCP loads train_state first
        if loaded is not None:
            resumed.load_state_dict(loaded)
        with pytest.raises(LoaderStateError) as info:
            next(iter(resumed))
        assert str(info.value).startswith(message) and "\n" not in str(info.value)
        resumed.close()
    resumed = _config(run_id="r").build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
    resumed.load_state_dict(state)
    resumed.expect_trainer_step(3)
    assert next(resumed.steps()).slice.step == 3
    resumed.close()


def test_source_ids_wait_beside_the_input_dict():
    """``source_ids = true``: the dicts TorchTitan gets hold only ``input`` and ``positions``; ``pop_source_ids``
    gives each microbatch's ids in yield order, the labels' part of the step's provenance (steps 0-5 of tiny: both
    sources)."""
    from zephon_ray import GlobalBatchSource, Recipe

    loader = _config(source_ids=True).build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=4)
    got, ids = [], []
    try:
        stream = iter(loader)
        for _ in range(6):  # a step: 16 rows in 4 microbatches, popped within the step
            step = [next(stream) for _ in range(4)]
            ids.append(np.concatenate([loader.pop_source_ids().numpy() for _ in step]))
            got.append(step)
        with pytest.raises(LookupError, match="pop_source_ids"):
            loader.pop_source_ids()
    finally:
        loader.close()
    assert all(set(inputs) == {"input", "positions"} for step in got for inputs, _ in step)
    with GlobalBatchSource(Recipe.from_toml(TINY)) as source:
        for s, (step, step_ids) in enumerate(zip(got, ids)):
            assert np.array_equal(np.concatenate([labels.numpy() for _, labels in step]), source.batch(s).tokens[:, 1:])
            assert np.array_equal(step_ids, source.provenance(s).source_ids()[:, 1:])
    assert set(np.unique(np.concatenate(ids))) == {0, 1}


def test_a_route_without_the_trainer_step_check_warns_once(caplog, monkeypatch):
    """The stock ``Trainer`` (``--override.imports`` with the loader alone) checks no restored trainer step against
    the loader's ``next_step``: the first batch logs one warning naming the two routes that do; a second loader in the
    process stays quiet, and a loader whose owner registered the check (``ZephonTrainer``, the override route's
    ``ZephonCheckpointManager``) never warns."""
    from zephon_ray.integrations.torchtitan import loader as titan_loader

    def first_batch(register: bool) -> list[str]:
        loader = _config().build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
        if register:
            loader.register_trainer_step_check("ZephonCheckpointManager")
        caplog.clear()
        with caplog.at_level("WARNING", logger="zephon_ray"):
            next(iter(loader))
        loader.close()
        return [r.getMessage() for r in caplog.records if "trainer's restored step" in r.getMessage()]

    monkeypatch.setattr(titan_loader, "_WARNED_UNCHECKED", False)
    assert first_batch(register=True) == []
    (line,) = first_batch(register=False)
    assert "\n" not in line and "ZephonTrainer" in line and "overrides.zephon_checkpoint" in line, line
    assert first_batch(register=False) == []  # once per process
