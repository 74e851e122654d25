"""The forward as one step per parameter (``ReferenceModel.step``, ``ShardedModel.step``):
what a streamed check advances, one parameter's tensors at a time. That stepping gives the
whole-model forward's logits bit for bit is shown by the streamed checks' tests
(tests/check/test_stream.py); here, the order the steps read and the refusal of a name no
step reads."""

import pytest

from weight_sync_bench import TOY
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel

SMALL = TOY.replace(name="steps", vocab=64, d_model=32, n_layers=2, ffn=48, n_heads=4,
                    n_kv_heads=2)


@pytest.mark.parametrize("flags", [{}, {"bias": True}, {"qkv_bias": True, "o_bias": True},
                                   {"tie_embeddings": True}])
def test_the_steps_read_the_parameters_in_draw_order(flags):
    config = SMALL.replace(**flags)
    names = ["tok_embeddings.weight",
             *(f"layers.{i}.{s}" for i in range(config.n_layers) for s in config.layer_suffixes),
             *config.head_params]
    assert names == list(config.param_shapes())


class _Reads(dict):
    """Parameters that record which are read."""

    def __init__(self, params, log):
        super().__init__(params)
        self.log = log

    def __getitem__(self, name):
        self.log.append(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("flags", [{"bias": True}, {"tie_embeddings": True}])
def test_each_step_reads_its_own_parameter_and_nothing_drawn_after_it(flags):
    config = SMALL.replace(**flags)
    params = init_params(config, 0)
    log: list[str] = []
    model = ReferenceModel(config, _Reads(params, log))
    state = model.begin(make_tokens(config, 1))
    order = list(config.param_shapes())
    for k, name in enumerate(order[1:], start=1):
        log.clear()
        model.step(state, name)
        later = [n for n in log if order.index(n) > k]
        assert name in log and not later, (name, log)
    assert model.finish(state).shape[-1] == config.vocab


def test_a_name_no_step_reads_is_refused_by_name():
    config = SMALL
    params = init_params(config, 0)
    tokens = make_tokens(config, 1)
    reference = ReferenceModel(config, params)
    with pytest.raises(KeyError, match="no forward step reads 'layers.0.gate.weight'"):
        reference.step(reference.begin(tokens), "layers.0.gate.weight")
    sharded = ShardedModel(config, [params], InProcessCollective(1))
    with pytest.raises(KeyError, match="no forward step reads 'head.weight'"):
        sharded.step(sharded.begin(tokens), "head.weight")
