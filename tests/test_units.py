"""Byte quantities as users write them."""

from __future__ import annotations

import pytest

from llmmem.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GB", 4 * 10**9),
        ("4 GB", 4 * 10**9),
        ("4gb", 4 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("80GB", 80 * 10**9),
        ("1000000", 10**6),
        ("0", 0),
        ("2TiB", 2 * 2**40),
        ("10kB", 10_000),
        ("3KiB", 3072),
        ("7B", 7),
        (12345, 12345),
        (2.0**30, 2**30),
        ("1e3", 1000),
        ("0.1kB", 100),
        ("1e9GB", 10**18),
        ("0.3GiB", 322122547),
    ],
)
def test_parse_bytes_accepts(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "GB",
        "4 XB",
        "four GB",
        "-1GB",
        -5,
        1.5,
        float("nan"),
        None,
        True,
        [4],
        "1e400",
        "1e400GB",
        "2.5",
        "2.5B",
        "1e30TB",
    ],
)
def test_parse_bytes_rejects_with_the_argument_name(bad):
    with pytest.raises(ValueError, match="device_memory"):
        parse_bytes(bad, "device_memory")


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(80 * 2**30) == "80.00 GiB"
    assert format_bytes(-2048) == "-2.00 KiB"


def test_parse_bytes_refuses_integers_beyond_64_bits():
    assert parse_bytes(2**63) == 2**63
    with pytest.raises(ValueError, match="larger than any memory"):
        parse_bytes(2**64 + 1, "max_size")


@pytest.mark.parametrize(
    "text, words",
    [
        ("1e1000000", "larger than any memory"),  # decimal.Overflow escaped parse_bytes
        ("1e1000000GB", "larger than any memory"),
        ("9" * 400 + "e999999", "larger than any memory"),
        ("1e-999999999999999999999", "exponent"),  # decimal.InvalidOperation
        ("-1GB", ">= 0 bytes"),
        (" -0.5 MiB", ">= 0 bytes"),
    ],
)
def test_parse_bytes_extreme_strings_are_value_errors(text, words):
    with pytest.raises(ValueError, match="budget") as info:
        parse_bytes(text, "budget")
    assert words in str(info.value)


def test_format_bytes_large_figures_stay_short():
    assert format_bytes(2**50) == "1.00 PiB"
    assert format_bytes(2**63) == "8.00 EiB"


def test_memory_pool_and_budget_strings_go_through_the_same_check():
    import llmmem

    with pytest.raises(ValueError, match="larger than any memory"):
        llmmem.MemoryPool("1e1000000")
    with pytest.raises(ValueError, match="larger than any memory"):
        llmmem.estimate("llama-7b", device_memory="1e1000000")
