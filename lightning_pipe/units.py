"""Units: memory sizes read from what users type and written for people to read."""

import re

__all__ = ["MemorySize", "format_bytes", "mib", "parse_bytes"]

MemorySize = int | str

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: MemorySize) -> int:
    """Bytes from a number or a string such as ``"2GiB"``, ``"512 MB"`` or ``"1e9"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(
                f"Cannot read {value!r} as a memory size; use bytes or a number with a unit "
                f"such as '512MiB', '2GiB' or '16GB'."
            )
        number = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if number <= 0:
        raise ValueError(f"A memory size must be positive, got {value!r}.")
    return number


def format_bytes(n: float) -> str:
    """The shortest binary unit that keeps the number below 1024: ``"1.5KiB"``."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def mib(n: float) -> str:
    """Bytes in MiB with two decimals, for tables whose rows should line up."""
    return f"{n / 2**20:.2f} MiB"
