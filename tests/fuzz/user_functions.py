"""A user's own splitters, resharders and converters, written as a user would (plain torch,
the geometry from ``config``), one correct of each role and four with a geometry-specific
bug planted. Every planted one is right on TOY and TOY_KV4 at every degree they support
(``check_split`` / ``check_reshard`` pass), and wrong elsewhere:

- ``split_kv_at_least_two``: the KV-head count hard-coded to 2 wherever the model has fewer
  (written for GQA with 2+ KV heads, it reads an MQA model's one KV head as 2);
- ``split_head_dim_from_d_model``: the head size computed as ``d_model // n_heads`` (true of
  TOY, 256 = 8 x 32; not of Mistral-Nemo, 5120 / 32 = 160 != 128);
- ``reshard_wrong_for_mha``: right for GQA only: an MHA model's fused qkv is taken to be
  per-head interleaved ``[q_h, k_h, v_h]`` (GPT-NeoX's fused layout), as some loaders do;
- ``reshard_vocab_tiles_of_64``: copies the vocab-parallel tables in tiles of 64 rows and
  drops (leaves zero) the last rows where a rank's rows are not a multiple of 64.

The layout (``wsb layout``): vocab tables ``S(0)``; the fused qkv per rank
``[q_r | k_r | v_r]``; ``o_proj`` and ``down`` ``S(1)``; the fused gate_up per rank
``[gate_r | up_r]``; norms and row-parallel biases replicated.
"""

from __future__ import annotations

import torch

from weight_sync_bench import Unsupported, convert


def _kind(name: str) -> str:
    """``layers.0.qkv.weight`` -> ``qkv.weight``."""
    return ".".join(name.split(".")[-2:])


def _qkv(w: torch.Tensor, degree: int, q_rows: int, kv_rows: int,
         interleaved_heads: int = 0, head_dim: int = 0) -> list[torch.Tensor]:
    """The fused qkv (or its bias) cut per rank as ``[q_r | k_r | v_r]``; ``interleaved_heads``:
    the rows read as per-head ``[q_h, k_h, v_h]`` first (the MHA bug)."""
    if interleaved_heads:
        per = w.reshape(interleaved_heads, 3, head_dim, *w.shape[1:])  # (H, 3, hd, ...)
        q, k, v = (per[:, i].reshape(interleaved_heads * head_dim, *w.shape[1:]) for i in range(3))
    else:
        q, k, v = w[:q_rows], w[q_rows:q_rows + kv_rows], w[q_rows + kv_rows:]
    return [torch.cat([q.chunk(degree)[r], k.chunk(degree)[r], v.chunk(degree)[r]]).clone()
            for r in range(degree)]


def _split(full, degree, config, *, n_kv_heads=None, head_dim=None, mha_interleaved=False,
           vocab_tile=0):
    n_kv = n_kv_heads if n_kv_heads is not None else config.n_kv_heads
    hd = head_dim if head_dim is not None else config.head_dim
    q_rows = config.n_heads * hd
    kv_rows = (full["layers.0.qkv.weight"].shape[0] - q_rows) // 2 if n_kv_heads is None \
        else n_kv * hd
    if n_kv_heads is not None:
        q_rows = full["layers.0.qkv.weight"].shape[0] - 2 * kv_rows  # the tensor's rows add up
    interleaved = config.n_heads if mha_interleaved and config.n_heads == config.n_kv_heads else 0
    shards = [{} for _ in range(degree)]
    for name, w in full.items():
        kind = _kind(name)
        if kind in ("qkv.weight", "qkv.bias"):
            pieces = _qkv(w, degree, q_rows, kv_rows, interleaved, config.head_dim)
        elif kind == "gate_up.weight":
            gate, up = w.chunk(2)
            pieces = [torch.cat([gate.chunk(degree)[r], up.chunk(degree)[r]]) for r in range(degree)]
        elif kind in ("o_proj.weight", "down.weight"):
            pieces = list(w.chunk(degree, dim=1))
        elif name in ("tok_embeddings.weight", "lm_head.weight"):
            pieces = list(w.chunk(degree))
            if vocab_tile:
                pieces = [_tiles(p, vocab_tile) for p in pieces]
        else:  # norms and row-parallel biases
            pieces = [w] * degree
        for rank, piece in enumerate(pieces):
            shards[rank][name] = piece.clone()
    return shards


