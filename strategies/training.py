"""Hypothesis strategies for the training-equivalence properties.

Small geometries (one training check costs tens of milliseconds at the top of these
ranges), batches with uneven valid-token counts, padding and ignored labels, packing
layouts (including rows of padding alone), vocab sizes that no TP degree divides, and
DP x TP shapes. Dependent values are drawn next to each other (``n_kv_heads``, then
``n_heads`` as a multiple, the TP degree from the layout's supported ones, DP from the
rows), never filtered. Everything shrinks toward one layer, one KV head, an unpacked batch
without ignored labels, and dp = tp = 1.
"""

from __future__ import annotations

from hypothesis import strategies as st

from weight_sync_bench.model.config import ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.training.batches import BatchSpec
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.step import TrainingCase

__all__ = ["batch_specs", "meshes", "sequence_cases", "sequence_mesh_shapes",
           "train_geometries", "training_cases", "uneven_sequence_meshes"]


@st.composite
def train_geometries(draw: st.DrawFn) -> ModelConfig:
    """A small config with every training variant drawn: ``vocab`` is any size and padded to
    a multiple of ``n_kv_heads`` (so no supported degree divides it unless by chance), tied
    embeddings and biases on or off. Shrinks toward one KV head, one layer, no variants."""
    n_kv_heads = draw(st.sampled_from([1, 2, 4]))
    n_heads = n_kv_heads * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return ModelConfig(
        name="train_fuzz", vocab=draw(st.integers(8, 80)), d_model=8 * draw(st.integers(1, 8)),
        n_layers=draw(st.integers(1, 2)), n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, ffn=n_kv_heads * draw(st.integers(2, 8)), batch=4, seq_len=8,
        vocab_multiple=n_kv_heads, tie_embeddings=draw(st.booleans()), bias=draw(st.booleans()))


@st.composite
def batch_specs(draw: st.DrawFn, rows: int = 4, seq_len: int = 8) -> BatchSpec:
    """A batch layout: per row, document lengths then padding. Unpacked rows hold at most
    one document; packed rows 1-3, and a row may be padding alone (its attention rows all
    masked). At least one row holds a token. Shrinks toward unpacked full rows, no ignored
    labels."""
    packed = draw(st.booleans())
    ignore_rate = draw(st.sampled_from([0.0, 0.25, 0.5]))
    layout = []
    for _ in range(rows):
        used = draw(st.integers(0, seq_len).map(lambda n: seq_len - n))  # shrinks to full
        if used == 0:
            layout.append(())
        elif not packed:
            layout.append((used,))
        else:
            cuts = sorted(draw(st.sets(st.integers(1, used - 1), max_size=2))) if used > 1 else []
            bounds = [0, *cuts, used]
            layout.append(tuple(b - a for a, b in zip(bounds, bounds[1:])))
    if not any(layout):
        layout[0] = (seq_len,)
    return BatchSpec(tuple(layout), seq_len, ignore_rate, packed)


def meshes(config: ModelConfig, rows: int) -> st.SearchStrategy[Mesh]:
    """A DP x TP shape: TP from the degrees the layout supports, DP from 1..rows (a DP rank
    may get only padding rows). Shrinks toward dp = tp = 1."""
    return st.builds(Mesh, dp=st.integers(1, rows),
                     tp=st.sampled_from(layout_for(config).supported_degrees()))


@st.composite
def training_cases(draw: st.DrawFn, steps: int = 2) -> TrainingCase:
    """A whole training check: geometry, batch layout, mesh and seed (weights from a
    ``torch.Generator``, never drawn). Shrinks as its parts do, then toward seed 0."""
    config = draw(train_geometries())
    spec = draw(batch_specs(config.batch, config.seq_len))
    mesh = draw(meshes(config, spec.rows))
    seed = draw(st.integers(0, 2**16 - 1))
    return TrainingCase(config, mesh, seed, steps, spec, init_params(config, seed))


def sequence_mesh_shapes(config: ModelConfig, rows: int, seq_len: int
                         ) -> st.SearchStrategy[Mesh]:
    """A mesh that shards the sequence: CP from 1, 2, 4 where it divides ``seq_len`` (the
    measured CP degrees), TP from the supported degrees, SP drawn, and where SP is on the TP degree
    is drawn from those dividing the chunk, so every draw splits evenly (uneven splits are
    rejected, see ``uneven_sequence_meshes``). Shrinks toward dp = tp = cp = 1, SP off."""
    degrees = layout_for(config).supported_degrees()

    @st.composite
    def draw_mesh(draw: st.DrawFn) -> Mesh:
        cp = draw(st.sampled_from([c for c in (1, 2, 4) if seq_len % c == 0]))
        sp = draw(st.booleans())
        fits = [t for t in degrees if not sp or (seq_len // cp) % t == 0]
        return Mesh(draw(st.integers(1, rows)), draw(st.sampled_from(fits)), sp, cp)

    return draw_mesh()


def uneven_sequence_meshes(seq_len: int) -> st.SearchStrategy[Mesh]:
    """A dp = tp = 1 mesh whose CP degree does not divide ``seq_len`` (the rejected case).
    Shrinks toward the smallest such degree."""
    return st.integers(2, 2 * seq_len).filter(lambda c: seq_len % c != 0).map(
        lambda c: Mesh(1, 1, cp=c))


@st.composite
def sequence_cases(draw: st.DrawFn, steps: int = 1) -> TrainingCase:
    """A training check on a sequence-sharding mesh: a small geometry with its sequence
    length drawn from 8, 6, 4 (6: CP 4 does not divide it and is never drawn; tokens stay
    inside the measured domain), a packed or unpacked batch whose documents cross chunk edges wherever their
    cuts fall, and ``sequence_mesh_shapes``. Shrinks as ``training_cases`` does, toward
    the shortest sequence and an unsharded mesh."""
    config = draw(train_geometries())
    config = config.replace(seq_len=draw(st.sampled_from([8, 6, 4])))
    spec = draw(batch_specs(config.batch, config.seq_len))
    mesh = draw(sequence_mesh_shapes(config, spec.rows, spec.seq_len))
    seed = draw(st.integers(0, 2**16 - 1))
    return TrainingCase(config, mesh, seed, steps, spec, init_params(config, seed))
