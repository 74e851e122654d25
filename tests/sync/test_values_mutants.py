"""``sync.values`` (issue 30, the mutation pass over ``sync/values.py``): phase 2's values.

Phase 2's element check compares what each destination rank holds with what it should
hold, recomputed on that rank. The values it recomputes are, by the module's statement,
``scale(name) * irwin_hall(splitmix64(key(seed, name) + i))`` at the flat index ``i`` of the
canonical tensor; a value that differs on another machine, or a region that reads the wrong
flat indices, or a fill that writes a chunk into the wrong rows, makes the check compare two
wrong things consistently or fail a correct sync. These tests pin:

- ``_splitmix64`` against SplitMix64's published outputs (Vigna's ``splitmix64.c``; Rosetta
  Code's "Pseudo-random numbers/Splitmix64" lists the first five of seed 1234567) and
  ``key`` against ``hashlib.blake2b`` (8 bytes, little-endian);
- every value against a pure-Python statement of the formula, bit for bit (weights
  ``0.02 * g``, norms ``1 + 0.1 * g``, each one float32 rounding), its mean and spread, and
  three values' bits as literals (the same on every machine);
- a region's values as the full tensor's at the region's flat indices, in 1 to 3 dims;
- ``fill`` writing the region in chunks of at most ``CHUNK`` elements of whole dim-0 rows,
  each chunk into its own rows, from the generator or from a user's weights;
- ``WeightValues``: float32, one parameter kept, read on first use, picklable without it."""

from __future__ import annotations

import hashlib
import math
import pickle

import numpy as np
import pytest
import torch

from weight_sync_bench.conventions import checkpoint
from weight_sync_bench.model.config import TOY
from weight_sync_bench.sync import values as V

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SD = 2 * 65536 / math.sqrt(3)  # the sd of 2 * (w0 + w1 + w2 + w3) - 4 * 65535, 16-bit words


def splitmix64(state: int) -> int:
    """One output of SplitMix64 (Vigna, ``splitmix64.c``) from ``state``, which it first
    advances by the golden gamma."""
    z = (state + GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference(seed: int, name: str, i: int) -> np.float32:
    """The module docstring's value, one index at a time, in plain Python integers."""
    key = int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(),
                         "little")
    h = splitmix64(((key + i) & MASK) * GOLDEN & MASK)
    g = np.float32(2 * sum((h >> (16 * w)) & 0xFFFF for w in range(4)) - 4 * 65535)
    if name.endswith("norm.weight"):
        return g * np.float32(0.1 / SD) + np.float32(1.0)
    return g * np.float32(0.02 / SD)


def test_splitmix64_gives_the_published_outputs():
    # seed 1234567's first five (Rosetta Code); V._splitmix64(z) is the output from state
    # z * golden, so z = seed / golden + k gives the stream's (k + 1)-th
    inverse = pow(GOLDEN, -1, 1 << 64)
    z = np.array([(1234567 * inverse + k) & MASK for k in range(5)], dtype=np.uint64)
    assert V._splitmix64(z).tolist() == [6457827717110365317, 3203168211198807973,
                                         9817491932198370423, 4593380528125082431,
                                         16408922859458223821]
    assert V._splitmix64(np.zeros(1, dtype=np.uint64)).tolist() == [0xE220A8397B1DCDAF]
    assert [splitmix64(1234567 + k * GOLDEN & MASK) for k in range(2)] == [
        6457827717110365317, 3203168211198807973]  # the reference agrees


def test_the_key_is_blake2b_of_seed_and_name_8_bytes_little_endian():
    for seed, name in [(0, "norm.weight"), (3, "layers.0.qkv.weight"), (65535, "embed")]:
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
        assert V.key(seed, name) == np.uint64(int.from_bytes(digest, "little"))
        assert V.key(seed, name).dtype == np.uint64
    assert V.key(0, "a") != V.key(1, "a") != V.key(1, "b")


@pytest.mark.parametrize("name", ["layers.0.qkv.weight", "norm.weight",
                                  "layers.1.attn_norm.weight", "output.weight"])
def test_every_value_is_the_formula_bit_for_bit(name):
    flat = np.array([0, 1, 2, 1000, 2**20 + 7, 2**40 + 3])
    got = V.values(7, name, flat)
    assert got.dtype == torch.float32 and got.shape == (6,)
    want = np.array([reference(7, name, int(i)) for i in flat], dtype=np.float32)
    assert got.view(torch.int32).tolist() == want.view(np.int32).tolist()
    # any shape of indices: the values' shape
    assert torch.equal(V.values(7, name, flat.reshape(2, 3)), got.view(2, 3))


