"""ServiceConfig: validation at construction, no I/O; the durable state's fingerprint refusal. No Ray.

(The state_dir format itself, atomic writes included, is tested in tests/test_service_state.py, its owner's file.)
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from zephon_ray.formats.service_state import SERVICE_FILE, ServiceState, check_state_dir
from zephon_ray.service.config import ActorResources, ServiceConfig
from zephon_ray.service.errors import FingerprintMismatchError


def test_valid_defaults():
    cfg = ServiceConfig()
    assert cfg.producers == 1 and cfg.window >= 1 and cfg.checkpoint_every >= 1


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"window": 0}, "window"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"producers": 0}, "producers"),
        ({"producers": 2, "aggregate_store": "torch://"}, "run_id"),
        ({"producers": 2, "run_id": "r"}, "exactly one of aggregate_store and aggregate_dir"),
        ({"producers": 2, "run_id": "r", "aggregate_store": "torch://", "aggregate_dir": "/tmp/x"}, "not both"),
        ({"aggregate_store": "tcp://h:1"}, "aggregate_store"),
        ({"name": "a/b"}, "name"),
        ({"consumer_ttl_s": 0}, "consumer_ttl_s"),
        ({"pack_bytes": -1}, r"pack_bytes must be an int in \[0, 1073741824\], got -1"),
        ({"pack_bytes": True}, "pack_bytes"),
    ],
)
def test_invalid_config_raises_at_construction(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ServiceConfig(**kwargs)


def test_producers_must_divide_lanes(tiny_recipe):
    with pytest.raises(ValueError, match=r"producers=3 does not divide the recipe's 8 lanes"):
        ServiceConfig(producers=3, run_id="r", aggregate_store="torch://").for_recipe(tiny_recipe)
    ServiceConfig(producers=4, run_id="r", aggregate_store="torch://").for_recipe(tiny_recipe)


def test_recipe_aggregate_fills_unset_fields(tiny_recipe, tmp_path):
    recipe = replace(tiny_recipe, aggregate=replace(tiny_recipe.aggregate, dir=str(tmp_path)))
    cfg = ServiceConfig.build(recipe, producers=2, run_id="r")  # the recipe's [aggregate] dir makes M=2 valid
    assert cfg.aggregate_dir == str(tmp_path) and cfg.producers == 2
    with pytest.raises(ValueError, match="not both"):
        ServiceConfig.build(recipe, producers=2, run_id="r", aggregate_store="torch://h:1", aggregate_dir="/x")
    base = ServiceConfig(run_id="r")
    cfg = base.for_recipe(recipe)
    assert cfg.aggregate_dir == str(tmp_path) and cfg.aggregate_store is None
    cfg.check_lanes(recipe, 2)  # now a 2-producer rescale is allowed


def test_build_defaults_run_id_and_hosted_store(tiny_recipe, tmp_path):
    """A service's run_id defaults to its name and its aggregation to the TCPStore it hosts, so producers=2 needs
    no more arguments than producers=1; explicit values win, and the recipe's [aggregate] table comes first."""
    cfg = ServiceConfig.build(tiny_recipe, name="x", producers=2)
    assert (cfg.run_id, cfg.aggregate_store, cfg.aggregate_dir) == ("x", "torch://", None)
    cfg = ServiceConfig.build(tiny_recipe, name="x", producers=2, run_id="r7", aggregate_dir=str(tmp_path))
    assert (cfg.run_id, cfg.aggregate_store, cfg.aggregate_dir) == ("r7", None, str(tmp_path))
    cfg = ServiceConfig.build(tiny_recipe, name="x", aggregate_store="torch://h:1")
    assert cfg.aggregate_store == "torch://h:1" and cfg.run_id == "x"
    recipe = replace(tiny_recipe, aggregate=replace(tiny_recipe.aggregate, dir=str(tmp_path)))
    cfg = ServiceConfig.build(recipe, name="x", producers=4)
    assert (cfg.aggregate_store, cfg.aggregate_dir) == (None, str(tmp_path))
    cfg.check_lanes(tiny_recipe, 8)  # a rescale to 8 producers is allowed as built


@pytest.mark.parametrize(
    "key", ["aggregate_timeout_s", "consumer_ttl_s", "request_timeout_s", "progress_timeout_s", "reconnect_timeout_s"]
)
@pytest.mark.parametrize("value", ["abc", "60", None, float("nan"), float("inf"), True, -1])
def test_non_numeric_timeouts_are_one_line(key, value):
    with pytest.raises(ValueError) as info:
        ServiceConfig(**{key: value})
    message = str(info.value)
    assert message.startswith(f"ServiceConfig: {key} must be a number of seconds > 0, got ") and "\n" not in message


