"""Byte sizes: one grammar for the config's host_memory and the CLI's --keep-bytes, one printer."""

from __future__ import annotations

import argparse

import pytest

from rlax_tasks.utils.byte_sizes import exact_bytes, format_bytes, parse_bytes, parse_bytes_arg


@pytest.mark.parametrize(
    "value,size",
    [
        # what placement.host_memory read (compute/devices.py)
        (123, 123), (0, 0), ("64GiB", 64 * 2**30), ("500GB", 500 * 10**9),
        ("1.5 TiB", int(1.5 * 2**40)), ("2kb", 2000), ("7B", 7),
        # what ps serve --keep-bytes read (paramserver/cli.py)
        ("1024", 1024), ("500MB", 500 * 10**6), ("1.5kib", 1536), ("2 TB", 2 * 10**12),
        ("3PB", 3 * 10**15), ("1PiB", 2**50), (".5KiB", 512), ("2.GiB", 2 * 2**30),
        (" 8 mib ", 8 * 2**20), ("123456789012345678901", 123456789012345678901),
    ],
)  # fmt: skip
def test_parse_bytes_reads_both_former_grammars(value, size):
    assert parse_bytes(value) == size


@pytest.mark.parametrize("value", ["64G", "lots", "-5", "1e9", "", "64 gigs", 1.5, True, None])
def test_parse_bytes_names_the_bad_value(value):
    with pytest.raises(ValueError, match="must be a size in bytes") as info:
        parse_bytes(value)
    assert repr(value) in str(info.value)


def test_minimum_and_the_argparse_form():
    with pytest.raises(ValueError, match=r"at least 1 byte\(s\), got '0'"):
        parse_bytes("0", minimum=1)
    assert parse_bytes_arg("64GiB") == 64 * 2**30
    with pytest.raises(argparse.ArgumentTypeError, match="'0'"):
        parse_bytes_arg("0")
    with pytest.raises(argparse.ArgumentTypeError, match="'64G'"):
        parse_bytes_arg("64G")


def test_format_bytes_picks_the_largest_binary_unit():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(0.9 * 2**20) == "921.6 KiB"
    assert format_bytes(81_559 * 2**20) == "79.6 GiB"
    assert format_bytes(3 * 2**50) == "3.0 PiB"
    assert format_bytes(2**62) == "4096.0 PiB"
    assert exact_bytes(1023) == "1023 bytes"
    assert exact_bytes(64 * 2**30) == "68719476736 bytes (64.0 GiB)"
