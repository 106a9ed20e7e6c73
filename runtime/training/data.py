"""Training data as a pure function of (seed, step).

The global batch of step ``t`` is the same for every plan of a model: rank ``d`` of ``dp``
data-parallel ranks takes rows ``[d * B/dp, (d + 1) * B/dp)`` and splits them into micro-batches.
So plans that differ in dp, tp, pp or micro-batching see the same samples and, in fp32, produce
the same losses.

Sources:

- ``SyntheticTokens``: a seeded Markov chain over the vocabulary, drawn with a counter-based
  generator: each token is followed by its fixed successor (a random permutation of the
  vocabulary, fixed by the seed) with probability ``FOLLOW``, else by a uniform random token. A
  model can learn it, so the loss of a demo or a smoke test falls (uniform tokens would hold it at
  ``ln V``); the best achievable loss is about ``0.25 * ln(4 V) + 0.22`` nats;
- ``TokenFile``: a flat array of uint16/uint32 token ids (``.bin``/``.npy``, read with a numpy
  memmap) or a UTF-8 text file read as bytes (byte-level tokens, vocabulary 256). Each sample is
  a window of ``seq_len + 1`` tokens starting at an offset drawn from (seed, step, row).

Both yield ``(tokens, next tokens)`` rows; ``model_inputs`` turns them into the model's own inputs,
whatever their number and order, from each input's role (plan.json ``model.inputs``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from runtime.contract.data_roles import INPUT_ROLES
from runtime.contract.input_errors import DataError

__all__ = [
    "SyntheticTokens",
    "TokenFile",
    "open_data",
    "rank_slice",
    "model_inputs",
    "data_vocab",
    "batch_checksum",
    "CHECKSUM_MODULUS",
]


def _rng(seed: int, step: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=[seed & 0xFFFFFFFFFFFFFFFF, step]))


#: Probability that a synthetic token is its predecessor's fixed successor.
FOLLOW = 0.75


class SyntheticTokens:
    """Learnable synthetic text: a Markov chain with one likely successor per token (module doc)."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0):
        if vocab < 2:
            raise DataError(f"synthetic data needs a vocabulary of at least 2 tokens, got {vocab}")
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        # The chain's successor table comes from a stream no step uses (step numbers are >= 0).
        self.successor = _rng(seed, 2**63).permutation(vocab)

    def rows(self, step: int, start: int, stop: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:stop`` of step ``step``'s global batch as (input_ids, labels)."""
        rng = _rng(self.seed, step)
        shape = (global_batch, self.seq_len + 1)
        fresh = rng.integers(0, self.vocab, size=shape)
        follow = rng.random(size=shape) < FOLLOW
        tokens = fresh[start:stop].copy()
        follow = follow[start:stop]
        for i in range(1, shape[1]):
            tokens[:, i] = np.where(follow[:, i], self.successor[tokens[:, i - 1]], tokens[:, i])
        table = torch.from_numpy(tokens.astype(np.int64))
        return table[:, :-1].contiguous(), table[:, 1:].contiguous()


class TokenFile:
    def __init__(self, path: str, seq_len: int, seed: int = 0, vocab: int | None = None):
        self.path, self.seq_len, self.seed = path, seq_len, seed
        if not os.path.exists(path):
            raise DataError(f"data file {path!r} does not exist")
        if not os.access(path, os.R_OK):
            raise DataError(f"data file {path!r} is not readable (check its permissions)")
        try:
            if path.endswith(".npy"):
                array = np.load(path, mmap_mode="r")
            elif path.endswith((".bin", ".u16", ".u32")):
                dtype = np.uint32 if path.endswith(".u32") else np.uint16
                array = np.memmap(path, dtype=dtype, mode="r")
            else:
                with open(path, "rb") as f:
                    raw = f.read()
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path} is neither a token array (.bin/.u16 uint16, .u32 uint32, .npy) nor UTF-8 "
                        f"text (invalid byte at offset {e.start})"
                    ) from None
                array = np.frombuffer(raw, dtype=np.uint8)
        except (OSError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"cannot read data file {path}: {e}") from None
        if array.ndim != 1:
            raise DataError(f"{path}: token arrays must be flat (1-D), got shape {array.shape}")
        if array.shape[0] < seq_len + 1:
            raise DataError(
                f"{path} holds {array.shape[0]} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}"
            )
        if array.dtype.kind not in "iu":
            raise DataError(
                f"{path} holds {array.dtype} values, not token ids: save an integer array "
                "(uint16, uint32, int32 or int64), e.g. np.save(path, ids.astype(np.uint32))"
            )
        self.tokens = array
        if vocab is not None and array.shape[0]:
            lowest, highest = int(array.min()), int(array.max())
            if lowest < 0 or highest >= vocab:
                bad = lowest if lowest < 0 else highest
                raise DataError(f"{path} contains token id {bad}, outside the model's vocabulary 0..{vocab - 1}")

    def rows(self, step: int, start: int, stop: int, global_batch: int):
        last_start = self.tokens.shape[0] - self.seq_len - 1
        offsets = _rng(self.seed, step).integers(0, last_start + 1, size=global_batch)[start:stop]
        windows = np.stack(
            [np.asarray(self.tokens[offset : offset + self.seq_len + 1], dtype=np.int64) for offset in offsets]
        )
        table = torch.from_numpy(windows)
        return table[:, :-1].contiguous(), table[:, 1:].contiguous()


