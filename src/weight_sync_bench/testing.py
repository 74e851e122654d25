"""Fuzz your own splitter, resharder or converter from your own pytest suite.

    from weight_sync_bench.testing import reshard_property, split_property, convert_property

    test_my_resharder = reshard_property(my_reshard)                 # pytest collects it
    test_my_splitter = split_property(my_split, max_d_model=64)      # a narrowed domain
    test_my_converter = convert_property(my_convert, "megatron", "vllm")

Each returns a test function that runs a Hypothesis property: random geometries of the fuzz
domain (``geometries``), the degrees the layout (or the conventions) support there, a seed;
your function gets what ``check_split`` / ``check_reshard`` / ``check_convert`` give it, plus
``config=`` (the ``ModelConfig``) when its signature accepts it and, for a converter,
``hf_config=`` (the HF ``config.json`` dict). The verdict is the fixed checks': bytes exact
against the declared layout, then the forward within the fuzz threshold. A failure is shrunk
to its smallest geometry, written to your corpus (``WSB_CORPUS_DIR``, else ``wsb-corpus/``
in the current directory) with your function's
import path and source hash, and raised with a report naming the geometry, the degrees, the
first parameter that differs and the rows each rank holds. The corpus entries of your
function and every shipped ``config.json`` geometry run first, as explicit examples.

Raise ``weight_sync_bench.Unsupported`` to decline a case your function does not support:
it is skipped and counted (a warning gives the count and the smallest declined case), never
a pass, and a run that declines every case fails. Narrow the domain with keywords instead
where you can: ``max_d_model=N``, ``kv_heads=(lo, hi)``, ``gqa=False`` (MHA only) or
``gqa=True``, ``vocab_multiple=k``, or any ``FuzzDomain`` field as ``(lo, hi)``; ranges can
narrow the sampled domain, never widen it. ``src=`` / ``dst=`` fix degrees; ``settings=`` a
Hypothesis ``settings`` (otherwise the profile you loaded applies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import settings as Settings
from hypothesis import strategies as st

from weight_sync_bench.fuzz import strategies as _strategies
from weight_sync_bench.fuzz.case import parse_end
from weight_sync_bench.fuzz.strategies.user import narrow
from weight_sync_bench.fuzz.user import UserFunction, user_property
from weight_sync_bench.model.config import ModelConfig

__all__ = ["convert_property", "degree_pairs", "geometries", "narrow", "reshard_property",
           "seeds", "split_property"]


def _property(fn: Callable[..., Any], role: str, *, src: int | None = None,
              dst: int | None = None, conventions: tuple[str, str] | None = None,
              settings: Settings | None = None, real: bool = True, corpus: bool = True,
              name: str = "", **domain: Any) -> Callable[[], None]:
    function = UserFunction(fn, role, src=conventions[0] if conventions else None,
                            dst=conventions[1] if conventions else None, name=name)
    return user_property(function, domain=narrow(**domain), src=src, dst=dst,
                         settings=settings, real=real, corpus=corpus)


def split_property(fn: Callable[..., Any], *, dst: int | None = None,
                   settings: Settings | None = None, real: bool = True, corpus: bool = True,
                   **domain: Any) -> Callable[[], None]:
    """A test that ``fn(full, degree)`` returns the declared split on every fuzzed geometry
    and degree (``dst`` fixes the degree); ``domain`` narrows the geometries (see the module
    doc)."""
    return _property(fn, "splitter", dst=dst, settings=settings, real=real, corpus=corpus,
                     **domain)


def reshard_property(fn: Callable[..., Any], *, src: int | None = None, dst: int | None = None,
                     settings: Settings | None = None, real: bool = True, corpus: bool = True,
                     **domain: Any) -> Callable[[], None]:
    """A test that ``fn(shards_at_src, dst)`` returns the declared split at ``dst`` on every
    fuzzed geometry and degree pair (``src`` / ``dst`` fix them)."""
    return _property(fn, "resharder", src=src, dst=dst, settings=settings, real=real,
                     corpus=corpus, **domain)


def convert_property(fn: Callable[..., Any], src: str, dst: str, *,
                     settings: Settings | None = None, real: bool = True, corpus: bool = True,
                     **domain: Any) -> Callable[[], None]:
    """A test that ``fn(shards, degree)`` converts ``src``'s shards (``"megatron"``, or
    ``"megatron:4"`` for a fixed degree, or a whole endpoint) to ``dst``'s (``"vllm"``,
    ``"vllm:2"``, ``"vllm:fp8=block128"``) byte for byte on every fuzzed geometry and the
    degrees both conventions support there."""
    ends = [parse_end(e) for e in (src, dst)]  # as wsb fuzz --from / --to reads them
    return _property(fn, "converter", src=ends[0][1], dst=ends[1][1],
                     conventions=(ends[0][0], ends[1][0]), settings=settings, real=real,
                     corpus=corpus, **domain)


def geometries(**domain: Any) -> st.SearchStrategy[ModelConfig]:
    """A ``ModelConfig`` of the fuzz domain, narrowed by ``domain`` (``max_d_model=64``,
    ``kv_heads=(1, 2)``, ``gqa=False``, ``vocab_multiple=8``, any ``FuzzDomain`` field as
    ``(lo, hi)``): ``n_kv_heads`` first, then ``n_heads`` as a multiple of it, ``ffn`` and
    ``vocab`` as multiples of it too (every divisor of ``n_kv_heads`` is then a supported
    degree), then head_dim, d_model, depth and the token shape. Shrinks toward the domain's
    smallest geometry: one KV head, one query head per group, the smallest head_dim,
    d_model, ffn, vocab, depth, batch and sequence."""
    return _strategies.geometries(narrow(**domain))


def degree_pairs(geometry: ModelConfig, degrees: list[int] | None = None
                 ) -> st.SearchStrategy[tuple[int, int]]:
    """An ordered ``(src, dst)`` pair of the degrees ``layout_for(geometry)`` supports (or of
    ``degrees``, a non-empty subset), ``src == dst`` included. Shrinks toward ``(1, 1)``."""
    return _strategies.degree_pairs(geometry, degrees)


def seeds() -> st.SearchStrategy[int]:
    """A model seed in 0..65535 (the harness draws the weights from it with a
    ``torch.Generator``, the tokens from ``1000 + seed``). Shrinks toward 0."""
    return _strategies.seeds()
