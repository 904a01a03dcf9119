"""`dataset_rt.testing`: the helpers users get for their own tests must themselves be right."""

from __future__ import annotations

import math
import stat

import pytest

from dataset_rt import CachedSample, CacheInput
from dataset_rt.testing import (
    ListSource,
    assert_cache_equal,
    corrupt_byte,
    make_source,
    truncate_file,
)


def test_make_source_accepts_inputs_payloads_and_pairs():
    source = make_source("mixed", [CacheInput(b"a", {"k": 1}), b"b", (bytearray(b"c"), {"k": 3})])
    assert isinstance(source, ListSource)
    assert source.name == "mixed"
    assert len(source) == 3
    assert [bytes(s.data) for s in source] == [b"a", b"b", b"c"]
    assert [dict(s.metadata) for s in source] == [{"k": 1}, {}, {"k": 3}]


def test_list_source_counts_passes():
    source = ListSource("n", [CacheInput(b"x", {})])
    assert source.iterations == 0
    assert len(list(source)) == 1
    assert len(list(source)) == 1
    assert source.iterations == 2


def test_corrupt_byte_inverts_one_byte_and_returns_the_old_value(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\x00\x01\x02\x03")
    assert corrupt_byte(path, 1) == 1
    assert corrupt_byte(path, -1) == 3
    assert path.read_bytes() == b"\x00\xfe\x02\xfc"
    with pytest.raises(IndexError):
        corrupt_byte(path, 4)
    with pytest.raises(IndexError):
        corrupt_byte(path, -5)


def test_damage_helpers_work_on_read_only_files_and_keep_their_mode(tmp_path):
    """Published cache files are 0444: the helpers still damage them, and leave them 0444."""
    path = tmp_path / "f"
    path.write_bytes(b"\x00\x01\x02\x03")
    path.chmod(0o444)
    assert corrupt_byte(path, 0) == 0
    truncate_file(path)
    assert path.read_bytes() == b"\xff\x01\x02"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


def test_truncate_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abcdef")
    truncate_file(path)
    assert path.read_bytes() == b"abcde"
    truncate_file(path, 3)
    assert path.read_bytes() == b"ab"
    with pytest.raises(ValueError):
        truncate_file(path, 3)


def sample(data, **metadata):
    return CachedSample(data, metadata)


def test_assert_cache_equal_accepts_equal_samples_of_any_bytes_type():
    left = [sample(memoryview(b"ab"), x=math.nan, s="é"), sample(b"", b=True)]
    right = [CacheInput(bytearray(b"ab"), {"x": math.nan, "s": "é"}), CacheInput(b"", {"b": True})]
    assert_cache_equal(left, right)
    assert_cache_equal(reversed(left), right, check_order=False)


@pytest.mark.parametrize(
    ("actual", "message"),
    [
        ([sample(b"ab", k=1)], "1 samples, expected 2"),
        ([sample(b"ab", k=1), sample(b"zz", k=2)], "sample 1: payload differs"),
        ([sample(b"ab", k=1), sample(b"cd", k=3)], "sample 1: metadata"),
        ([sample(b"ab", k=1), sample(b"cd", k=2.0)], "sample 1: metadata"),  # 2.0 is not 2
        ([sample(b"ab", k=True), sample(b"cd", k=2)], "sample 0: metadata"),  # True is not 1
        ([sample(b"ab", k=1), sample(b"cd", k=2, extra=0)], "sample 1: metadata"),
        ([sample("ab", k=1), sample(b"cd", k=2)], "payload is str"),
    ],
)
def test_assert_cache_equal_names_the_first_difference(actual, message):
    expected = [CacheInput(b"ab", {"k": 1}), CacheInput(b"cd", {"k": 2})]
    with pytest.raises(AssertionError, match=message):
        assert_cache_equal(actual, expected)


def test_assert_cache_equal_unordered_still_checks_content():
    expected = [CacheInput(b"a", {"k": 1}), CacheInput(b"b", {"k": 2})]
    with pytest.raises(AssertionError, match="no match"):
        assert_cache_equal([sample(b"a", k=1), sample(b"a", k=1)], expected, check_order=False)
