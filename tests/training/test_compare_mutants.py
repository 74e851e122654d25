"""The training comparison's verdict arithmetic on hand-made traces (``training.compare``):
what a NaN, a zero scale, an empty tensor, a missing hyperparameter or a gradient on a
padded vocab row reads as, which rows the K/V comparison takes, where each deviation says
it is worst, and the blockwise kernels on lengths that are not whole blocks and on dtypes
other than fp32. Each case is one a slip in that arithmetic would pass (mutation testing,
mutation/report.md); each has its twin, the same comparison reading a correct run as 0."""

import math
from types import SimpleNamespace

import pytest
import torch

from weight_sync_bench.training.compare import (
    BLOCK,
    Comparison,
    Trace,
    TrainingReport,
    deviation,
    deviations,
    gradient_deviations,
    max_abs_difference,
    max_abs_difference_in_dtype,
    moment_deviations,
    parameter_deviations,
    relative_difference,
    update_deviation,
)
from weight_sync_bench.training.compare import _norms_of_differences

pytestmark = pytest.mark.usefixtures("comparison_path")
INF = float("inf")
# gradient_deviations reads these two of a config: the rows of Q in a fused qkv (K and V
# follow) and the logical vocabulary (rows at and above it are padding)
CONFIG = SimpleNamespace(q_rows=4, vocab=6)
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.0}


def trace(**changes) -> Trace:
    """A correct run's trace over three parameters: a fused qkv (4 Q rows, then K and V), a
    padded embedding and lm_head (8 rows, 6 logical), two steps."""
    g = torch.Generator().manual_seed(0)
    grads = {"layers.0.qkv.weight": torch.randn(8, 3, generator=g),
             "tok_embeddings.weight": torch.cat([torch.randn(6, 3, generator=g),
                                                 torch.zeros(2, 3)]),
             "lm_head.weight": torch.cat([torch.randn(6, 3, generator=g), torch.zeros(2, 3)])}
    params = [{n: torch.randn(x.shape, generator=g) for n, x in grads.items()}
              for _ in range(2)]
    fields = dict(losses=[2.5, 2.4], input_grad=torch.randn(2, 4, 3, generator=g),
                  grads=grads, params=params,
                  exp_avg=[{n: 0.1 * x for n, x in grads.items()} for _ in range(2)],
                  exp_avg_sq=[{n: 0.01 * x * x for n, x in grads.items()} for _ in range(2)],
                  hyperparameters=[dict(HYPER)])
    fields.update(changes)
    return Trace(**fields)


def copy(t: Trace, **changes) -> Trace:
    """``t`` with fresh copies of every tensor, then ``changes``."""
    clone = {n: x.clone() for n, x in t.grads.items()}
    fields = dict(losses=list(t.losses), input_grad=t.input_grad.clone(), grads=clone,
                  params=[{n: x.clone() for n, x in p.items()} for p in t.params],
                  exp_avg=[{n: x.clone() for n, x in p.items()} for p in t.exp_avg],
                  exp_avg_sq=[{n: x.clone() for n, x in p.items()} for p in t.exp_avg_sq],
                  hyperparameters=[dict(h) for h in t.hyperparameters],
                  replica_spread=t.replica_spread)
    fields.update(changes)
    return Trace(**fields)


START = {n: torch.zeros(x.shape) for n, x in trace().grads.items()}


def test_deviation_reads_nan_as_infinite_a_zero_scale_as_equality_and_empty_as_zero():
    a = torch.tensor([1.0, 2.0])
    assert deviation(a, a.clone(), 2.0) == 0.0  # the twin: equal reads 0
    assert deviation(torch.tensor([1.0, 2.5]), a, 2.0) == 0.25
    assert deviation(torch.tensor([1.0, math.nan]), a, 2.0) == INF
    assert deviation(torch.tensor([1.0, math.nan]), a, 0.0) == INF
    assert deviation(a, a.clone(), 0.0) == 0.0
    assert deviation(torch.tensor([1.0, 2.0 + 2 ** -22]), a, 0.0) == INF
    assert deviation(torch.empty(0), torch.empty(0), 1.0) == 0.0
    assert deviation(torch.empty(0), torch.empty(0), 0.0) == 0.0
    assert deviation(torch.tensor([1.0, 2.5]), a, 1.0) == 0.5  # scale 1 is a scale, not 0


