"""The matrix products of one layer priced by their shapes, per device at a tensor-parallel degree.

The layer table lists each row's products by shape (``passes.layer_table``: ``fwd_gemms`` /
``bwd_gemms``, entries ``Gemm(m, n, k, batch, count, tp_dim)``: ``count`` products of ``batch``
``m x k`` by ``k x n`` matrices, ``tp_dim`` the dim tensor parallelism divides or None). At degree
``tp`` a device runs each product with ``tp_dim`` divided by ``tp`` (column parallel: the out
features; row parallel: the in features; attention: b x heads), the others whole, so its FLOPs
are those of ``fwd_flops - fwd_flops_tp + fwd_flops_tp / tp`` that the products carry.

``layer_gemm_time`` prices those products:

- on a profile that prices GEMMs by shape (a measured ``gemm_efficiency`` table for the dtype,
  or an ``sm_count``: the GPU profiles) each product at its shape's efficiency,
  ``cost_models.compute.gemms_time`` (tile and SM-fill quantization, the memory roofline of
  small products, the kernel floor);
- on any other profile (the CPU ones) their FLOPs at ``peak * compute_efficiency``, exactly what
  ``compute_time(flops, 0, ...)`` charges for them today (no bytes term: the summed model never
  charged a matmul's operand traffic, and CPU predictions must not move).

Not every matmul-class FLOP has a shape (convolutions, ``_scaled_mm``, nested attention;
``passes.autograd_costs``), and a table read from an older JSON has none at all, so a layer's
matmul time is its products' time plus the rest of its FLOPs at the flat rate:
``layer_matmul_time``. ``cost_models.layer_work`` prices each pass's matmul-class work with it
(the per-device FLOPs at ``tp`` and the row's ``fwd_gemms`` / ``bwd_gemms``); on a CPU profile it
returns ``compute_time(flops, 0.0, hw, dtype)`` itself, bit for bit, so CPU predictions and the
golden corpus do not change.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence

from cost_models.compute import _shape_priced, compute_time, numeric_gemms_time
from cost_models.hardware import HardwareProfile

__all__ = ["gemm_flops", "layer_gemm_time", "layer_matmul_time", "per_device_gemms", "prices_by_shape"]

_DIMS = ("m", "n", "k", "batch")


def prices_by_shape(hw: HardwareProfile, dtype: str) -> bool:
    """True when ``hw`` prices a GEMM by its shape for ``dtype`` (a measured table for it, or an
    ``sm_count``); False for the CPU profiles, which price FLOPs at one rate."""
    return _shape_priced(hw, dtype)


def _number(x: Any, micro_batch: Any, seq_len: Any) -> float:
    """A size as a float; a sympy size is evaluated at micro-batch ``b``, sequence length ``s``."""
    if type(x) is float or type(x) is int:  # the numeric rows the search prices: the hot path
        return float(x)
    sympy = sys.modules.get("sympy")  # none of its expressions exists before it is imported
    if sympy is not None and isinstance(x, sympy.Basic):
        if x.free_symbols:
            env = {"b": micro_batch, "s": seq_len}
            missing = sorted(str(symbol) for symbol in x.free_symbols if env.get(str(symbol)) is None)
            if missing:
                raise ValueError(
                    f"GEMM size {x} depends on {', '.join(missing)}: pass b and s "
                    "(or the numeric rows of LayerTable.numeric)"
                )
            x = x.subs({symbol: env[str(symbol)] for symbol in x.free_symbols})
        return float(x)
    return float(x)


def per_device_gemms(
    gemms: Iterable[Sequence[Any]], tp: int = 1, micro_batch: Any = None, seq_len: Any = None
) -> list[tuple[float, float, float, float, int]]:
    """``(m, n, k, batch, count)`` per device at degree ``tp``: numeric sizes, each entry's
    ``tp_dim`` divided by ``tp``. Entries are ``Gemm`` rows or tuples ``(m, n, k, batch, count[,
    tp_dim])``; sympy sizes (in ``b`` and ``s``) need ``micro_batch`` and ``seq_len``."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1 (got {tp!r})")
    out = []
    for gemm in gemms:
        gemm = tuple(gemm)
        if len(gemm) not in (5, 6):
            raise ValueError(f"a GEMM entry is (m, n, k, batch, count[, tp_dim]), got {gemm!r}")
        dims = [_number(x, micro_batch, seq_len) for x in gemm[:4]]
        tp_dim = gemm[5] if len(gemm) == 6 else None
        if tp_dim is not None:
            if tp_dim not in _DIMS:
                raise ValueError(f"unknown GEMM tp_dim {tp_dim!r} (expected one of {', '.join(_DIMS)} or None)")
            dims[_DIMS.index(tp_dim)] /= tp
        out.append((dims[0], dims[1], dims[2], dims[3], int(gemm[4])))
    return out


