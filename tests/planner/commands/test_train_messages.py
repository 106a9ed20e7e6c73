"""What `planner train` adds to a rank's failure: the fix a user can act on."""

from __future__ import annotations

from planner.commands.train import _dtype_hint
from tests.helpers import manual_plan

MISMATCH = "rank 1 failed: RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"


def test_a_dtype_mismatch_under_a_16_bit_plan_points_at_fp32():
    """Inkling-2 keeps its convolutions in fp32 (transformers' ``_keep_in_fp32_modules_strict``)
    and casts to fp32 before them; the runtime computes every layer in the plan's bf16."""
    hint = _dtype_hint(manual_plan("gpt", {"layers": 2}, dtype="bf16"), MISMATCH)
    assert "computes every layer in bf16" in hint and "--dtype fp32" in hint
    assert _dtype_hint(manual_plan("gpt", {"layers": 2}, dtype="fp32"), MISMATCH) == ""
    assert _dtype_hint(manual_plan("gpt", {"layers": 2}, dtype="bf16"), "rank 0 failed: out of memory") == ""