def test_a_correct_trace_deviates_by_nothing_anywhere_and_each_says_where():
    ref = trace()
    out = deviations(CONFIG, START, ref, copy(ref))
    assert {q: d for q, (d, _) in out.items()} == dict.fromkeys(out, 0.0)
    assert set(out) == {"loss", "input_grad", "param_grad", "kv_grad", "replicas",
                        "padding_grad", "exp_avg", "exp_avg_sq", "hyperparameters",
                        "params_step1", "params_final"}
    # a whole-run quantity is nowhere in particular; a per-parameter one names its worst
    for quantity in ("loss", "input_grad", "replicas", "hyperparameters"):
        assert out[quantity][1] == "", quantity
    wrong = copy(ref, replica_spread=0.5)
    wrong.exp_avg[1]["lm_head.weight"][0, 0] += 1.0
    out = deviations(CONFIG, START, ref, wrong)
    assert out["replicas"] == (0.5, "")
    assert out["exp_avg"][1] == "lm_head.weight step 2"
    assert out["exp_avg"][0] > 0 and out["exp_avg_sq"][0] == 0.0
    wrong = copy(ref)
    wrong.exp_avg_sq[0]["layers.0.qkv.weight"][5, 1] *= 1.5
    assert deviations(CONFIG, START, ref, wrong)["exp_avg_sq"][1] == \
        "layers.0.qkv.weight step 1"


def test_kv_grad_takes_the_k_and_v_rows_of_a_fused_qkv_and_nothing_else():
    ref = trace()
    wrong = copy(ref)
    wrong.grads["layers.0.qkv.weight"][CONFIG.q_rows, 0] += 1.0  # the first K row
    out = gradient_deviations(CONFIG, ref, wrong)
    assert out["kv_grad"][0] > 0 and out["kv_grad"][1] == "layers.0.qkv.weight"
    q_only = copy(ref)  # the twin: a Q row is a parameter gradient, not a K/V one
    q_only.grads["layers.0.qkv.weight"][CONFIG.q_rows - 1, 0] += 1.0
    out = gradient_deviations(CONFIG, ref, q_only)
    assert out["kv_grad"][0] == 0.0 and out["param_grad"][0] > 0
    other = copy(ref)  # nor is any other parameter's
    other.grads["lm_head.weight"][0, 0] += 1.0
    out = gradient_deviations(CONFIG, ref, other)
    assert out["kv_grad"][0] == 0.0 and out["param_grad"] == (out["param_grad"][0],
                                                              "lm_head.weight")


@pytest.mark.parametrize("name", ["tok_embeddings.weight", "lm_head.weight"])
@pytest.mark.parametrize("value", [1e-30, math.nan])
def test_a_gradient_on_a_padded_row_of_either_table_fails_exactly_nan_included(name, value):
    ref = trace()
    wrong = copy(ref)
    wrong.grads[name][CONFIG.vocab + 1, 2] = value
    assert gradient_deviations(CONFIG, ref, wrong)["padding_grad"] == \
        ((float(torch.tensor(1e-30)) if value == value else INF), name)  # fp32 1e-30
    assert gradient_deviations(CONFIG, ref, copy(ref))["padding_grad"][0] == 0.0  # the twin


def test_the_loss_and_the_input_gradient_are_relative_to_the_references_scale():
    ref = trace()
    out = gradient_deviations(CONFIG, ref, copy(ref, losses=[2.0, 2.4]))
    assert out["loss"] == (0.5 / 2.5, "")
    grad = ref.input_grad.clone()
    grad.view(-1)[3] += 0.25
    out = gradient_deviations(CONFIG, ref, copy(ref, input_grad=grad))
    assert out["input_grad"] == (pytest.approx(0.25 / float(ref.input_grad.abs().max()),
                                               rel=1e-6), "")
    out = gradient_deviations(CONFIG, ref, copy(ref, losses=[math.nan, 2.4]))
    assert out["loss"][0] == INF