def _tiles(rows: torch.Tensor, tile: int) -> torch.Tensor:
    """``rows`` copied ``tile`` rows at a time: a tail shorter than a tile is left zero."""
    out = torch.zeros_like(rows)
    whole = rows.shape[0] // tile * tile
    out[:whole] = rows[:whole]
    return out


def _gather(shards, config):
    """The full model back from rank shards (the inverse of ``_split`` done right)."""
    degree, full = len(shards), {}
    q_rows, kv_rows = config.q_rows, config.kv_rows
    for name in shards[0]:
        parts = [s[name] for s in shards]
        kind = _kind(name)
        if kind in ("qkv.weight", "qkv.bias"):
            qr, kvr = q_rows // degree, kv_rows // degree
            full[name] = torch.cat([torch.cat([p[:qr] for p in parts]),
                                    torch.cat([p[qr:qr + kvr] for p in parts]),
                                    torch.cat([p[qr + kvr:] for p in parts])])
        elif kind == "gate_up.weight":
            halves = [p.chunk(2) for p in parts]
            full[name] = torch.cat([torch.cat([g for g, _ in halves]),
                                    torch.cat([u for _, u in halves])])
        elif kind in ("o_proj.weight", "down.weight"):
            full[name] = torch.cat(parts, dim=1)
        elif name in ("tok_embeddings.weight", "lm_head.weight"):
            full[name] = torch.cat(parts)
        else:
            full[name] = parts[0]
    return full


# -- splitters: fn(full, degree, *, config)


def split_correct(full, degree, *, config):
    return _split(full, degree, config)


def split_kv_at_least_two(full, degree, *, config):
    return _split(full, degree, config, n_kv_heads=max(config.n_kv_heads, 2))


