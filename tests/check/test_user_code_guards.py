"""What the harness hands a user's function comes back unchanged, and a deadline bounds the
call (``check.user_code.call``, the one place user code is called): a converter that zeroes
its input shards in place, a splitter that scales the full model, a resharder that replaces
or drops a tensor of the dicts it was given each fail (exit 4), naming the rank and the
tensor; a function that sleeps past ``--deadline`` fails with its stack. Each has its twin:
the same function without the harm passes, and without a deadline nothing is bounded."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

from weight_sync_bench import check_convert
from weight_sync_bench.check.checker import check_reshard, check_split
from weight_sync_bench.check.user_code import call, deadline, fingerprint
from weight_sync_bench.cli import main
from weight_sync_bench.conventions import convert
from weight_sync_bench.errors import ModifiedInput, UserCodeTimeout
from weight_sync_bench.layout.reshard import reshard, split
from weight_sync_bench.model.config import TOY
from weight_sync_bench.model.plan import layout_for

# TOY over a 512-word vocabulary (a fifth of the bytes to draw, copy and fingerprint: the
# guards do not depend on the vocabulary), judged by an explicit threshold, 100x what its
# declared shards deviate by (1e-6): no floor is committed for it. The command line (exit 4)
# checks TOY itself.
NARROW = TOY.replace(name="toy_vocab512", vocab=512)
THRESHOLD = 1e-4
LAYOUT = layout_for(NARROW)
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def zeroing_converter(shards, degree, config=None):
    out = convert(shards, "megatron", f"vllm:{degree}", config)
    shards[0][QKV].zero_()  # after converting: the output is right, the input destroyed
    return out


def honest_converter(shards, degree, config=None):
    return convert(shards, "megatron", f"vllm:{degree}", config)


def test_a_converter_that_zeroes_its_input_in_place_fails_naming_the_tensor():
    with pytest.raises(ModifiedInput, match=f"modified in place source rank 0 `{QKV}`") as info:
        check_convert(zeroing_converter, NARROW, "megatron:2", "vllm:2",
                      threshold=THRESHOLD)
    assert (info.value.rank, info.value.name, info.value.role) == (0, QKV, "converter")
    assert "destroys the trainer's weights" in str(info.value)


def test_twin_the_honest_converter_passes():
    assert check_convert(honest_converter, NARROW, "megatron:2", "vllm:2",
                         threshold=THRESHOLD).passed


def test_a_splitter_that_scales_the_full_model_fails_naming_the_tensor():
    def scaling(full, degree):
        out = split(full, LAYOUT, degree)
        full["norm.weight"].mul_(2.0)
        return out

    with pytest.raises(ModifiedInput, match="modified in place `norm.weight`") as info:
        check_split(scaling, NARROW, 2, threshold=THRESHOLD)
    assert info.value.rank is None
    assert check_split(lambda full, degree: split(full, LAYOUT, degree), NARROW, 2,
                       threshold=THRESHOLD).passed  # the twin


@pytest.mark.parametrize("harm", ["replaced", "removed", "resized or re-strided in place"])
def test_a_resharder_that_changes_the_dicts_it_was_given_fails(harm):
    def harmful(shards, dst):
        out = reshard(shards, LAYOUT, dst)
        if harm == "replaced":
            shards[1]["norm.weight"] = shards[1]["norm.weight"].clone()
        elif harm == "removed":
            del shards[1]["norm.weight"]
        else:
            shards[1]["norm.weight"].resize_(0)
        return out

    with pytest.raises(ModifiedInput, match=f"{harm} source rank 1 `norm.weight`"):
        check_reshard(harmful, NARROW, 2, 1, threshold=THRESHOLD)


def test_every_dtype_and_shape_is_fingerprinted_by_its_bytes():
    tensors = {"bf16": torch.randn(3, 5).bfloat16(), "scalar": torch.tensor(1.5),
               "empty": torch.zeros(0, 4), "view": torch.randn(6, 6)[:, ::2],
               "int": torch.arange(7)}
    args = ([dict(tensors)], 2)
    before = fingerprint(args)
    assert before.changed(args) is None  # the twin: nothing changed
    for name in ("bf16", "scalar", "view", "int"):
        x = args[0][0][name]
        keep = x.clone()
        x.view(-1)[0:1].add_(1) if x.is_contiguous() else x[0, 0].add_(1)
        assert before.changed(args) == (0, name, "modified in place")
        x.copy_(keep)
        assert before.changed(args) is None
    args[0][0]["bf16"].view(torch.int16).bitwise_xor_(1)  # one low bit of each element
    assert before.changed(args) == (0, "bf16", "modified in place")


@pytest.mark.parametrize("write", ["-0.0 for +0.0", "another NaN payload"])
def test_a_change_that_keeps_every_value_equal_is_still_a_modification(write):
    """The guard compares bytes, not values: -0.0 == +0.0 and NaN payloads compare alike
    (or not at all) as values, yet a converter writing them changed the trainer's weights."""
    x = torch.zeros(64)
    x[7] = float("nan")
    args = ({"w": x},)
    before = fingerprint(args)
    assert before.changed(args) is None  # the twin
    if write.startswith("-0.0"):
        x[3] = -0.0
        assert torch.equal(x[3:4], torch.zeros(1))  # equal as values
    else:
        x.view(torch.int32)[7] ^= 1  # still a NaN
        assert x[7].isnan()
    assert before.changed(args) == (None, "w", "modified in place")