def test_three_values_bits_are_pinned():
    got = V.values(0, "layers.0.qkv.weight", np.arange(3)).view(torch.int32).tolist()
    assert got == [1017216789, 1017322355, -1130025646]
    assert V.values(0, "norm.weight", np.arange(3)).tolist() == [
        1.064029574394226, 1.1026344299316406, 0.9264771938323975]


def test_weights_spread_as_the_seed_init_and_norms_about_one():
    w = V.values(1, "layers.0.mlp.weight", np.arange(20000)).double()
    n = V.values(1, "layers.0.mlp_norm.weight", np.arange(20000)).double()
    assert abs(float(w.mean())) < 0.001 and abs(float(w.std()) - 0.02) < 0.001
    assert abs(float(n.mean()) - 1) < 0.005 and abs(float(n.std()) - 0.1) < 0.005
    # Irwin-Hall of four: bounded at sqrt(3) * 2 = 3.46 sd
    assert float(w.abs().max()) <= 0.02 * 2 * math.sqrt(3) + 1e-7
    assert float(w.abs().max()) > 0.02 * 2.5


SHAPES = [((10,), ((3, 8),)), ((5, 7), ((1, 4), (2, 7))), ((4, 6, 5), ((1, 3), (0, 6), (2, 4))),
          ((3, 4, 2), ((0, 3), (1, 2), (0, 2)))]


@pytest.mark.parametrize("shape, region", SHAPES)
def test_a_regions_values_are_the_full_tensors_at_its_flat_indices(shape, region):
    index = np.arange(math.prod(shape)).reshape(shape)
    cut = tuple(slice(a, b) for a, b in region)
    got = V.region_values(5, "layers.0.qkv.weight", shape, region)
    assert got.shape == tuple(b - a for a, b in region)
    assert torch.equal(got, V.values(5, "layers.0.qkv.weight", index[cut]))
    whole = V.region_values(5, "layers.0.qkv.weight", shape, tuple((0, n) for n in shape))
    assert torch.equal(got, whole[cut])
    # twin: another seed or another name, other values
    assert not torch.equal(got, V.region_values(6, "layers.0.qkv.weight", shape, region))
    assert not torch.equal(got, V.region_values(5, "layers.0.o.weight", shape, region))


@pytest.fixture
def chunks(monkeypatch):
    """``region_of`` wrapped: the sub-regions ``fill`` asks for, in order."""
    asked = []
    real = V.region_of

    def region_of(source, name, shape, region):
        asked.append(region)
        return real(source, name, shape, region)

    monkeypatch.setattr(V, "region_of", region_of)
    return asked


@pytest.mark.parametrize("chunk, shape, region, want", [
    # 6 rows of 4: 10 elements a chunk are 2 rows
    (10, (9, 4), ((2, 8), (0, 4)), [((2, 4), (0, 4)), ((4, 6), (0, 4)), ((6, 8), (0, 4))]),
    # 5 rows of 3 (of 5 columns), 7 elements: 2 rows a chunk, the last one short
    (7, (6, 5), ((1, 6), (2, 5)), [((1, 3), (2, 5)), ((3, 5), (2, 5)), ((5, 6), (2, 5))]),
    # rows wider than a chunk: one row at a time
    (2, (3, 2, 3), ((0, 3), (0, 2), (1, 3)),
     [((0, 1), (0, 2), (1, 3)), ((1, 2), (0, 2), (1, 3)), ((2, 3), (0, 2), (1, 3))]),
    # one dimension: CHUNK elements a chunk
    (4, (11,), ((1, 10),), [((1, 5),), ((5, 9),), ((9, 10),)]),
    # the whole region in one chunk
    (100, (4, 4), ((0, 4), (1, 3)), [((0, 4), (1, 3))]),
])
def test_fill_writes_the_region_a_chunk_of_whole_rows_at_a_time(monkeypatch, chunks, chunk,
                                                                 shape, region, want):
    monkeypatch.setattr(V, "CHUNK", chunk)
    out = torch.full([b - a for a, b in region], math.nan)
    V.fill(out, 9, "layers.0.qkv.weight", shape, region)
    assert chunks == want
    assert torch.equal(out, V.region_values(9, "layers.0.qkv.weight", shape, region))