def split_head_dim_from_d_model(full, degree, *, config):
    return _split(full, degree, config, head_dim=config.d_model // config.n_heads)


# -- resharders: fn(shards, dst, *, config)


def reshard_correct(shards, dst, *, config):
    return _split(_gather(shards, config), dst, config)


def reshard_wrong_for_mha(shards, dst, *, config):
    return _split(_gather(shards, config), dst, config, mha_interleaved=True)


def reshard_vocab_tiles_of_64(shards, dst, *, config):
    return _split(_gather(shards, config), dst, config, vocab_tile=64)


def reshard_declines_odd_vocab(shards, dst, *, config):
    """Correct, and declares what it does not support: odd vocabularies."""
    if config.vocab % 2:
        raise Unsupported(f"only even vocabularies (vocab={config.vocab})")
    return reshard_correct(shards, dst, config=config)


def reshard_declines_everything(shards, dst, *, config):
    raise Unsupported("not written yet")


def reshard_without_config(shards, dst):
    """A resharder that needs no geometry: right only where there is nothing to move."""
    if len(shards) != dst:
        raise ValueError(f"cannot reshard {len(shards)} -> {dst}")
    return [dict(s) for s in shards]


# -- converters: fn(shards, degree, *, config, hf_config)


def convert_megatron_to_vllm(shards, degree, *, config, hf_config):
    """Through the harness's own converter (``conventions.convert``), reading the head
    counts from ``hf_config`` as a real converter reads ``config.json``."""
    assert hf_config["num_key_value_heads"] == config.n_kv_heads
    return convert(shards, "megatron", f"vllm:{degree}", config)


def convert_megatron_to_vllm_head_dim_from_hidden(shards, degree, *, config, hf_config):
    """``head_dim`` taken as ``hidden_size // num_attention_heads`` (HF's default when the
    file has no ``head_dim``), not the file's ``head_dim``."""
    head_dim = hf_config["hidden_size"] // hf_config["num_attention_heads"]
    out = convert(shards, "megatron", f"vllm:{degree}", config)
    if head_dim != config.head_dim:  # its rows are cut by the wrong head size
        for rank in out:
            for name, w in rank.items():
                if name.endswith("qkv_proj.weight"):
                    rank[name] = w.roll(head_dim, dims=0)
    return out


# -- converters from Megatron's pipeline stages: fn(shards, degree, *, config, source)


def _globalised(shards, config, source, *, offsets=True):
    """Each TP rank's tensors from every stage under GLOBAL layer names, as a TP-only
    Megatron rank: stage ranks' local ``[model{v}.]decoder.layers.{j}`` renamed to
    ``decoder.layers.{layers[v][j]}`` (``rank_coordinates``); ``offsets=False`` keeps j."""
    import re

    from weight_sync_bench.conventions import rank_coordinates

    flat = [{} for _ in range(source.degree)]
    for rank, held in enumerate(shards):
        at = rank_coordinates(config, source, rank)
        for name, x in held.items():
            chunk, _, rest = (name.partition(".") if name.startswith("model") and
                              source.vpp > 1 else ("model0", ".", name))
            v = int(chunk[len("model"):])
            found = re.match(r"decoder\.layers\.(\d+)\.(.*)", rest)
            if found:
                j = int(found.group(1))
                layer = at.layers[v][j] if offsets else j
                rest = f"decoder.layers.{layer}.{found.group(2)}"
            elif rest == "output_layer.weight" and config.tie_embeddings:
                continue  # the last stage's tied copy: the embedding is the first stage's
            flat[at.tp].setdefault(rest, x)  # the first stage to write a name wins
    return flat


def convert_staged_megatron_to_hf(shards, degree, *, config, source):
    """Megatron TP x PP -> HF: every stage's layers renamed to their global indices with the
    source's rank coordinates, then converted as TP-only Megatron shards."""
    flat = _globalised(shards, config, source)
    return convert(flat, f"megatron:{source.degree}", "hf", config)


def convert_staged_local_as_global(shards, degree, *, config, source):
    """The bug of NeMo-RL PR #3259: each stage publishes its layers under their LOCAL
    indices, the first stage's copy of each name winning: the later layers are never sent."""
    import re

    from weight_sync_bench.conventions import rank_coordinates

    full = convert_staged_megatron_to_hf(shards, degree, config=config, source=source)[0]
    local = {layer: j for rank in range(len(shards))
             for chunk in rank_coordinates(config, source, rank).layers
             for j, layer in enumerate(chunk)}
    out = {}
    for name, x in full.items():  # global layers in order: the first stage's come first
        found = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if found:
            name = f"model.layers.{local[int(found.group(1))]}.{found.group(2)}"
        out.setdefault(name, x)
    return [out]


# -- converters into FP8 destinations (``vllm:fp8=block128``, ``vllm:fp8=tensor``)


def convert_to_fp8(shards, degree, *, config, source, target):
    """A correct quantizing converter: the canonical weights gathered, then the
    destination's FP8 tensors as the reference quantizer makes them (whole HF tensors)."""
    from weight_sync_bench.conventions.fp8 import fp8_shards
    from weight_sync_bench.conventions.maps import gather_canonical

    return fp8_shards(config, target, gather_canonical(shards, source.pieces(config),
                                                       config.param_shapes()))


def convert_to_fp8_per_shard(shards, degree, *, config, source, target):
    """Quantizes after the TP cut: each rank's o_proj and down_proj (one HF tensor each) on
    its own. Per block, at the degrees vLLM accepts (every cut on a block edge), the same
    bytes; per tensor, another amax per shard at TP > 1."""
    from weight_sync_bench import convert
    from weight_sync_bench.conventions.fp8 import SCALE_SUFFIXES, quantize, scheme_of

    scheme = scheme_of(target)
    out = convert_to_fp8(shards, degree, config=config, source=source, target=target)
    for rank, own in zip(out, convert(shards, source, target.unquantized(), config)):
        for name in [n for n in rank if n.endswith(("o_proj.weight", "down_proj.weight"))]:
            rank[name], rank[name + SCALE_SUFFIXES[scheme]] = quantize(own[name], scheme)
    return out


def convert_to_fp8_unclamped(shards, degree, *, config, source, target):
    """THUDM/slime before PR #2256 on a block that is all zeros: scale 0, weights 0 / 0.
    Trainers' weights have such blocks only where a layer was zeroed, so this converter
    plants the zero block itself (the first 128 x 128 of every o_proj it writes)."""
    import torch

    from weight_sync_bench.conventions.fp8 import SCALE_SUFFIXES, scheme_of

    out = convert_to_fp8(shards, degree, config=config, source=source, target=target)
    suffix = SCALE_SUFFIXES[scheme_of(target)]
    for rank in out:
        for name in [n for n in rank if n.endswith("o_proj.weight")]:
            rank[name + suffix].view(-1)[0] = 0.0
            rank[name].view(torch.uint8)[:128, :128] = 0x7F  # e4m3fn NaN
    return out
