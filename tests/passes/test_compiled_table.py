"""passes.compiled_table: a layer table's compiled numeric form gives the symbolic table's numbers
without sympy, for any expressions a pass writes (polynomials, Max/Min of them, floors, rationals)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.compiled_table import CompiledTable
from passes.core import B, S
from passes.pass_error import PassError
from tests.helpers import gpt_table

_TERMS = [
    lambda c: c * B * S,
    lambda c: c * B * S**2,
    lambda c: sympy.Max(c * B * S, 7 * S),
    lambda c: sympy.Min(c * S, 4096) * B,
    lambda c: sympy.floor(S / 3) * c,
    lambda c: sympy.Rational(c, 3) * B * S,
    lambda c: sympy.Integer(c),
]


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 4),
    picks=st.lists(st.tuples(st.integers(0, len(_TERMS) - 1), st.integers(1, 50)), min_size=1, max_size=6),
    points=st.lists(st.tuples(st.integers(1, 16), st.integers(1, 9000)), min_size=1, max_size=4),
)
def test_compiled_numbers_equal_the_symbolic_tables(layers, picks, points):
    table = gpt_table(layers=layers, hidden=64, heads=2, vocab=128, attention_core=True)
    # a few fields of the first block replaced by the kinds of expressions passes write
    fields = ("fwd_bytes", "saved_bytes", "peak_act_bytes", "tp_loss_fwd_bytes", "core_fwd_bytes", "expert_tokens")
    block = table.layers[1]
    for (term, coefficient), name in zip(picks, fields):
        block = dataclasses.replace(block, **{name: _TERMS[term](coefficient)})
    table = dataclasses.replace(table, layers=[table.layers[0], block, *table.layers[2:]])
    record = CompiledTable.record(table)
    assert record is not None
    compiled = CompiledTable(pickle.loads(pickle.dumps(record)), lambda: table)
    for b, s in points:
        assert compiled.numeric(b, s) == table.numeric(b, s)
    assert compiled.nonzero_fields() == table.nonzero_fields()
    assert compiled._full is None  # none of the above read an expression
    assert pickle.loads(pickle.dumps(compiled)) == table  # pickles as the table it stands for


def test_a_fixed_size_is_refused_as_the_symbolic_table_refuses_it():
    table = dataclasses.replace(gpt_table(layers=1, hidden=64, heads=2, vocab=128), fixed={"s": 128})
    record = CompiledTable.record(table)
    assert record is not None
    compiled = CompiledTable(record, lambda: table)
    with pytest.raises(PassError, match="fixed sequence length 128"):
        compiled.numeric(1, 256)
    with pytest.raises(PassError, match="fixed sequence length 128"):
        table.numeric(1, 256)
    assert compiled.numeric(2, 128) == table.numeric(2, 128)


def test_a_damaged_slot_falls_back_to_the_symbolic_table_and_rows_pickle_as_symbolic_rows():
    """An evaluation a damaged record breaks is answered by the symbolic table; a row pickles and
    a table copies as their symbolic selves (never sharing the cached table)."""
    import copy

    table = gpt_table(layers=2, hidden=64, heads=2, vocab=128)
    record = CompiledTable.record(table)
    assert record is not None
    row, gemms = record["index"][1]
    record["index"][1] = ([10**6, *row[1:]], gemms)  # a slot past the function's results
    compiled = CompiledTable(record, lambda: table)
    assert compiled.numeric(2, 64) == table.numeric(2, 64)
    assert pickle.loads(pickle.dumps(compiled.layers[1])) == table.layers[1]
    copied = copy.deepcopy(compiled)
    assert copied == table and copied is not table and copy.copy(compiled) is not table


def test_function_source_refuses_state_beside_the_text():
    from passes.compiled_table import function_source

    def with_default(b, s, k=3):
        return [b * s * k]

    scale = 2

    def with_closure(b, s):
        return [b * s * scale]

    assert function_source(with_default) is None and function_source(with_closure) is None