def gemm_flops(gemms: Iterable[Sequence[Any]], tp: int = 1, micro_batch: Any = None, seq_len: Any = None) -> float:
    """FLOPs of the products on one device at degree ``tp``: ``2 m n k batch count`` summed."""
    return sum(
        2.0 * m * n * k * batch * count for m, n, k, batch, count in per_device_gemms(gemms, tp, micro_batch, seq_len)
    )


def layer_gemm_time(
    gemms: Iterable[Sequence[Any]],
    hw: HardwareProfile,
    dtype: str,
    tp: int = 1,
    micro_batch: Any = None,
    seq_len: Any = None,
) -> float:
    """Seconds one device spends in a layer pass's products (``fwd_gemms`` or ``bwd_gemms`` of a
    layer-table row) at tensor-parallel degree ``tp``: each at its shape's efficiency on a
    profile that prices by shape, else their FLOPs at ``peak * compute_efficiency`` (module doc).
    Sizes may be numbers (the rows of ``LayerTable.numeric``) or sympy in ``b`` and ``s`` (``micro_batch``, ``seq_len``
    given numerically then)."""
    return _shapes_time(per_device_gemms(gemms, tp, micro_batch, seq_len), hw, dtype)


def _shapes_time(shapes: list[tuple[float, float, float, float, int]], hw: HardwareProfile, dtype: str) -> float:
    """``layer_gemm_time`` of per-device shapes (``per_device_gemms``, all numbers)."""
    if not prices_by_shape(hw, dtype):
        flops = sum(2.0 * m * n * k * batch * count for m, n, k, batch, count in shapes)
        return float(compute_time(flops, 0.0, hw, dtype))
    return float(numeric_gemms_time(shapes, hw, dtype))


def layer_matmul_time(
    flops: float,
    gemms: Iterable[Sequence[Any]],
    hw: HardwareProfile,
    dtype: str,
    tp: int = 1,
    micro_batch: Any = None,
    seq_len: Any = None,
) -> float:
    """Seconds of a layer pass's matmul-class work on one device: ``flops`` (its FLOPs at degree
    ``tp``, ``x - x_tp + x_tp / tp``) of which the listed products are priced by shape
    (``layer_gemm_time``) and the rest, ``flops - gemm_flops(gemms, tp)``, at the flat rate. On a
    profile that does not price by shape this is ``compute_time(flops, 0.0, hw, dtype)`` exactly."""
    if not prices_by_shape(hw, dtype):
        return float(compute_time(flops, 0.0, hw, dtype))
    key = None
    if micro_batch is None and seq_len is None:  # numbers: candidates sharing a row's shapes and tp share the price
        key = (id(hw), dtype, tp, float(flops), tuple(tuple(gemm) for gemm in gemms))
        hit = _PRICED.get(key)
        if hit is not None and hit[0] is hw:
            return hit[1]
    shapes = per_device_gemms(gemms, tp, micro_batch, seq_len)  # once: the search calls this for every candidate
    listed = sum(2.0 * m * n * k * batch * count for m, n, k, batch, count in shapes)
    rest = max(float(flops) - listed, 0.0)
    seconds = _shapes_time(shapes, hw, dtype) + float(compute_time(rest, 0.0, hw, dtype))
    if key is not None:
        if len(_PRICED) > _PRICED_MAX:
            _PRICED.clear()
        _PRICED[key] = (hw, seconds)  # holding the profile: its id cannot be reused while cached
    return seconds


#: ``layer_matmul_time`` of numeric rows, by profile (identity), dtype, tp, FLOPs and products:
#: the search prices the same row at the same tp for many candidates (dp, ZeRO, pp, compile...).
_PRICED: dict[tuple, tuple[HardwareProfile, float]] = {}
_PRICED_MAX = 200_000
