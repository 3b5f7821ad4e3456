"""The model's configuration (model.py), beyond the specification."""

import pytest

from model import ModelConfig


@pytest.mark.parametrize("theta", [0.0, -1.0, float("nan"), float("inf")])
def test_a_rope_theta_that_is_not_positive_and_finite_is_refused(theta):
    """Every rotary angle is position / theta ** (2i / head_dim): a NaN or infinite base (or 0)
    makes angles NaN or constant, and the loss NaN only after data preparation and a training
    step."""
    with pytest.raises(ValueError, match=f"rope_theta={theta}: the base of the rotary angles "
                                         "must be positive"):
        ModelConfig(rope_theta=theta)