def sleeper(shards, dst):
    time.sleep(30)
    return reshard(shards, LAYOUT, dst)


def test_a_deadline_bounds_the_call_and_names_where_it_was():
    start = time.monotonic()
    with deadline(0.5), pytest.raises(UserCodeTimeout, match="did not return within 0.5 s") \
            as info:
        check_reshard(sleeper, NARROW, 2, 1, threshold=THRESHOLD)
    assert time.monotonic() - start < 25  # returned long before the sleep ended
    assert "time.sleep(30)" in (info.value.user_traceback or "")


def test_twin_without_a_deadline_nothing_is_bounded_and_a_fast_call_passes_under_one():
    with deadline(60):
        assert check_reshard(lambda s, d: reshard(s, LAYOUT, d), NARROW, 2, 1,
                             threshold=THRESHOLD).passed
        # what the function raises is still its own, framed as before
        with pytest.raises(Exception, match="raised ValueError while"):
            call(lambda s, d: (_ for _ in ()).throw(ValueError("x")), ([{}], 2),
                 role="resharder", during="while resharding")


def test_the_function_runs_with_the_callers_grad_mode_under_a_deadline():
    seen = []
    with deadline(60), torch.no_grad():
        call(lambda s, d: seen.append(torch.is_grad_enabled()), ([{}], 2), role="resharder",
             during="")
    assert seen == [False]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "guarded_mine.py").write_text(textwrap.dedent("""
        import time
        from weight_sync_bench import convert

        def zeroing(shards, degree, config=None):
            out = convert(shards, "megatron", f"vllm:{degree}", config)
            for rank in shards:
                for x in rank.values():
                    x.zero_()
            return out

        def slow(shards, degree, config=None):
            time.sleep(60)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_on_the_command_line_both_are_exit_4(user_module, capsys):
    route = ["--from", "megatron:2", "--to", "vllm:2", "--config", "toy"]
    assert main(["check", "--converter", "guarded_mine:zeroing", *route]) == 4
    assert "modified in place source rank 0" in capsys.readouterr().err
    assert main(["check", "--converter", "guarded_mine:slow", "--deadline", "1", *route]) == 4
    err = capsys.readouterr().err
    assert "did not return within 1 s (--deadline)" in err and "time.sleep(60)" in err
