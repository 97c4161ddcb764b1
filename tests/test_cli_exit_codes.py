"""The CLI's one error mapping (zephon_ray/cli/exit_codes.py): each exception type -> exactly one line and an exit code.

No Ray is started: the commands here are stand-ins that raise.
"""

from __future__ import annotations

import pytest

from zephon_ray.cli.exit_codes import INTERRUPTED_EXIT, USER_ERROR_EXIT, error_line, run_command
from zephon_ray.errors import UserInputError
from zephon_ray.service.errors import ReplyTimeoutError, ServiceError, ServiceNotFoundError


def _raising(exc: BaseException):
    def command(args):
        raise exc

    return command


def _run(capsys, exc: BaseException) -> tuple[int, str, str]:
    try:
        code = run_command(_raising(exc), None)
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "exc, line",
    [
        (UserInputError("--steps '5:2': expected 0 <= A < B"), "--steps '5:2': expected 0 <= A < B"),
        (ValueError("recipe.toml: key 'lanes' must be >= 1,\n  got 0"), "recipe.toml: key 'lanes' must be >= 1, got 0"),
        (
            FileNotFoundError(2, "No such file or directory", "/nope/r.toml"),
            "[Errno 2] No such file or directory: '/nope/r.toml'",
        ),
        (TimeoutError("step 7 was not produced within 30s"), "step 7 was not produced within 30s"),
        (ServiceNotFoundError("no service 'run7' in namespace 'zr'"), "no service 'run7' in namespace 'zr'"),
        (ReplyTimeoutError("service 'run7': no reply in time"), "service 'run7': no reply in time"),
        (ConnectionError("Could not find any running Ray instance."), "Could not find any running Ray instance."),
    ],
)
# Proves cli/exit_codes.py: a user error is one line on stderr and exit 2.
def test_user_errors_are_one_line_and_exit_2(capsys, exc, line):
    code, out, err = _run(capsys, exc)
    assert (code, out, err) == (USER_ERROR_EXIT, "", f"zephon-ray: error: {line}\n")


@pytest.mark.parametrize(
    "exc",
    [
        KeyError("a bug"),
        RuntimeError("a bug"),
        AttributeError("a bug"),
        PermissionError(13, "Permission denied", "/x"),
        OSError("disk on fire"),
    ],
)
# Proves cli/exit_codes.py: anything but a user or worker error keeps its traceback (exit 1).
def test_other_errors_keep_their_traceback(capsys, exc):
    with pytest.raises(type(exc)):
        run_command(_raising(exc), None)
    assert capsys.readouterr().err == ""  # nothing printed by the mapping: Python prints the traceback
    assert error_line(exc) is None


def test_ctrl_c_is_130_and_silent(capsys):
    assert _run(capsys, KeyboardInterrupt()) == (INTERRUPTED_EXIT, "", "")


def test_exit_codes_of_commands_pass_through():
    assert run_command(lambda args: 0, None) == 0
    assert run_command(lambda args: 1, None) == 1  # audit: findings


class _FakeRayTaskError(RuntimeError):
    """ray.exceptions.RayTaskError's shape: a traceback-laden text and the cause."""

    __module__ = "ray.exceptions"

    def __init__(self, cause: BaseException) -> None:
        super().__init__(
            "ray::Worker.__call__() (pid=1, ip=10.0.0.9)\nTraceback (most recent call last):\n"
            '  File "x.py", line 1, in f\n    g()\n' + f"{type(cause).__name__}: {cause}"
        )
        self.cause = cause


# Proves cli/exit_codes.py: a worker-side error prints as its cause's last line, never the workers' traceback.
def test_a_worker_error_is_its_cause_in_one_line(capsys):
    code, out, err = _run(capsys, _FakeRayTaskError(KeyError("shard 3")))
    assert (code, out) == (USER_ERROR_EXIT, "") and err.count("\n") == 1, err
    assert err.startswith("zephon-ray: error: ") and "shard 3" in err and "Traceback" not in err


def test_the_service_message_wins_over_the_ray_error_it_wraps(capsys):
    """A ServiceError's message is the report, even when a Ray error is its cause; so is an error raised
    ``from None`` over a Ray error (the service client re-raises an actor's ValueError that way)."""
    try:
        try:
            raise _FakeRayTaskError(RuntimeError("actor died"))
        except _FakeRayTaskError as ray_error:
            raise ServiceError("service 'run7': the coordinator died") from ray_error
    except ServiceError as exc:
        assert _run(capsys, exc) == (USER_ERROR_EXIT, "", "zephon-ray: error: service 'run7': the coordinator died\n")
    refusal = ValueError("add_phase: consumer 'trainer' has read step 4")
    try:
        try:
            raise _FakeRayTaskError(refusal)
        except _FakeRayTaskError:
            raise refusal from None
    except ValueError as exc:
        assert _run(capsys, exc) == (
            USER_ERROR_EXIT,
            "",
            "zephon-ray: error: add_phase: consumer 'trainer' has read step 4\n",
        )


def test_a_service_failing_on_its_storage_is_one_line_with_the_hint_never_cut_mid_word(monkeypatch):
    """A service whose actors could not use its bucket: the one line names the object, carries the documented hint
    (credentials stay in this shell), and a long store message is cut at a word boundary, never mid-word."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    dump = " ".join(f"word{i:03d}" for i in range(150))  # a long client dump (obstore's run to ~700 characters)
    exc = ServiceError(
        f"service 'run7' failed to start: s3://zr-b/run7/service.json: access denied (read it); "
        f"check the credentials: Generic S3 error: {dump}"
    )
    line = error_line(exc)
    assert "\n" not in line and "s3://zr-b/run7/service.json" in line and "never shipped" in line, line
    assert "AWS_ACCESS_KEY_ID" in line.split("never shipped")[1] and "AKIAEXAMPLE" not in line, line
    assert len(line) < 1000, len(line)
    cut = line.split(" (the workers have")[0]
    assert cut.endswith(" …") and cut[:-2].split()[-1].startswith("word") and len(cut[:-2].split()[-1]) == 7, cut
