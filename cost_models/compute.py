"""Compute time: a roofline with an efficiency term.

An operator that performs ``F`` floating-point operations and moves ``M`` bytes between device
memory and the compute units takes, on a device with peak ``P[dtype]`` FLOP/s, achievable
fraction ``e`` of that peak and memory bandwidth ``W`` bytes/s::

    t = max( F / (P[dtype] * e),  M / W )

The first term is the compute ceiling (matmuls, attention), the second the memory ceiling
(norms, elementwise ops, the optimizer step). Which one binds is decided by the operator's
arithmetic intensity ``F / M`` against the device's ridge point ``P * e / W``.

The functions accept plain numbers or sympy expressions (costs symbolic in micro-batch size and
sequence length): ``max`` then becomes ``sympy.Max`` so a symbolic cost can be substituted later.

GEMM efficiency by shape
------------------------
``compute_time`` prices FLOPs at one rate, ``peak * compute_efficiency``: right for the large
matmuls of a big model, too fast for small ones. ``gemm_efficiency(hw, dtype, m, n, k)`` is the
fraction of peak an ``m x k`` by ``k x n`` product reaches, and ``matmul_time`` is its FLOPs at
that fraction. Three cases, in order:

1. The profile has a measured table for the dtype (``hw.gemm_efficiency``, written by ``planner
   calibrate``): trilinear interpolation in ``(log m, log n, log k)`` between its buckets, each
   size clamped to the table's range (a batched product looks up ``batch * m``). A product
   smaller than the table's range on some axis is also kept under the memory roofline
   ``F W / (P B)``; inside the range the measurement stands (it may beat the copy bandwidth ``W``
   when the operands sit in L2).
2. No table, but the profile names its GPU's streaming multiprocessors (``hw.sm_count``; the
   built-in GPU profiles do): the *default curve*, a roofline with tile and SM-fill quantization
   (the structure of NVIDIA's "Matrix Multiplication Background User's Guide", sections "Tile
   Quantization" and "Wave Quantization")::

       T      = batch * ceil(m / 128) * ceil(n / 128)           output tiles of 128 x 128
       split  = max(1, min(SMs / T, k / 1024))                   split-K while tiles leave SMs idle
       fill   = min(1, T * split / SMs)                          fraction of SMs with work
       F_pad  = 2 * batch * 128 ceil(m / 128) * 128 ceil(n / 128) * k   FLOPs the tiles execute
       B      = batch * (m k + k n + m n) * bytes(dtype) + 2 * (split - 1) * batch * m n * 4
       t      = max(F_pad / (P e fill),  B / W,  3 us)
       efficiency = 2 batch m n k / (P t)

   ``P`` the dtype's peak, ``e`` the profile's ``compute_efficiency``, ``W`` its memory
   bandwidth. A large GEMM (tile-aligned sizes, at least one full wave of tiles) gets exactly
   ``e``, as before; a small one leaves SMs idle (``fill``), pays for padded tiles, hits the
   memory roofline, or the 3 us floor. The constants: 128 x 128 is one of the output tiles the
   guide lists for cuBLAS (its largest, 256 x 128, reuses data best; smaller ones fill the SMs of
   small problems); split-K (partial sums in fp32, written and read back) is what cuBLAS does when
   few tiles meet a long ``k``, here only while every split keeps at least 1024 of ``k``, and as a
   real number (split-K factors and stream-K's fractional work units between them: an integer
   split would make a longer ``k`` faster at the steps of ``floor(k / 1024)``); 3 us is
   the order of a null kernel's launch-to-completion time on recent NVIDIA GPUs (NVIDIA developer
   forum). The floor is a ``max``, not an addend: in a stream of asynchronous kernels the next
   kernel's launch overlaps the running one, so only a kernel shorter than it pays it. SM counts
   are the datasheet figures (V100 80, A100 108, H100 SXM and H200 132). ``planner calibrate`` on
   the GPU replaces the curve with a measured table.
3. Neither (CPU profiles): the plain roofline, ``min(e, F W / (P B))``, as ``compute_time``.

Symbolic shapes: in cases 1 and 2 a shape with a sympy symbol gives an unevaluated function of
``(m, n, k, batch)`` (one per profile and dtype) that evaluates to a number once ``b`` and ``s``
are substituted, and that ``sympy.lambdify`` compiles to the numeric curve; case 3 stays a plain
sympy expression. The layer table lists each layer's GEMMs (``passes.layer_table.Gemm``), and
``cost_models.strategy`` prices them by shape through ``cost_models.gemm_cost`` (the layer's other
FLOPs at the flat rate); ``matmul_time`` and ``gemms_time`` are the shape-aware primitives.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import sys
from typing import Any, Callable, Iterable, Sequence

from cost_models.hardware import HardwareProfile, ProfileError
from runtime.contract.dtype_table import DTYPES, ITEMSIZE

__all__ = [
    "DTYPE_BYTES",
    "dtype_bytes",
    "compute_time",
    "matmul_flops",
    "matmul_time",
    "gemm_efficiency",
    "gemms_time",
    "numeric_gemms_time",
    "GEMM_TILE",
    "GEMM_SPLIT_K_MIN",
    "GEMM_MIN_TIME_S",
    "ridge_intensity",
    "adam_step_bytes",
    "adam_step_flops",
    "optimizer_step_time",
    "smax",
    "smin",
]

#: Bytes per element of each dtype name: the training dtypes (``runtime.contract.dtype_table``) and
#: ``tf32``, an fp32 matmul mode stored as fp32.
DTYPE_BYTES: dict[str, int] = {**ITEMSIZE, "tf32": 4}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}") from None


def _is_symbolic(x: Any) -> bool:
    """Whether ``x`` is a sympy expression. Before anything imported sympy none can exist: a
    re-plan from the layer-table cache prices numbers only and never imports it."""
    sympy = sys.modules.get("sympy")
    # isinstance also catches the GEMM-efficiency functions this module defines on sympy.Function
    return sympy is not None and (isinstance(x, sympy.Basic) or type(x).__module__.startswith("sympy"))


def smax(first: Any, second: Any) -> Any:
    """``max`` that also works on sympy expressions (``sympy.Max``)."""
    if _is_symbolic(first) or _is_symbolic(second):
        import sympy

        return sympy.Max(first, second)
    return first if first >= second else second


def smin(first: Any, second: Any) -> Any:
    """``min`` that also works on sympy expressions (``sympy.Min``)."""
    if _is_symbolic(first) or _is_symbolic(second):
        import sympy

        return sympy.Min(first, second)
    return first if first <= second else second


def _check_nonneg(name: str, value: Any) -> None:
    if not _is_symbolic(value) and value < 0:
        raise ValueError(f"{name} must be >= 0 (got {value!r})")


def compute_time(flops: Any, bytes_moved: Any, hw: HardwareProfile, dtype: str) -> Any:
    """Roofline time in seconds: ``max(flops / (peak[dtype] * efficiency), bytes / mem_bw)``.

    ``flops`` counts floating-point operations (a multiply-add is 2), ``bytes_moved`` the bytes
    read plus written in device memory. ``dtype`` picks the peak: ``fp32``, ``bf16``, ``fp16``
    (or ``tf32`` where the profile has it).
    """
    _check_nonneg("flops", flops)
    _check_nonneg("bytes_moved", bytes_moved)
    try:
        rate = hw.achievable_flops(dtype)
    except ProfileError as e:
        raise ValueError(str(e)) from None
    return smax(flops / rate, bytes_moved / hw.memory_bandwidth)


def matmul_flops(m: Any, n: Any, k: Any, batch: Any = 1) -> Any:
    """FLOPs of ``batch`` products of an ``m x k`` by a ``k x n`` matrix: ``2 * batch * m * n * k``."""
    return 2 * batch * m * n * k


def matmul_time(m: Any, n: Any, k: Any, hw: HardwareProfile, dtype: str, batch: Any = 1) -> Any:
    """Seconds of ``batch`` products of an ``m x k`` by a ``k x n`` matrix: the FLOPs at the
    shape's efficiency (``gemm_efficiency``). On a profile without a GEMM table or ``sm_count``
    (CPUs) that is the roofline of a matmul that reads both operands and writes the result once."""
    moved = batch * (m * k + k * n + m * n) * dtype_bytes(dtype)
    flops = matmul_flops(m, n, k, batch)
    if not _shape_priced(hw, dtype):
        return compute_time(flops, moved, hw, dtype)
    for name, value in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        _check_nonneg(name, value)
    if not any(_is_symbolic(x) for x in (m, n, k, batch)) and flops == 0:
        return moved / hw.memory_bandwidth
    return flops / (_peak(hw, dtype) * gemm_efficiency(hw, dtype, m, n, k, batch))


def gemms_time(gemms: Iterable[Sequence[Any]], hw: HardwareProfile, dtype: str) -> Any:
    """Seconds of a list of GEMMs, each ``(m, n, k)``, ``(m, n, k, batch)`` or ``(m, n, k, batch,
    count)`` (``count`` identical products), each priced by its shape (``matmul_time``): the
    shape-aware replacement of ``compute_time(flops, 0, ...)`` for a layer that lists its GEMMs."""
    total: Any = 0.0
    for gemm in gemms:
        m, n, k, batch, count = (tuple(gemm) + (1, 1))[:5] if len(gemm) < 5 else tuple(gemm)
        total = total + count * matmul_time(m, n, k, hw, dtype, batch)
    return total


def numeric_gemms_time(
    gemms: Iterable[tuple[float, float, float, float, int]], hw: HardwareProfile, dtype: str
) -> float:
    """``gemms_time`` of numeric ``(m, n, k, batch, count)`` entries on a profile that prices by
    shape, without the symbolic dispatch of ``matmul_time`` (the same arithmetic, so the same
    result): the search prices every layer of every candidate through here."""
    if not _shape_priced(hw, dtype):
        return float(gemms_time(gemms, hw, dtype))
    peak = _peak(hw, dtype)
    esize = dtype_bytes(dtype)
    total = 0.0
    for m, n, k, batch, count in gemms:
        if m < 0 or n < 0 or k < 0 or batch < 0:
            raise ValueError(f"GEMM sizes must be >= 0 (got m={m}, n={n}, k={k}, batch={batch})")
        flops = 2 * batch * m * n * k
        if flops == 0:
            seconds = batch * (m * k + k * n + m * n) * esize / hw.memory_bandwidth
        else:
            seconds = flops / (peak * _numeric_efficiency(hw, dtype, float(m), float(n), float(k), float(batch)))
        total = total + count * seconds
    return total


# ----------------------------------------------------------------------------------------------
# GEMM efficiency by shape (the module docstring's three cases)
# ----------------------------------------------------------------------------------------------
#: Output tile edge of the default curve (cuBLAS's 128 x 128 thread-block tile).
GEMM_TILE = 128
#: Split-K divides ``k`` only while every split keeps at least this much of it.
GEMM_SPLIT_K_MIN = 1024
#: Shortest time a GEMM kernel occupies the device (order of a null kernel's launch-to-completion).
GEMM_MIN_TIME_S = 3e-6


def _peak(hw: HardwareProfile, dtype: str) -> float:
    try:
        return hw.peak(dtype)
    except ProfileError as e:
        raise ValueError(str(e)) from None


def _shape_priced(hw: HardwareProfile, dtype: str) -> bool:
    """True when ``hw`` prices a GEMM by its shape (a table for ``dtype``, or an SM count)."""
    return dtype in (hw.gemm_efficiency or {}) or hw.sm_count is not None


def gemm_efficiency(hw: HardwareProfile, dtype: str, m: Any, n: Any, k: Any, batch: Any = 1) -> Any:
    """Fraction of ``peak_flops[dtype]`` that ``batch`` products of an ``m x k`` by a ``k x n``
    matrix reach on ``hw``, in (0, 1]: the measured table, else the default curve (GPU profiles
    with ``sm_count``), else the roofline (module docstring). A symbolic size gives a sympy
    expression that becomes a number once its symbols are substituted. A product with no FLOPs
    (a zero size) has no meaningful efficiency and gets ``compute_efficiency``."""
    for name, value in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        _check_nonneg(name, value)
    peak = _peak(hw, dtype)
    if not _shape_priced(hw, dtype):  # case 3: the roofline, symbolic-friendly
        flops = matmul_flops(m, n, k, batch)
        moved = batch * (m * k + k * n + m * n) * dtype_bytes(dtype)
        if not any(_is_symbolic(x) for x in (m, n, k, batch)):
            return _roofline_efficiency(hw, dtype, float(m), float(n), float(k), float(batch))
        return smin(hw.compute_efficiency, flops * hw.memory_bandwidth / (peak * moved))
    if any(_is_symbolic(x) for x in (m, n, k, batch)):
        return _symbolic_efficiency(hw, dtype)(m, n, k, batch)
    return _numeric_efficiency(hw, dtype, float(m), float(n), float(k), float(batch))


def _roofline_efficiency(hw: HardwareProfile, dtype: str, m: float, n: float, k: float, batch: float) -> float:
    flops = 2.0 * batch * m * n * k
    moved = batch * (m * k + k * n + m * n) * dtype_bytes(dtype)
    if flops <= 0:
        return hw.compute_efficiency
    return min(hw.compute_efficiency, flops * hw.memory_bandwidth / (hw.peak(dtype) * moved))


#: Dtypes whose products run on tensor cores, which need 16-byte aligned sizes
#: (``HardwareProfile.gemm_misaligned_efficiency``); plain fp32 runs on the SIMT cores.
TENSOR_CORE_DTYPES = ("bf16", "fp16", "tf32")


def misaligned(dtype: str, *sizes: float) -> bool:
    """True when a tensor-core product has a size that is not a multiple of 16 bytes of its elements."""
    if dtype not in TENSOR_CORE_DTYPES:
        return False
    align = 16 // dtype_bytes(dtype)
    return any(size % align for size in sizes)


def _numeric_efficiency(hw: HardwareProfile, dtype: str, m: float, n: float, k: float, batch: float) -> float:
    """The shape's efficiency (``_shape_efficiency``), its tensor-core math at
    ``hw.gemm_misaligned_efficiency`` of the rate when a size breaks their 16-byte alignment."""
    slow = hw.gemm_misaligned_efficiency if misaligned(dtype, m, n, k) else 1.0
    return _shape_efficiency(hw, dtype, m, n, k, batch, min(1.0, slow))


def _shape_efficiency(
    hw: HardwareProfile, dtype: str, m: float, n: float, k: float, batch: float, slow: float = 1.0
) -> float:
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return hw.compute_efficiency
    table = (hw.gemm_efficiency or {}).get(dtype)
    if table is not None:  # case 1: the measured table
        eff = _interpolate(table, m * batch, n, k)
        if m * batch < table["m"][0] or n < table["n"][0] or k < table["k"][0]:
            # extrapolated to a smaller product than any measured: no faster than the memory roofline
            roof = (
                2.0 * m * n * k * hw.memory_bandwidth / (hw.peak(dtype) * (m * k + k * n + m * n) * dtype_bytes(dtype))
            )
            eff = min(eff, roof)
        return eff * slow
    return _default_curve(hw, dtype, m, n, k, batch, slow)  # case 2


def _default_curve(hw: HardwareProfile, dtype: str, m: float, n: float, k: float, batch: float, slow: float) -> float:
    """The default curve of the module docstring (case 2), numeric sizes > 0; ``slow``: the share
    of the math's rate a misaligned product keeps. It slows the math only: a product held by the
    kernel floor or by memory keeps that time while the slower math still fits under it."""
    sms = hw.sm_count
    if sms is None:
        raise ValueError(f"hardware {hw.name!r} has no sm_count: the default GEMM curve needs it")
    peak = hw.peak(dtype)
    tile_rows, tile_cols = math.ceil(m / GEMM_TILE), math.ceil(n / GEMM_TILE)
    tiles = batch * tile_rows * tile_cols
    split = max(1.0, min(sms / tiles, k / GEMM_SPLIT_K_MIN))  # continuous: split-K and stream-K
    fill = min(1.0, tiles * split / sms)
    padded = 2.0 * batch * (tile_rows * GEMM_TILE) * (tile_cols * GEMM_TILE) * k
    moved = batch * (m * k + k * n + m * n) * dtype_bytes(dtype)
    # fp32 partial sums of the extra splits, written and read back by the reduction
    moved += 2 * (split - 1.0) * batch * m * n * 4
    math_s = padded / (peak * hw.compute_efficiency * fill)
    seconds = max(math_s, moved / hw.memory_bandwidth, GEMM_MIN_TIME_S)
    eff = min(hw.compute_efficiency, 2.0 * batch * m * n * k / (peak * seconds))
    if slow >= 1.0 or math_s / slow <= seconds:  # aligned, or the slower math still fits under the rest
        return eff
    if math_s >= seconds:  # bound by the math: all of it at the misaligned rate
        return eff * slow
    return min(hw.compute_efficiency, 2.0 * batch * m * n * k / (peak * (math_s / slow)))


def _interpolate(table: dict[str, list], m: float, n: float, k: float) -> float:
    """Trilinear interpolation of ``table['efficiency']`` in log size, clamped to the axes' range."""
    corners = []  # per axis: [(index, weight), ...]
    for axis, x in (("m", m), ("n", n), ("k", k)):
        sizes = table[axis]
        if x <= sizes[0] or len(sizes) == 1:
            corners.append([(0, 1.0)])
        elif x >= sizes[-1]:
            corners.append([(len(sizes) - 1, 1.0)])
        else:
            upper = next(i for i, size in enumerate(sizes) if size >= x)
            lower = upper - 1
            weight = (math.log(x) - math.log(sizes[lower])) / (math.log(sizes[upper]) - math.log(sizes[lower]))
            corners.append([(lower, 1.0 - weight), (upper, weight)])
    grid = table["efficiency"]
    return sum(
        weight_m * weight_n * weight_k * grid[i][j][k_index]
        for (i, weight_m), (j, weight_n), (k_index, weight_k) in itertools.product(*corners)
    )


