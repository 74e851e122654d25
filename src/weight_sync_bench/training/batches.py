"""Training batches with uneven valid tokens: padding, ignored labels and packed documents.

A row of a batch holds documents back to back, then padding. ``BatchSpec.documents`` says
how long each document of each row is; what is left of the row is padding. Labels are
``IGNORE_INDEX`` on padding and on a seeded fraction of real tokens, so data-parallel ranks
that get different rows hold different numbers of valid tokens.

Unpacked batches (at most one document per row) use plain causal attention. Packed ones
pass each position's document id (``segments``, -1 on padding) to the model, which builds
the block-diagonal causal mask from it (``model.document_mask``): a padding query sees no
key at all, the all-masked case the attention's neutral rule handles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weight_sync_bench.errors import InvalidBatch, InvalidNumber
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.training.loss import IGNORE_INDEX, valid_count

PAD_TOKEN = 0  # the token id padding positions carry (their labels are ignored)


@dataclass(frozen=True)
class BatchSpec:
    """The layout of one batch: per row, its documents' lengths (the rest is padding)."""

    documents: tuple[tuple[int, ...], ...]
    seq_len: int
    ignore_rate: float = 0.0  # fraction of real tokens whose label is ignored
    packed: bool = False  # several documents per row, separated by the document mask

    def __post_init__(self) -> None:
        InvalidNumber.count("seq_len", self.seq_len)
        if not self.documents:
            raise InvalidBatch("a batch needs at least one row, got documents=()")
        for row, docs in enumerate(self.documents):
            if any(n < 1 for n in docs):
                raise InvalidBatch(f"row {row}: document lengths must be >= 1, got {docs}")
            if sum(docs) > self.seq_len:
                raise InvalidBatch(f"row {row}: documents {docs} fill {sum(docs)} positions, "
                                   f"seq_len={self.seq_len}")
            if not self.packed and len(docs) > 1:
                raise InvalidBatch(f"row {row}: {len(docs)} documents in an unpacked batch "
                                   "(set packed=True for a document mask)")
        if not 0.0 <= self.ignore_rate < 1.0:
            raise InvalidBatch(f"ignore_rate must be in [0, 1), got {self.ignore_rate}")

    @property
    def rows(self) -> int:
        return len(self.documents)


def segments_from_documents(documents: tuple[tuple[int, ...], ...], seq_len: int,
                            shift: int = 0) -> torch.Tensor:
    """Document ids ``(B, T)``: 0, 1, ... per document in row order, -1 on padding.

    ``shift`` moves every document boundary (and the start of padding) right by that many
    positions; 0 is the correct mapping, 1 is the off-by-one the mutation
    ``doc_mask_offset`` injects.
    """
    segments = torch.full((len(documents), seq_len), -1, dtype=torch.long)
    for row, docs in enumerate(documents):
        start = 0
        for doc, length in enumerate(docs):
            stop = start + length
            lo, hi = (0 if doc == 0 else start + shift), min(stop + shift, seq_len)
            segments[row, lo:hi] = doc
            start = stop
    return segments


@dataclass(frozen=True)
class TrainBatch:
    """Token ids, labels and document ids of one batch, all ``(B, T)``."""

    spec: BatchSpec
    tokens: torch.Tensor
    targets: torch.Tensor
    segments: torch.Tensor

    @property
    def model_segments(self) -> torch.Tensor | None:
        """What the model's attention reads: document ids when packed, else None (causal)."""
        return self.segments if self.spec.packed else None

    @property
    def valid(self) -> int:
        return valid_count(self.targets)

    def rows(self, index: list[int], *, shift: int = 0) -> TrainBatch:
        """The rows ``index`` as a batch of their own, as a data-parallel rank receives them;
        its document ids are rebuilt from the documents with ``shift`` (see
        ``segments_from_documents``)."""
        docs = tuple(self.spec.documents[i] for i in index)
        spec = BatchSpec(docs, self.spec.seq_len, self.spec.ignore_rate, self.spec.packed)
        return TrainBatch(spec, self.tokens[index], self.targets[index],
                          segments_from_documents(docs, self.spec.seq_len, shift))


def make_batch(config: ModelConfig, spec: BatchSpec, seed: int, layout_seed: int | None = None
               ) -> TrainBatch:
    """Tokens and labels drawn from ``seed`` in the layout ``spec``; at least one label valid
    (a batch of padding alone has no valid-token mean and is rejected). Which labels are
    ignored is drawn from ``layout_seed`` (default ``seed``): steps that share it share
    their valid-token counts and differ only in tokens and labels."""
    if not any(spec.documents):
        raise InvalidBatch(f"every one of the {spec.rows} rows is padding: a valid-token mean "
                           "over zero tokens")
    gen = torch.Generator().manual_seed(seed)
    shape = (spec.rows, spec.seq_len)
    segments = segments_from_documents(spec.documents, spec.seq_len)
    real = segments >= 0
    tokens = torch.randint(0, config.vocab, shape, generator=gen).masked_fill(~real, PAD_TOKEN)
    targets = torch.randint(0, config.vocab, shape, generator=gen)
    layout_gen = gen if layout_seed is None else torch.Generator().manual_seed(layout_seed)
    ignored = torch.rand(shape, generator=layout_gen) < spec.ignore_rate
    if not (real & ~ignored).any():  # keep the first real token's label: the mean needs one
        first = int(real.flatten().nonzero()[0])
        ignored.view(-1)[first] = False
    targets = targets.masked_fill(~real | ignored, IGNORE_INDEX)
    return TrainBatch(spec, tokens, targets, segments)


def default_spec(config: ModelConfig, *, packed: bool, ignore_rate: float = 0.25) -> BatchSpec:
    """The batch the named checks run: every row a different valid length, so data-parallel
    ranks hold uneven counts; packed rows hold 2-3 documents and end in padding."""
    t, rows = config.seq_len, []
    for row in range(config.batch):
        length = t - (row * t) // (2 * config.batch)  # t, then shorter: uneven counts
        if packed:
            first, second = max(1, length // 3), max(1, length // 2)
            docs = (first, second, length - first - second) if length - first - second > 0 else (
                first, length - first)
            rows.append(tuple(n for n in docs if n > 0))
        else:
            rows.append((length,))
    # padding at the end of a packed row whose last document is longer than one token (a
    # short row, at seq_len 3 or 4, may end full: every shipped config pads every row)
    if packed and config.seq_len > 1:
        rows = [docs[:-1] + (docs[-1] - 1,) if docs[-1] > 1 else docs for docs in rows]
    return BatchSpec(tuple(rows), t, ignore_rate, packed)
