"""The one integer and reader validator (zephon_ray/checks.py): what passes, what is refused, and in what words."""

import numpy as np
import pytest

from zephon_ray.checks import MAX_INT, check_int, check_reader
from zephon_ray.errors import UserInputError
from zephon_ray.formats.ledger import LedgerError


@pytest.mark.parametrize("value", [True, False, 2.0, 2.5, "3", None, [1], np.int64(3), np.bool_(True)])
def test_check_int_refuses_everything_but_a_plain_int(value):
    with pytest.raises(ValueError) as info:
        check_int("--steps", value, low=0)
    assert str(info.value) == f"--steps must be an int in [0, 10**12], got {value!r}"


@pytest.mark.parametrize("value, ok", [(3, True), (7, True), (2, False), (8, False), (-1, False)])
def test_check_int_bounds_are_inclusive(value, ok):
    if ok:
        assert check_int("n", value, low=3, high=7) == value
    else:
        with pytest.raises(ValueError, match=rf"^n must be an int in \[3, 7\], got {value}$"):
            check_int("n", value, low=3, high=7)


def test_check_int_is_bounded_by_default():
    assert check_int("step", MAX_INT, low=0) == MAX_INT
    with pytest.raises(ValueError, match=r"step must be an int in \[0, 10\*\*12\], got 1000000000001"):
        check_int("step", MAX_INT + 1, low=0)


def test_check_int_keeps_the_callers_error_type_and_says_why():
    with pytest.raises(LedgerError) as info:
        check_int("bad.json: ledger key 'world'", 0, low=1, error=LedgerError)
    assert str(info.value) == "bad.json: ledger key 'world' must be an int in [1, 10**12], got 0"
    with pytest.raises(UserInputError, match=r"^actors must be an int in \[1, 1024\] \(one per CPU\), got 0$"):
        check_int("actors", 0, low=1, high=1024, error=UserInputError, why="one per CPU")


def test_check_int_numpy_ok_accepts_numpy_integers_as_plain_ints():
    got = check_int("step", np.int64(5), low=0, numpy_ok=True)
    assert got == 5 and type(got) is int
    for bad in (np.bool_(True), True, np.float64(5.0), np.int64(-1)):
        with pytest.raises(ValueError, match="step must be an int in"):
            check_int("step", bad, low=0, numpy_ok=True)


def test_check_reader_accepts_every_rank_of_a_world():
    assert [check_reader(r, 4) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert check_reader(0, 1) == (0, 1)
    assert check_reader(15, 16, max_world=16) == (15, 16)


@pytest.mark.parametrize(
    "rank, world, message",
    [
        (0, 0, r"^world must be an int in \[1, 10\*\*12\], got 0$"),
        (0, None, r"^world must be an int in \[1, 10\*\*12\], got None$"),
        (0, True, r"^world must be an int in \[1, 10\*\*12\], got True$"),
        (0, 2.0, r"^world must be an int in \[1, 10\*\*12\], got 2.0$"),
        (4, 4, r"^rank must be an int in \[0, world=4\), got 4$"),
        (-1, 4, r"^rank must be an int in \[0, world=4\), got -1$"),
        (None, 4, r"^rank must be an int in \[0, world=4\), got None$"),
        (False, 4, r"^rank must be an int in \[0, world=4\), got False$"),
        ("0", 4, r"^rank must be an int in \[0, world=4\), got '0'$"),
    ],
)
def test_check_reader_names_the_argument_and_its_value(rank, world, message):
    with pytest.raises(ValueError, match=message):
        check_reader(rank, world)


def test_check_reader_bounds_the_world_and_keeps_names_and_error_type():
    with pytest.raises(ValueError, match=r"^world must be an int in \[1, 16\] \(the batch's rows\), got 17$"):
        check_reader(0, 17, max_world=16, why_max="the batch's rows")
    with pytest.raises(LedgerError, match=r"^dp_rank must be an int in \[0, dp_world_size=2\), got 2$"):
        check_reader(2, 2, rank_name="dp_rank", world_name="dp_world_size", error=LedgerError)
    with pytest.raises(LedgerError, match=r"^dp_world_size must be an int in \[1, 10\*\*12\], got 0$"):
        check_reader(0, 0, rank_name="dp_rank", world_name="dp_world_size", error=LedgerError)
    with pytest.raises(ValueError, match=r"^FtSlices: dp_rank must be an int in \[0, dp=2\), got 2$"):
        check_reader(2, 2, rank_name="dp_rank", world_name="dp", where="FtSlices: ")
    with pytest.raises(ValueError, match=r"^FtSlices: dp must be an int in \[1, 10\*\*12\], got None$"):
        check_reader(0, None, rank_name="dp_rank", world_name="dp", where="FtSlices: ")


def test_service_reader_none_means_one_reader_of_the_whole_batch():
    from zephon_ray.service.wire import check_batch_reader

    assert check_batch_reader(None, None, 16) == (0, 1)
    assert check_batch_reader(3, 4, 16) == (3, 4)
    with pytest.raises(ValueError, match=r"world must be an int in \[1, 16\] \(the global batch's rows"):
        check_batch_reader(0, 17, 16)
    with pytest.raises(ValueError, match=r"world must be an int in \[1, 16\] .*, got None"):
        check_batch_reader(0, None, 16)
