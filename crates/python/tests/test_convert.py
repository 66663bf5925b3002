"""The index/address conversions every pagewire call uses (lists, tuples, arrays)."""

import array

import numpy as np
import pytest

from pagewire import _native


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2, 3],
        (1, 2, 3),
        range(1, 4),
        array.array("q", [1, 2, 3]),
        array.array("H", [1, 2, 3]),
        np.array([1, 2, 3], dtype=np.int32),
        np.array([1, 2, 3], dtype=np.uint64),
        np.array([1, 0, 2, 0, 3, 0])[::2],  # strided view
    ],
)
def test_accepts_integer_sequences(obj):
    out = _native._u64_roundtrip(obj)
    assert isinstance(out, np.ndarray) and out.dtype == np.uint64
    assert out.tolist() == [1, 2, 3]


def test_output_is_a_read_only_view():
    out = _native._u64_roundtrip([5, 6])
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0] = 1


def test_full_u64_range():
    big = 2**64 - 1
    assert _native._u64_roundtrip([big]).tolist() == [big]
    assert _native._u64_roundtrip(np.array([big], dtype=np.uint64)).tolist() == [big]


@pytest.mark.parametrize(
    "obj",
    [[-1], np.array([0, -5]), array.array("b", [3, -1]), [2**64], ["1"], [1.5]],
)
def test_rejects_negative_and_non_integers(obj):
    with pytest.raises((ValueError, TypeError)):
        _native._u64_roundtrip(obj)


def test_rejects_two_dimensions_and_floats():
    with pytest.raises(ValueError):
        _native._u64_roundtrip(np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises((ValueError, TypeError)):
        _native._u64_roundtrip(np.array([1.5]))
    with pytest.raises(TypeError):
        _native._u64_roundtrip(3)


def test_empty():
    assert _native._u64_roundtrip([]).tolist() == []
    assert _native._u64_roundtrip(np.array([], dtype=np.int64)).tolist() == []
