"""RowLayout: per-row step inputs packed into one int32 array and unpacked inside a jit."""

import jax
import numpy as np
import pytest

from kk_jax.engine.row_inputs import RowLayout

LAYOUT = RowLayout((("tokens", (3,), np.int32), ("valid", (3,), np.bool_), ("seed", (), np.uint32),
                    ("temperature", (), np.float32), ("table", (2, 2), np.int32)))


def test_pack_unpack_round_trip_keeps_every_bit():
    rng = np.random.default_rng(0)
    values = dict(tokens=rng.integers(-2**31, 2**31 - 1, (4, 3), dtype=np.int32),
                  valid=rng.random((4, 3)) < 0.5,
                  seed=np.array([0, 1, 2**32 - 1, 2**31], np.uint32),
                  temperature=np.array([0.0, -0.0, np.inf, 1e-45], np.float32),
                  table=rng.integers(0, 100, (4, 2, 2), dtype=np.int32))
    packed = LAYOUT.pack(4, values)
    assert packed.shape == (4, LAYOUT.width) == (4, 12) and packed.dtype == np.int32
    out = jax.jit(LAYOUT.unpack)(packed)
    for name, want in values.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name


def test_pack_names_the_field_of_a_wrong_shape_or_dtype():
    values = dict(tokens=np.zeros((2, 3), np.int32), valid=np.zeros((2, 3), bool), seed=np.zeros(2, np.uint32),
                  temperature=np.zeros(2, np.float32), table=np.zeros((2, 2, 2), np.int32))
    LAYOUT.pack(2, values)
    with pytest.raises(ValueError, match="temperature"):
        LAYOUT.pack(2, {**values, "temperature": np.zeros(2, np.float64)})
    with pytest.raises(ValueError, match="table"):
        LAYOUT.pack(2, {**values, "table": np.zeros((2, 4), np.int32)})
    with pytest.raises(TypeError, match="bad"):
        RowLayout((("bad", (), np.int64),))
