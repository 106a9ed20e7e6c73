"""Numbers as people read them: seconds, bytes, counts, FLOP/s and index ranges."""

from __future__ import annotations

__all__ = ["format_seconds", "format_count", "format_rate", "format_bytes", "compress_ranges"]


def format_seconds(x: float) -> str:
    """``0.0123`` -> ``12.3 ms``; ``2.5`` -> ``2.50 s``; ``0`` -> ``0``."""
    if x == 0:
        return "0"
    if x < 1e-3:
        return f"{x * 1e6:.1f} us"
    if x < 1.0:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def format_count(x: float) -> str:
    """``1.75e11`` -> ``175 B``; ``1.37e5`` -> ``137 K`` (decimal: parameters, FLOP/s)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f}"


def format_rate(flops: float) -> str:
    """FLOP/s in the largest unit that keeps the figure above 1: ``3.1e14`` -> ``310 TFLOP/s``."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops / 1e6:.3g} MFLOP/s"


def format_bytes(x: float) -> str:
    """Binary units: ``GiB`` above 1 GiB, else ``MiB`` / ``KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def compress_ranges(indices) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``."""
    idx = sorted(set(indices))
    out, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ", ".join(out)
