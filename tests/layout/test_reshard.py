import pytest
import torch

from weight_sync_bench import (
    TOY,
    TOY_KV4,
    InvalidShards,
    gather,
    layout_for,
    reshard,
    split,
)
from weight_sync_bench.model.config import init_params


def _arange_params(config):
    """Every element distinct (DCP's resharding tests use arange data the same way)."""
    out, start = {}, 0
    for name, shape in config.param_shapes().items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape)
        start += n
    return out


def _bytes_equal(a, b):
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and a[n].numpy().tobytes() == b[n].numpy().tobytes() for n in a)


@pytest.fixture(scope="module", params=[TOY, TOY_KV4], ids=lambda c: c.name)
def model(request):
    return request.param, init_params(request.param, 0)


def test_gather_of_split_is_the_input_byte_for_byte(model):
    config, full = model
    layout = layout_for(config)
    for t in layout.supported_degrees():
        assert _bytes_equal(gather(split(full, layout, t), layout), full), t


def test_reshard_equals_the_destination_split_for_every_ordered_pair(model):
    config, full = model
    layout = layout_for(config)
    degrees = layout.supported_degrees()
    splits = {t: split(full, layout, t) for t in degrees}
    for src in degrees:
        for dst in degrees:
            out = reshard(splits[src], layout, dst)
            assert len(out) == dst
            assert all(_bytes_equal(o, e) for o, e in zip(out, splits[dst])), (src, dst)


def test_qkv_shard_is_rows_of_the_three_ranges_not_a_contiguous_block():
    full = _arange_params(TOY)
    qkv = full["layers.0.qkv.weight"]
    rank0 = split(full, layout_for(TOY), 2)[0]["layers.0.qkv.weight"]
    assert torch.equal(rank0, torch.cat([qkv[0:128], qkv[256:288], qkv[320:352]]))
    # the naive contiguous slice has the same shape: only the rows tell them apart
    assert rank0.shape == qkv.chunk(2)[0].shape and not torch.equal(rank0, qkv.chunk(2)[0])


def test_gate_up_shard_pairs_gate_rows_with_the_matching_up_rows():
    full = _arange_params(TOY_KV4)
    gu = full["layers.1.gate_up.weight"]
    rank3 = split(full, layout_for(TOY_KV4), 4)[3]["layers.1.gate_up.weight"]
    assert torch.equal(rank3, torch.cat([gu[528:704], gu[1232:1408]]))


def test_shards_never_alias_the_full_tensor_or_each_other():
    full = _arange_params(TOY_KV4)
    shards = split(full, layout_for(TOY_KV4), 2)
    shards[1]["norm.weight"].zero_()
    shards[0]["layers.0.o_proj.weight"].zero_()
    assert full["norm.weight"].abs().sum() > 0 and shards[0]["norm.weight"].abs().sum() > 0
    assert full["layers.0.o_proj.weight"].abs().sum() > 0


def test_gather_names_the_rank_and_parameter_of_a_wrong_shape():
    layout = layout_for(TOY_KV4)
    shards = split(_arange_params(TOY_KV4), layout, 2)
    shards[1]["layers.2.down.weight"] = shards[1]["layers.2.down.weight"][:, :-1]
    with pytest.raises(InvalidShards, match=r"rank 1 layers\.2\.down\.weight: shape \[256, 351\], "
                                            r"expected \[256, 352\] at t=2"):
        gather(shards, layout)


def test_split_names_missing_and_unexpected_parameters():
    layout = layout_for(TOY)
    full = _arange_params(TOY)
    full["extra.weight"] = full.pop("norm.weight")
    with pytest.raises(InvalidShards, match="full params: missing norm.weight; unexpected extra.weight"):
        split(full, layout, 2)
