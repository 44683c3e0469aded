"""The two references agree: dense float32 (jax, autodiff) and segment-loop float64 (NumPy,
hand-written backward) share no code, so agreement on every layout checks both."""
import numpy as np
import pytest

from harness.cases import Case, make_inputs
from harness.layouts import LAYOUTS
from harness.runner import reference_for


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_dense_and_segment_loop_oracles_agree(layout, heads, kv_heads):
    from harness.oracle import segment_loop_attention

    case = Case(layout, 3, 192, heads, kv_heads, 16, "float32", seed=3)
    x = make_inputs(case)
    truth = reference_for(case).truth
    loop = segment_loop_attention(x.query, x.key, x.value, x.segment_ids, x.cotangent,
                                  scale=case.scale)
    valid = (case.segment_ids > 0)[:, :, None, None]
    for name, dense, f64 in zip(("out", "dq", "dk", "dv"), truth, (loop[0], *loop[1])):
        dense = np.where(valid, np.asarray(dense), 0)
        f64 = np.where(valid, f64, 0)
        scale = np.abs(f64).max()
        assert np.abs(dense - f64).max() <= 2e-5 * scale, name


def test_oracle_attends_within_segment_only():
    """Changing one segment's keys and values leaves every other segment's truth bitwise equal."""
    import jax.numpy as jnp
    from harness.oracle import dense_attention

    case = Case("packed/random", 2, 128, 2, 2, 8, "float32", seed=0)
    x = make_inputs(case)
    seg = case.segments[1]
    k2, v2 = x.key.copy(), x.value.copy()
    k2[seg.row, seg.start:seg.stop] += 1.0
    v2[seg.row, seg.start:seg.stop] -= 1.0
    a = np.asarray(dense_attention(x.query, x.key, x.value, jnp.asarray(x.segment_ids), scale=case.scale))
    b = np.asarray(dense_attention(x.query, k2, v2, jnp.asarray(x.segment_ids), scale=case.scale))
    for s in case.segments:
        same = np.array_equal(a[s.row, s.start:s.stop], b[s.row, s.start:s.stop])
        assert same == (s != seg), s.label
