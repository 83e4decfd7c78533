"""mlx_mtp.scoped_switch: on while any body is open, nested bodies included; off inside ``suspended``."""

import pytest

from mlx_mtp.scoped_switch import ScopedSwitch


def test_a_scope_stays_on_until_the_outermost_body_closes_and_suspends_inside():
    s = ScopedSwitch()
    assert not s
    with s.open():
        with s.open():
            assert s
            with s.suspended():
                assert not s
            assert s
        assert s
    assert not s


def test_a_body_that_raises_still_closes():
    s = ScopedSwitch()
    with pytest.raises(ValueError):
        with s.open():
            raise ValueError("x")
    assert not s and s.depth == 0