def test_hyperparameters_missing_changed_or_zero_are_compared_exactly():
    assert relative_difference(dict(HYPER), HYPER) == 0.0  # the twin
    assert relative_difference({**HYPER, "lr": 1.005e-3}, HYPER) == pytest.approx(0.005)
    missing = {k: v for k, v in HYPER.items() if k != "beta2"}
    assert relative_difference(missing, HYPER) == INF
    assert relative_difference({**HYPER, "weight_decay": 1e-9}, HYPER) == INF  # want 0
    assert relative_difference({**HYPER, "weight_decay": 0.0}, HYPER) == 0.0
    ref = trace()
    assert deviations(CONFIG, START, ref, copy(ref, hyperparameters=[]))["hyperparameters"] \
        == (INF, "")  # no optimizer stepped: not a pass
    two = copy(ref, hyperparameters=[dict(HYPER), {**HYPER, "lr": 2e-3}])
    assert deviations(CONFIG, START, ref, two)["hyperparameters"] == (1.0, "")


def test_the_parameters_after_the_first_and_the_last_step_are_each_compared():
    ref = trace()
    assert [d for d, _ in parameter_deviations(START, ref, copy(ref)).values()] == [0.0, 0.0]
    last = copy(ref)
    last.params[1]["tok_embeddings.weight"][0, 0] += 1.0
    out = parameter_deviations(START, ref, last)
    assert out["params_step1"][0] == 0.0
    assert out["params_final"][0] > 0 and out["params_final"][1] == "tok_embeddings.weight"
    two = ref.params
    three = trace(params=[*two, {n: x + 1 for n, x in two[1].items()}])
    wrong = copy(three)
    wrong.params[1]["lm_head.weight"][0, 0] += 1.0  # the middle step: neither first nor last
    out = parameter_deviations(START, three, wrong)
    assert out["params_step1"][0] == 0.0 and out["params_final"][0] == 0.0


def test_a_large_parameters_update_deviation_is_the_plain_fp64_norm_within_its_rounding():
    """Past one block the norms are summed a block at a time in a reused fp64 scratch: the
    fp64 expression, reordered (a few ulps)."""
    g = torch.Generator().manual_seed(3)
    n = 3 * BLOCK + 5
    start = {"w": torch.randn(n, generator=g)}
    want = {"w": start["w"] + 1e-3 * torch.randn(n, generator=g)}
    got = {"w": want["w"] + 1e-7 * torch.randn(n, generator=g)}
    ref = Trace(losses=[0.0], input_grad=torch.zeros(1), grads={}, params=[want])
    out = parameter_deviations(start, ref, Trace(losses=[0.0], input_grad=torch.zeros(1),
                                                 grads={}, params=[got]))
    plain = (float((got["w"].double() - want["w"].double()).norm())
             / float((want["w"].double() - start["w"].double()).norm()))
    assert out["params_step1"][1] == "w"
    assert out["params_step1"][0] == pytest.approx(plain, rel=1e-12, abs=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [2 * BLOCK + 7, 3 * BLOCK])
