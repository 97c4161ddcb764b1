"""Known-harmless library noise is filtered by its exact message, and long commands' progress stays off stdout.

* Zephon's wrap-packing tail-drop line (``zephon_ray.log_filters``): filtered; Zephon's other warnings are not.
* torchft's Rust INFO lines in the torchft examples: ``RUST_LOG`` defaults to ``warn`` there; a user's setting wins.
* ``zephon_ray.progress``: notes and the step bar go to stderr; stdout is exactly the result lines.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zephon_ray.log_filters import (
    KNOWN_HARMLESS,
    PACK_SEQUENCES_LOGGER,
    PACK_TAIL_DROP_PREFIX,
    RAY_DATA_BARS_OFF_PREFIX,
    RAY_DATA_PROGRESS_LOGGER,
    KnownHarmlessFilter,
    quiet_known_noise,
)

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_pack_tail_drop_line_is_filtered(caplog):
    importlib.import_module("zephon_ray.pipeline")  # installs the filter, as every process that builds one does

    pack = logging.getLogger(PACK_SEQUENCES_LOGGER)
    with caplog.at_level(logging.WARNING):
        pack.warning(
            "PackSequences wrap: dropping %s trailing token(s) across %d packing group(s) in %d lane(s) "
            "that did not fill a full max_length=%d bin; emitted %d tombstone(s) to close contributor "
            "offsets.",
            37,
            2,
            2,
            65,
            2,
        )
        pack.warning(
            "PackSequences %s: dropped %d document(s) (%d token(s)) longer than max_length=%d; ...",
            "first_fit",
            1,
            900,
            65,
        )
        logging.getLogger("zephon._internal.ops.ensure_mixture").warning("EnsureMixture strict mode discarded 3")
    messages = [r.getMessage() for r in caplog.records]
    assert not any(m.startswith(PACK_TAIL_DROP_PREFIX) for m in messages), messages
    assert any("first_fit: dropped 1 document(s)" in m for m in messages), messages
    assert any("EnsureMixture strict mode discarded 3" in m for m in messages), messages


def test_ray_datas_bars_off_line_is_filtered_and_its_other_warnings_are_not(caplog):
    quiet_known_noise()
    ray_data = logging.getLogger(RAY_DATA_PROGRESS_LOGGER)
    with caplog.at_level(logging.WARNING):
        ray_data.warning(
            "Progress bars disabled. To enable, set `ray.data.DataContext.get_current().enable_progress_bars = True`."
        )
        ray_data.warning("Progress bars for operators disabled. To enable, set ...")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Progress bars for operators disabled. To enable, set ..."], messages


def test_the_filters_match_the_installed_libraries_wording_and_install_once():
    """If Zephon or Ray Data rewords a line, this fails (the line would show again, never something else hidden)."""
    from ray.data._internal import progress
    from zephon._internal.ops import pack_sequences

    assert f'"{PACK_TAIL_DROP_PREFIX}%s trailing token(s)' in inspect.getsource(pack_sequences)
    assert f'"{RAY_DATA_BARS_OFF_PREFIX}"' in inspect.getsource(progress)
    quiet_known_noise()
    quiet_known_noise()
    for name in KNOWN_HARMLESS:
        assert sum(isinstance(f, KnownHarmlessFilter) for f in logging.getLogger(name).filters) == 1, name


def _lighthouse_stderr(rust_log: str | None) -> str:
    """stderr of a process that does what examples/torchft_churn.py's parent does: the default, then a Lighthouse."""
    pytest.importorskip("torchft")
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import torchft_churn; "
        "torchft_churn.quiet_torchft_info(); from torchft.coordination import LighthouseServer; "
        "s = LighthouseServer(bind='[::]:0', min_replicas=1); time.sleep(0.3); s.shutdown()"
    )
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    if rust_log is not None:
        env["RUST_LOG"] = rust_log
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "examples")], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_torchft_info_is_quiet_by_default_and_rust_log_wins():
    assert "[INFO]" not in _lighthouse_stderr(None)
    assert "[INFO] [torchft::lighthouse]" in _lighthouse_stderr("info")


# Proves progress.py: with the step bar on, stdout stays the command's output byte for byte.
def test_step_bar_keeps_stdout_unchanged(capsys):
    from zephon_ray.progress import note, step_bar

    note("starting the data service ...")
    with step_bar(2, "digest") as emit:
        emit("step 0 aa")
        emit("step 1 bb")
    out = capsys.readouterr()
    assert out.out == "step 0 aa\nstep 1 bb\n"
    assert out.err.splitlines()[0] == "zephon-ray: starting the data service ..."


def test_the_stderr_filter_drops_exactly_the_marked_lines_and_passes_the_rest_unchanged():
    """Bytes written straight to descriptor 2, as Ray's C++ core worker writes: marked lines go, everything else
    (a partial line, a carriage-return redraw, a line written just before the block ends) arrives unchanged."""
    code = (
        "import os, sys\n"
        "from zephon_ray.log_filters import RAY_ACTOR_ARGS_MARKER, _dropping_stderr_lines\n"
        "with _dropping_stderr_lines(RAY_ACTOR_ARGS_MARKER):\n"
        "    os.write(2, b'keep 1\\n[2026 E 1 1] core_worker.cc:1: Actor X ' + RAY_ACTOR_ARGS_MARKER + b'. See\\n')\n"
        "    os.write(2, b'\\rbar 1/2')\n"
        "    os.write(2, b'\\rbar 2/2\\n[E core_worker.cc] also ' + RAY_ACTOR_ARGS_MARKER)\n"
        "    os.write(2, b'\\n[E other.cc] kept\\n')\n"
        "    print('python line', file=sys.stderr)\n"
        "    os.write(2, b'tail without newline')\n"
        "print(' after', file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == (b"keep 1\n\rbar 1/2\rbar 2/2\n[E other.cc] kept\npython line\ntail without newline after\n")


@pytest.mark.heavy
def test_materialize_prints_its_result_and_no_library_noise_when_output_is_not_a_terminal(ray_cluster, tmp_path):
    """A real ``zephon-ray materialize`` into pipes: stdout is its one result line; stderr holds neither Ray's core
    worker actor-arguments line, nor Ray Data's INFO lines, nor a progress bar (stderr is not a terminal)."""
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zephon_ray.cli",
            "materialize",
            str(ROOT / "recipes" / "tiny.toml"),
            "--steps",
            "0:2",
            "--out",
            str(tmp_path / "out"),
            "--address",
            address,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": address},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == f"{tmp_path / 'out'}: wrote steps 0:2; holds steps 0:2\n"
    assert proc.stderr == "", proc.stderr
