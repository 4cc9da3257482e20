"""Plain-text tables of measured times and rates (``fxpar calibrate``'s output)."""

from __future__ import annotations

from collections.abc import Sequence


def seconds_text(value: float) -> str:
    """``value`` seconds in milliseconds, or microseconds below one."""
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def rate_text(value: float, unit: str) -> str:
    """``value`` with an SI prefix (k, M, G, T) before ``unit``, three significant digits."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def columns(rows: Sequence[tuple[str, ...]]) -> str:
    """``rows`` as aligned columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)
