import pytest

from trace_jax.buckets import bucket, power_of_two, round_up


def test_bucket_is_the_smallest_that_fits_and_refuses_past_the_largest():
    assert bucket(1, (8, 16, 32)) == 8
    assert bucket(8, (8, 16, 32)) == 8
    assert bucket(9, (8, 16, 32)) == 16
    with pytest.raises(ValueError, match="rows 33 is larger than the largest bucket 32"):
        bucket(33, (8, 16, 32), "rows")


def test_power_of_two_respects_minimum_and_cap():
    assert [power_of_two(n) for n in (0, 1, 2, 3, 5, 16, 17)] == [1, 1, 2, 4, 8, 16, 32]
    assert power_of_two(3, minimum=64) == 64
    assert power_of_two(90, minimum=16, maximum=100) == 100
    with pytest.raises(ValueError, match="prefill 101 is larger than the maximum 100"):
        power_of_two(101, maximum=100, what="prefill")


def test_round_up():
    assert [round_up(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    with pytest.raises(ValueError):
        round_up(3, 0)