def test_resources_as_a_dict_are_converted_or_refused_in_one_line():
    cfg = ServiceConfig(resources={"producer_num_cpus": 0.5, "producer_resources": {"node_b": 0.1}})
    assert isinstance(cfg.resources, ActorResources) and cfg.resources.producer_num_cpus == 0.5
    assert cfg.resources.producer_resources == {"node_b": 0.1} and cfg.resources.replayer_num_cpus == 0.5
    for bad, words in (
        ({"producer_cpus": 1}, r"resources has unknown key\(s\) \['producer_cpus'\]"),
        ("0.5", "resources must be an ActorResources or a dict of its fields, got str"),
        ({"producer_num_cpus": "half"}, "resources.producer_num_cpus must be a number"),
        (
            {"coordinator_max_concurrency": 2.5},
            r"coordinator_max_concurrency must be an int in \[4, 100000\] \(waiting reads occupy it\), got 2.5",
        ),
    ):
        with pytest.raises(ValueError, match=words) as info:
            ServiceConfig(resources=bad)
        assert "\n" not in str(info.value)


def test_config_does_no_io(tiny_recipe, tmp_path):
    """Building a config for a materialised dir that does not exist reads nothing: start() checks it (launch.py)."""
    missing = tmp_path / "not-materialised"
    cfg = ServiceConfig.build(tiny_recipe, materialized_dir=str(missing), state_dir=str(tmp_path / "state"))
    assert cfg.materialized_dir == str(missing) and not missing.exists() and not (tmp_path / "state").exists()
    from zephon_ray.service.server.launch import prepare

    with pytest.raises(ValueError, match="materialized_dir"):
        prepare(tiny_recipe, cfg)
    assert not (tmp_path / "state").exists()


def test_lease_steps_and_read_path_validated():
    assert ServiceConfig(lease_steps=1, read_path="direct").read_path == "direct"
    with pytest.raises(ValueError, match=r"lease_steps must be an int in \[1, 1024\], got 0"):
        ServiceConfig(lease_steps=0)
    with pytest.raises(ValueError, match=r"read_path must be one of \['node', 'direct'\]"):
        ServiceConfig(read_path="fast")


def test_state_dir_refuses_another_recipe_without_writing(tiny_recipe, tmp_path):
    state = ServiceState.open(tiny_recipe, tmp_path / "s")
    state.add_commit(5, "t")
    before = {p.name: p.stat().st_mtime_ns for p in Path(state.root).iterdir()}
    other = replace(tiny_recipe, seed=tiny_recipe.seed + 1)
    other.__dict__.pop("fingerprint", None)
    assert other.fingerprint != tiny_recipe.fingerprint
    with pytest.raises(FingerprintMismatchError, match="belongs to recipe fingerprint"):
        ServiceState.open(other, state.root)
    with pytest.raises(FingerprintMismatchError, match=tiny_recipe.fingerprint[:12]):
        check_state_dir(other, state.root)
    assert {p.name: p.stat().st_mtime_ns for p in Path(state.root).iterdir()} == before
    assert json.loads((Path(state.root) / SERVICE_FILE).read_text())["fingerprint"] == tiny_recipe.fingerprint
    assert ServiceState.open(tiny_recipe, state.root).latest_commit() == 5


def test_checkpoint_files_validate_and_first_writer_wins(tiny_recipe, tmp_path):
    from zephon_ray.lanes import LaneStepper, StepStateError

    state = ServiceState.open(tiny_recipe, tmp_path)
    stepper = LaneStepper(tiny_recipe)
    try:
        for _ in range(3):
            stepper.next_step()
        ckpt = stepper.checkpoint()
    finally:
        stepper.close()
    assert state.write_checkpoint(ckpt) == 3
    assert state.checkpoint_steps() == [3] and state.nearest_checkpoint(10) == 3 and state.nearest_checkpoint(2) is None
    mtime = os.stat(state.checkpoint_path(3)).st_mtime_ns
    state.write_checkpoint(ckpt)
    assert os.stat(state.checkpoint_path(3)).st_mtime_ns == mtime
    bad = dict(ckpt, fingerprint="0" * 64)
    with pytest.raises(StepStateError):
        state.write_checkpoint(bad)
    assert state.read_checkpoint(3)["next_step"] == 3