_FUNCTION_IDS = itertools.count()


@functools.lru_cache(maxsize=256)
def _symbolic_efficiency(hw: HardwareProfile, dtype: str) -> Callable[..., Any]:
    """A sympy function ``f(m, n, k, batch)`` of one profile and dtype: unevaluated while a size
    is symbolic, ``_numeric_efficiency`` once all are numbers (``subs``), and compiled to it by
    ``sympy.lambdify`` (its ``_imp_``)."""

    import sympy  # only symbolic sizes reach here

    def numeric(m, n, k, batch):
        return _numeric_efficiency(hw, dtype, float(m), float(n), float(k), float(batch))

    class _GemmEfficiency(sympy.Function):
        nargs = 4

        @classmethod
        def eval(cls, m, n, k, batch):
            if all(arg.is_Number for arg in (m, n, k, batch)):
                return sympy.Float(numeric(m, n, k, batch))
            return None

    # A unique, printable name per (profile, dtype): lambdify puts each in its namespace.
    name = f"gemm_efficiency_{re.sub(r'[^0-9A-Za-z]+', '_', hw.name)}_{dtype}_{next(_FUNCTION_IDS)}"
    cls = type(name, (_GemmEfficiency,), {"_imp_": staticmethod(numeric)})
    return cls


def ridge_intensity(hw: HardwareProfile, dtype: str) -> float:
    """FLOPs per byte above which an operator is compute-bound on ``hw``: ``P * e / W``."""
    return hw.achievable_flops(dtype) / hw.memory_bandwidth


