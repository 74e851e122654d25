"""``check_convert`` at its seams (issue 30, the mutation pass over ``check/convert.py``): which
of its paths a call takes (FP8, real weights, streamed, whole), what each is handed, and what
is refused before the user's code runs, saying what to drop. The paths stand in here
(``check_fp8_convert``, ``stream_convert``, ``conversion_checker``, ``call``): what they
compute is ``test_convert.py``'s, ``test_convert_weights.py``'s, ``test_fp8_convert.py``'s
and ``test_stream_views.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.check import convert
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.errors import InvalidNumber, UnsupportedLayout
from weight_sync_bench.model.config import init_params

CONFIG = tiny(2, n_layers=1)


def fn(shards, degree):
    return shards


def progress(p):
    return None


class Checker:
    """``ConversionChecker`` standing in: records what it is asked."""

    def __init__(self, asked, kwargs):
        self.asked, self.kwargs = asked, kwargs
        self.checker = SimpleNamespace(notes=("floor",))
        asked.append(("checker", kwargs))

    def require(self, target):
        self.asked.append(("require", target))

    def source(self, source):
        self.asked.append(("source", source))
        return f"<{source} shards>"

    def verdict(self, out, *, src, dst):
        self.asked.append(("verdict", out, src, dst))
        return "verdict"


@pytest.fixture
def paths(monkeypatch):
    asked: list = []
    monkeypatch.setattr(convert, "check_fp8_convert",
                        lambda *a, **k: asked.append(("fp8", a, k)) or "fp8 verdict")
    monkeypatch.setattr(convert, "stream_convert",
                        lambda *a, **k: asked.append(("stream", a, k)) or "streamed verdict")
    monkeypatch.setattr(convert, "conversion_checker",
                        lambda config, **k: Checker(asked, {"config": config, **k}))

    def call(f, args, **k):
        asked.append(("call", f, args, k))
        return "<converted>"
    monkeypatch.setattr(convert, "call", call)
    return asked


def test_a_whole_check_asks_the_checker_for_the_floor_then_calls_fn_once_then_judges(paths):
    src, dst = endpoint("megatron:2"), endpoint("vllm:1")
    assert convert.check_convert(fn, CONFIG, "megatron:2", "vllm:1", seed=3, backend="gloo",
                                 threshold=0.5, dtype="bf16", measure_floor=True) == "verdict"
    assert paths == [
        ("checker", dict(config=CONFIG, seed=3, backend="gloo", threshold=0.5, dtype="bf16",
                         measure_floor=True)),
        ("require", dst), ("source", src),
        ("call", fn, (f"<{src} shards>", 1),
         dict(role="converter", config=CONFIG, ends=(src, dst),
              during=f"while converting {CONFIG.name} {src} -> {dst}")),
        ("verdict", "<converted>", src, dst)]


def test_a_whole_check_defaults_to_seed_0_in_process_fp32_with_the_committed_floor(paths):
    convert.check_convert(fn, CONFIG, "hf", "megatron:2")
    assert paths[0] == ("checker", dict(config=CONFIG, seed=0, backend="inprocess",
                                        threshold=None, dtype=torch.float32,
                                        measure_floor=False))
    assert paths[3][2][1] == 2  # the destination's degree


def test_a_streamed_check_hands_stream_convert_everything_it_was_given(paths):
    src, dst = endpoint("megatron:2"), endpoint("vllm:2")
    assert convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", seed=4, threshold=0.25,
                                 dtype="fp16", measure_floor=True, stream="parameter",
                                 progress=progress) == "streamed verdict"
    assert paths == [("stream", (fn, CONFIG, src, dst),
                      dict(per="parameter", seed=4, dtype="fp16", threshold=0.25,
                           measure_floor=True, progress=progress))]


def test_a_streamed_check_over_gloo_is_refused_saying_why(paths):
    with pytest.raises(ValueError, match=r"^stream='layer' runs in process \(phase 1a\); "
                                         r"backend 'gloo' holds the whole model on rank 0$"):
        convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", stream="layer",
                              backend="gloo")
    assert not paths


def test_what_no_check_takes_is_refused_before_fn_runs(paths):
    with pytest.raises(InvalidNumber, match=r"^seed must be an int in 0\.\.2\^63-1, got -1$"):
        convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", seed=-1)
    for src, dst in (("megatron:3", "vllm:2"), ("megatron:2", "vllm:3"),
                     ("megatron:2", "vllm:tp=3,fp8=block128")):
        with pytest.raises(UnsupportedLayout):  # either end's rules, the FP8 one's too
            convert.check_convert(fn, CONFIG, src, dst)
    assert not paths


FP8 = "vllm:tp=2,fp8=block128"


def test_an_fp8_destination_is_checked_whole_on_the_seeds_weights_in_the_dtype(paths):
    src, dst = endpoint("megatron:2"), endpoint(FP8)
    assert convert.check_convert(fn, CONFIG, "megatron:2", FP8, seed=2, threshold=0.5,
                                 dtype="bf16") == "fp8 verdict"
    (what, args, kwargs), = paths
    assert (what, args[:4], kwargs) == ("fp8", (fn, CONFIG, src, dst),
                                        dict(threshold=0.5, seed=2))
    drawn = init_params(CONFIG, 2, dtype=torch.bfloat16)
    assert args[4].keys() == drawn.keys()
    assert all(torch.equal(args[4][n], x) and args[4][n].dtype == x.dtype
               for n, x in drawn.items())


@pytest.mark.parametrize("kwargs", [dict(stream="layer"), dict(backend="gloo"),
                                    dict(measure_floor=True)])
def test_an_fp8_destination_refuses_what_it_does_not_take_naming_it(paths, kwargs):
    with pytest.raises(ValueError, match=r"^vllm:tp=2,fp8=block128: an FP8 destination is "
                                         r"checked whole, in process, with a threshold "
                                         r"measured on its dequantized weights: drop "
                                         r"stream=, backend= and measure_floor=$"):
        convert.check_convert(fn, CONFIG, "megatron:2", FP8, **kwargs)
    assert not paths


def weights(dtype=torch.float32, router=None):
    held = init_params(CONFIG, 7, dtype=dtype)
    return {n: (x.float() if n == router else x) for n, x in held.items()}


def test_an_fp8_destination_on_real_weights_says_their_dtypes(paths):
    mixed = weights(torch.bfloat16, router="norm.weight")
    convert.check_convert(fn, CONFIG, "megatron:2", FP8, weights=mixed, threshold=0.5, seed=1)
    (what, args, kwargs), = paths
    assert args[4] == mixed and args[:4] == (fn, CONFIG, endpoint("megatron:2"),
                                             endpoint(FP8))
    assert kwargs == dict(threshold=0.5, seed=1, seeded=False,
                          weights_note=convert.dtypes_of(mixed)[1])
    assert "norm.weight float32" in kwargs["weights_note"]


@pytest.fixture
def measured(monkeypatch):
    """``weights_threshold`` standing in: records what it was asked."""
    asked = []

    def weights_threshold(config, ends, held, threshold):
        asked.append((config, ends, held, threshold))
        return 0.125, "<measured>"
    monkeypatch.setattr(convert, "weights_threshold", weights_threshold)
    return asked


@pytest.mark.parametrize("mixed", [False, True])
def test_real_weights_are_judged_by_a_threshold_measured_on_them(paths, measured, mixed):
    held = weights(torch.bfloat16, router="norm.weight" if mixed else None)
    src, dst = endpoint("megatron:2"), endpoint("vllm:2")
    assert convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", weights=held,
                                 backend="gloo", threshold=0.5) == "verdict"
    assert measured == [(CONFIG, [src, dst], held, 0.5)]
    _, kwargs = paths[0]
    assert kwargs == dict(config=CONFIG, backend="gloo", threshold=0.125,
                          dtype=torch.bfloat16, params=held, mixed=mixed)
    assert [p[0] for p in paths] == ["checker", "source", "call", "verdict"]
    assert paths[2][1:] == (fn, (f"<{src} shards>", 2),
                            dict(role="converter", config=CONFIG, ends=(src, dst),
                                 during=f"while converting {CONFIG.name} {src} -> {dst}"))
    assert paths[3] == ("verdict", "<converted>", src, dst)


def test_real_weights_notes_say_where_the_threshold_came_from_and_the_dtypes(monkeypatch,
                                                                             measured):
    made = []
    monkeypatch.setattr(convert, "conversion_checker",
                        lambda config, **k: made.append(Checker([], k)) or made[-1])
    monkeypatch.setattr(convert, "call", lambda *a, **k: None)
    convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", weights=weights())
    assert made[0].checker.notes == ("floor", "<measured>")  # one dtype: no second note
    mixed = weights(torch.bfloat16, router="norm.weight")
    convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", weights=mixed)
    assert made[1].checker.notes == ("floor", "<measured>", convert.dtypes_of(mixed)[1])


def test_real_weights_refuse_a_stream_and_a_dtype_saying_why(paths, measured):
    with pytest.raises(ValueError, match=r"^weights= runs the whole-model check; stream= "
                                         r"draws the seed's weights stage by stage$"):
        convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", weights=weights(),
                              stream="layer")
    with pytest.raises(ValueError, match=r"^weights= checks the weights in their own dtype: "
                                         r"drop dtype=$"):
        convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", weights=weights(),
                              dtype="bf16")
    assert not paths and not measured
    convert.check_convert(fn, CONFIG, "megatron:2", "vllm:2", weights=weights(),
                          dtype="fp32")  # the twin: fp32, named, is the default
    assert measured