def model_inputs(specs: list[dict], tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The model's inputs, in order, for rows ``tokens`` / ``targets`` (``(r, S)`` each) of a data
    source: each input is filled by its role (``INPUT_ROLES``) with its own dtype; sizes named
    ``"b"`` / ``"s"`` (or, for a static trace, the first size) follow the rows and the sequence."""
    rows, seq = tokens.shape
    out = []
    for x in specs:
        dtype = getattr(torch, x.get("dtype", "int64"))
        role = x["role"]
        if role == "tokens" or role == "labels":
            value = tokens
        elif role == "targets":
            value = targets
        elif role == "positions":
            value = torch.arange(seq, device=tokens.device).expand(rows, seq)
        elif role in ("ones", "zeros"):
            dims = [
                rows if i == 0 or size == "b" else seq if size == "s" else int(size)
                for i, size in enumerate(x["shape"])
            ]
            value = (torch.ones if role == "ones" else torch.zeros)(dims, dtype=dtype, device=tokens.device)
        else:
            raise DataError(f"input {x['name']!r} has role {role!r}; the data loader knows {', '.join(INPUT_ROLES)}")
        out.append(value.to(dtype).contiguous())
    return tuple(out)


def data_vocab(specs: list[dict], vocab: int) -> int:
    """The vocabulary to draw tokens from: the smallest any token-like input can index, else ``vocab``."""
    known = [x["vocab"] for x in specs if x["role"] in ("tokens", "labels", "targets") and x.get("vocab")]
    return min(known) if known else vocab


def open_data(path: str | None, vocab: int, seq_len: int, seed: int):
    return SyntheticTokens(vocab, seq_len, seed) if path is None else TokenFile(path, seq_len, seed, vocab)


def rank_slice(global_batch: int, dp: int, dp_index: int) -> tuple[int, int]:
    per_rank = global_batch // dp
    return dp_index * per_rank, (dp_index + 1) * per_rank


#: The data checksum's modulus (a prime below 2**31: a sum over many ranks stays exact in float64).
CHECKSUM_MODULUS = 2_147_483_647


def batch_checksum(ids: torch.Tensor, first_row: int) -> int:
    """A checksum of token rows ``ids`` (``(r, S)``) that are rows ``first_row ..`` of a global
    batch: each row's position-weighted token sum times its row number, modulo
    ``CHECKSUM_MODULUS``. Additive over row ranges, so the ranks' checksums of their slices sum
    (modulo) to the whole batch's: the metrics' ``data_checksum`` shows which samples a step read."""
    table = ids.detach().to("cpu", torch.int64)
    positions = torch.arange(1, table.shape[1] + 1, dtype=torch.int64)
    per_row = (table * positions).sum(dim=1) % CHECKSUM_MODULUS
    rows = torch.arange(first_row + 1, first_row + 1 + table.shape[0], dtype=torch.int64)
    return int(((per_row * rows) % CHECKSUM_MODULUS).sum()) % CHECKSUM_MODULUS