def test_blockwise_kernels_on_other_dtypes_and_partial_blocks_are_the_plain_expressions(dtype,
                                                                                        n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g).to(dtype)
    y = (x.double() + 1e-3 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    assert max_abs_difference_in_dtype(x, y) == float((x - y).abs().max())
    assert max_abs_difference(x, y) == float((x.double() - y.double()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("at", [0, BLOCK - 1, 2 * BLOCK + 6])
@pytest.mark.parametrize("by", [0.5, 1.0])
def test_a_single_difference_anywhere_is_found_by_the_blockwise_kernels(dtype, at, by):
    """The first element, the last of a block, the last of a partial final block; in each
    dtype's own path; a difference of exactly 1 as well as another."""
    x = torch.ones(2 * BLOCK + 7, dtype=dtype)
    y = x.clone()
    assert max_abs_difference(x, y) == 0.0 and max_abs_difference_in_dtype(x, y) == 0.0
    y[at] = 1.0 + by
    assert max_abs_difference(x, y) == by
    assert max_abs_difference_in_dtype(x, y) == by


def test_broadcast_and_mixed_dtypes_past_one_block_are_the_plain_expressions():
    g = torch.Generator().manual_seed(2)
    got, row = torch.randn(8, BLOCK // 4, generator=g), torch.randn(BLOCK // 4, generator=g)
    assert got.numel() > BLOCK  # past the one-block shortcut
    assert max_abs_difference(got, row) == float((got.double() - row.double()).abs().max())
    assert max_abs_difference_in_dtype(got, row) == float((got - row).abs().max())
    low = got.bfloat16()  # bf16 - fp32 computes in fp32: not in bf16's own blocks
    assert max_abs_difference_in_dtype(low, got) == float((low - got).abs().max())


def test_an_update_of_nothing_demands_equality_and_nan_reads_as_infinite():
    """A parameter the reference did not move (want == start): any change is infinitely
    many updates; none is 0. NaN anywhere is infinite too."""
    start = torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(4))
    assert update_deviation(start.clone(), start.clone(), start) == 0.0  # the twin
    moved = start.clone()
    moved[BLOCK + 1] += 1e-3
    assert update_deviation(moved, start.clone(), start) == INF
    nan = start.clone()
    nan[7] = math.nan
    assert update_deviation(nan, moved, start) == INF
    assert update_deviation(moved, moved.clone(), start) == 0.0


def test_a_scratch_too_small_for_a_block_is_not_used(comparison_path):
    g = torch.Generator().manual_seed(5)
    start = torch.randn(3 * BLOCK, generator=g)
    want = start + 1e-3 * torch.randn(3 * BLOCK, generator=g)
    got = want + 1e-6 * torch.randn(3 * BLOCK, generator=g)
    plain = (float((got.double() - want.double()).norm())
             / float((want.double() - start.double()).norm()))
    small = torch.full((2 * BLOCK - 1,), 7.0, dtype=torch.float64)
    assert update_deviation(got, want, start, small) == pytest.approx(plain, rel=1e-12, abs=0)
    assert torch.all(small == 7.0)  # never written: two blocks would not fit
    enough = torch.full((2 * BLOCK,), 7.0, dtype=torch.float64)
    assert update_deviation(got, want, start, enough) == pytest.approx(plain, rel=1e-12, abs=0)
    if comparison_path == "torch":  # the kernels need no scratch
        assert not torch.all(enough == 7.0)  # the twin: written, block by block


def test_a_report_looks_up_a_quantity_by_name_and_names_one_it_lacks():
    c = Comparison("loss", 0.0, 1e-5)
    report = TrainingReport(config="toy", mesh=None, steps=1, packed=False,  # type: ignore[arg-type]
                            comparisons=(c,))
    assert report["loss"] is c
    with pytest.raises(KeyError) as raised:
        report["kv_grad"]
    assert raised.value.args == ("kv_grad",)


def test_moments_compare_every_step_of_each_quantity():
    ref = trace()
    assert all(d == 0.0 for d, _ in moment_deviations(ref, copy(ref)).values())
    wrong = copy(ref)
    wrong.exp_avg_sq[1]["tok_embeddings.weight"][2, 2] *= -1
    out = moment_deviations(ref, wrong)
    assert out["exp_avg"][0] == 0.0
    assert out["exp_avg_sq"][1] == "tok_embeddings.weight step 2"


def test_the_update_norms_sum_over_every_piece():
    """Three pieces of a parameter (a shard's, one past a block, one short): an error in the
    last one counts, as in the first."""
    g = torch.Generator().manual_seed(9)
    pieces = [(torch.randn(n, generator=g), torch.randn(n, generator=g),
               torch.randn(n, generator=g)) for n in (300, BLOCK + 5, 77)]
    expected = [math.sqrt(sum(float(((x.double() - y.double()) ** 2).sum())
                              for x, y in pairs))
                for pairs in ([(a, b) for a, b, _ in pieces], [(b, c) for _, b, c in pieces])]
    scratch = torch.empty(2 * BLOCK, dtype=torch.float64)
    assert _norms_of_differences(pieces, scratch) == pytest.approx(expected, rel=1e-12, abs=0)
    assert _norms_of_differences(pieces[:1], scratch) != pytest.approx(expected, rel=1e-3)
