"""``lines.estimate_bits`` in one kernel call is the estimate of the class choice it
stands for: ``contexts.choose``, its classes' counts and their ``rows_bits``."""

from __future__ import annotations

import numpy as np
import pytest

from entropykit.coding import contexts, lines


def _by_steps(joint: np.ndarray, max_tables: int) -> float:
    cmap = contexts.choose(joint, max_tables)
    if cmap is None:
        return contexts.rows_bits(joint.sum(axis=0)[None, :], 0.0)
    return contexts.rows_bits(contexts.class_counts(joint, cmap), 8.0 * 257)


@pytest.mark.parametrize("spread", [0.0, 1.0, 6.0])  # one table; some classes; many
@pytest.mark.parametrize("max_tables", [1, 4, 16])
def test_estimate_in_one_call_is_the_stepwise_estimate(spread, max_tables):
    rng = np.random.default_rng(int(spread * 10) + max_tables)
    ctx = rng.integers(0, 12, 200_000)
    sym = (rng.normal(0, 1 + spread * ctx).astype(np.int64) & 0xFF).astype(np.uint8)
    joint = contexts.joint_histogram(ctx.astype(np.uint8), sym)
    assert lines.estimate_bits(joint, max_tables) == _by_steps(joint, max_tables)


def test_estimate_refuses_a_table_count_as_choose_does():
    with pytest.raises(ValueError, match="max_tables"):
        lines.estimate_bits(np.zeros((256, 256), np.int64), 0)
