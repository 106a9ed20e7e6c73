"""Which values of a stage carry gradients (``codegen.stage_files._requires_grad``): what each
stage boundary declares to the next, whose received tensors must then require grad."""

from __future__ import annotations

import torch
from torch import nn

from codegen.stage_files import _requires_grad


class HeadFirst(nn.Module):
    """A token table tied to the LM head that was registered first, as transformers ties them:
    ``named_parameters`` lists the weight once, under the head's name, and the table's lookup
    reads it by the embedding's."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 8, bias=False)
        self.emb = nn.Embedding(8, 4)
        self.emb.weight = self.head.weight

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x).sum(), x.clone()  # the raw lookup leaves too (Zamba2's original hidden states)


def test_a_tied_table_read_by_its_second_name_carries_gradients():
    gm = torch.export.export(HeadFirst(), (torch.zeros(2, 3, dtype=torch.long),)).module()
    assert [name for name, _ in gm.named_parameters()] == ["head.weight"]
    carries = {node.name: value for node, value in _requires_grad(gm).items()}
    assert carries["embedding"] and carries["clone"]
    assert not carries["ids"]