def adam_step_bytes(num_params: Any, dtype: str) -> Any:
    """Device-memory bytes of one optimizer step as the runtime runs it (``ZeroEngine.step`` and
    ``zero_grad``, timed together as the ``optimizer`` part) for ``num_params`` (this device's shard):

    - the global gradient norm: two dot products over the fp32 gradient (the whole, for inf/nan,
      and its norm ranges): read 4 + 4;
    - torch's fused AdamW (``runtime.data_parallel.flat_shards.adamw_step_``): read the gradient,
      master and both moments, write the three: 28; the clip (and fp16 unscale) factor and the
      decoupled weight decay are applied inside it;
    - ``zero_grad``: the gradient buffer written;
    - mixed precision only: the gradient cast to fp32 for the norm and again for the update
      (read 2 + write 4, twice) and the updated master cast to the compute copy (read 4 + write 2).

    - fp32:      8 + 28 + 4                  = 40 bytes
    - bf16/fp16: 12 + 8 + 28 + 6 + 2         = 56 bytes
    """
    if dtype == "fp32":
        per = 8 + 28 + 4
    elif dtype in ("bf16", "fp16"):
        per = 12 + 8 + 28 + 6 + 2
    else:
        raise ValueError(f"unknown training dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return per * num_params


def adam_step_flops(num_params: Any) -> Any:
    """About 12 FLOPs per parameter: two moment updates, bias corrections, sqrt, divide, decay."""
    return 12 * num_params


def optimizer_step_time(num_params: Any, hw: HardwareProfile, dtype: str) -> Any:
    """Time of one AdamW step over ``num_params`` parameters: the fp32 step's bytes at the
    profile's measured ``optimizer_bytes_per_s`` (the step itself, timed by ``planner
    calibrate``: a CPU's fused AdamW runs at neither its copy bandwidth nor its FLOP rate) plus
    mixed precision's casts at the copy bandwidth; without a measured rate, the roofline
    (memory-bound in practice; the elementwise arithmetic runs in fp32 whatever the training
    dtype, so the fp32 peak applies)."""
    moved = adam_step_bytes(num_params, dtype)
    if hw.optimizer_bytes_per_s is None:
        return compute_time(adam_step_flops(num_params), moved, hw, "fp32")
    fp32 = adam_step_bytes(num_params, "fp32")
    return fp32 / hw.optimizer_bytes_per_s + (moved - fp32) / hw.memory_bandwidth
