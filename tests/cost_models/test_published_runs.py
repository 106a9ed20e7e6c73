"""The default A100 profile against published Megatron-LM runs (``benchmarks/bench_published.py``).

The band is the issue's 10%: the cost model prices the runs from first principles (the model as
it ran, the datasheet rates), so a change that moves these rows out of it changed what a GPU
plan costs and must say why. The full tables are the benchmark's (minutes); here a cheap subset.
"""

from __future__ import annotations

import pytest

from benchmarks.bench_published import ROWS, SEQ, VOCAB, eq3_flops, plan_row

BAND = 0.10


def _row(name: str):
    return next(row for row in ROWS if row.name == name)


def _model_flops(row) -> float:
    """Korthikanti et al.'s model FLOPs per iteration (no recomputation): the MFU numerator."""
    b, s, l, h = row.batch, SEQ, row.layers, row.hidden
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (12 * l * h))


@pytest.mark.parametrize(("name", "mfu"), [("22B", 0.415), ("175B", 0.514), ("530B", 0.560), ("1T", 0.563)])
def test_korthikanti_times_reproduce_the_published_mfu(name, mfu):
    """The "present work" iteration times, batches and shapes of Table 5 give the MFU the
    Megatron-LM README lists for the same runs (312 TFLOP/s per A100): a check on the transcription."""
    row = _row(f"{name} sp+sel")
    assert _model_flops(row) / (row.figure * row.gpus * 312e12) == pytest.approx(mfu, abs=0.002)


def test_narayanan_1t_row_gives_the_headline_aggregate():
    """163 TFLOP/s on each of 3072 GPUs is the paper's 502 petaFLOP/s (to its rounding), and
    Eq. 3 counts the recomputation: 4/3 of the model FLOPs but for the LM head (not recomputed)."""
    row = _row("1008B")
    assert row.figure * row.gpus / 1e3 == pytest.approx(502, rel=0.005)
    assert eq3_flops(row) / _model_flops(row) == pytest.approx(4 / 3, rel=0.002)


@pytest.mark.slow  # about 30 s here: two traces of the Megatron GPT and five plans
def test_cheap_rows_within_band_and_free_never_slower():
    for name in ("22B full", "22B sp+sel", "1.7B"):
        row = _row(name)
        pinned = plan_row(row, pinned=True)
        assert abs(pinned["ratio"] - 1) <= BAND, (name, pinned)
        if name != "1.7B":
            free = plan_row(row, pinned=False)
            assert free["step_time_s"] <= pinned["step_time_s"] * (1 + 1e-9), (name, free, pinned)
