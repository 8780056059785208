import pytest

from lightning_pipe.units import format_bytes, mib, parse_bytes


def test_parse_bytes_reads_numbers_and_units():
    assert parse_bytes(1024) == 1024
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes("1.5KiB") == 1536
    for bad in ("lots", "2 parsecs", "-1GB", 0):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)


def test_format_bytes_picks_the_unit_and_mib_keeps_two_decimals():
    assert format_bytes(512) == "512B"
    assert format_bytes(1536) == "1.5KiB"
    assert format_bytes(3 * 2**30) == "3.0GiB"
    assert format_bytes(5 * 2**40) == "5120.0GiB"
    assert mib(3 * 2**19) == "1.50 MiB"