def test_fill_writes_into_a_view_and_nothing_around_it(chunks):
    base = torch.zeros(6, 8)
    view = base[1:4, 2:6]
    V.fill(view, 3, "w", (10, 4), ((5, 8), (0, 4)))
    assert chunks == [((5, 8), (0, 4))]  # 12 elements: one chunk at the default CHUNK
    assert V.CHUNK == 1 << 18
    assert torch.equal(view, V.region_values(3, "w", (10, 4), ((5, 8), (0, 4))))
    view.zero_()
    assert not base.any()


def test_an_empty_region_is_filled_with_nothing(chunks):
    V.fill(torch.empty(0, 3), 0, "w", (4, 3), ((2, 2), (0, 3)))
    assert chunks == []


# --- a user's weights as the values ------------------------------------------------------

@pytest.fixture
def checkpoint_read(monkeypatch):
    """``conventions.checkpoint.read_weights`` stood in: bf16 parameters; its calls counted."""
    weights = {"a": torch.arange(24, dtype=torch.bfloat16).view(2, 3, 4),
               "b": -torch.arange(6, dtype=torch.bfloat16).view(6)}
    reads = []

    class Lazy(dict):
        def __getitem__(self, name):
            reads.append(name)
            return weights[name]

    def read_weights(directory, config):
        reads.append(("open", directory, config.name))
        return Lazy()

    monkeypatch.setattr(checkpoint, "read_weights", read_weights)
    return weights, reads


def test_weight_values_reads_each_parameter_once_in_float32(checkpoint_read, tmp_path):
    weights, reads = checkpoint_read
    source = V.WeightValues(tmp_path, TOY)
    assert reads == []  # nothing is opened until asked
    a = source.parameter("a")
    assert a.dtype == torch.float32 and torch.equal(a, weights["a"].float())
    assert source.parameter("a") is a
    assert torch.equal(source.parameter("b"), weights["b"].float())
    assert torch.equal(source.parameter("a"), a)
    assert reads == [("open", str(tmp_path), "toy"), "a", "b", "a"]  # the last one kept


def test_weight_values_region_narrows_every_dim(checkpoint_read, tmp_path):
    weights, _ = checkpoint_read
    source = V.WeightValues(str(tmp_path), TOY)
    got = source.region("a", (2, 3, 4), ((1, 2), (0, 2), (1, 4)))
    assert torch.equal(got, weights["a"].float()[1:2, 0:2, 1:4])
    assert torch.equal(V.region_of(source, "a", (2, 3, 4), ((0, 2), (2, 3), (3, 4))),
                       weights["a"].float()[:, 2:3, 3:4])
    with pytest.raises(AssertionError, match=r"\('a', \(2, 3, 4\), \(2, 12\)\)"):
        source.region("a", (2, 12), ((0, 1), (0, 1)))
    # a seed is the generator's
    assert torch.equal(V.region_of(4, "a", (2, 3, 4), ((0, 1), (0, 3), (0, 4))),
                       V.region_values(4, "a", (2, 3, 4), ((0, 1), (0, 3), (0, 4))))


def test_fill_from_a_users_weights(checkpoint_read, tmp_path, monkeypatch):
    weights, _ = checkpoint_read
    monkeypatch.setattr(V, "CHUNK", 3)
    out = torch.empty(2, 2, 2)
    V.fill(out, V.WeightValues(tmp_path, TOY), "a", (2, 3, 4), ((0, 2), (1, 3), (2, 4)))
    assert torch.equal(out, weights["a"].float()[:, 1:3, 2:4])


def test_weight_values_travel_as_their_directory_and_config(checkpoint_read, tmp_path):
    _, reads = checkpoint_read
    source = V.WeightValues(tmp_path, TOY)
    source.parameter("a")
    assert source.__getstate__() == {"directory": str(tmp_path), "config": TOY}
    copy = pickle.loads(pickle.dumps(source))
    assert (copy.directory, copy.config) == (str(tmp_path), TOY)
    assert copy._open is None and copy._last is None  # opened again where it lands
    assert repr(copy) == f"WeightValues({str(tmp_path)!r})"
    copy.parameter("b")
    assert reads[-2:] == [("open", str(tmp_path), "toy"), "b"]
