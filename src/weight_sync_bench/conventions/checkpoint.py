"""Checkpoints on disk, each in the files its framework stores: for converters that are
command-line tools (``wsb emit`` writes the synthetic model, ``wsb verify`` reads what the
tool wrote back).

- ``hf`` (degree 1): ``config.json``, the weights in ``model-0000N-of-0000M.safetensors``
  with ``model.safetensors.index.json`` (``{"metadata": {"total_size", "total_parameters"},
  "weight_map": {tensor: file}}``, keys sorted), or one ``model.safetensors`` when a single
  file holds everything. Followed: transformers 4.57 ``PreTrainedModel.save_pretrained``
  (``SAFE_WEIGHTS_NAME``, ``SAFE_WEIGHTS_INDEX_NAME``, ``metadata={"format": "pt"}``) and
  ``huggingface_hub.serialization._base.split_state_dict_into_shards_factory`` (tensors in
  order, a new file when the next one would pass ``max_shard_size``, a tensor larger than
  it alone in its file; suffix ``-{i:05d}-of-{n:05d}``). Research notes conventions.md §3.
- ``meta`` (degree t): ``params.json`` (``ModelArgs``: dim, n_layers, n_heads, n_kv_heads,
  vocab_size, multiple_of, ffn_dim_multiplier, norm_eps, rope_theta) and
  ``consolidated.{r:02d}.pth`` per model-parallel rank, a ``torch.save``d dict of tensors
  (``llama/generation.py::Llama.build`` loads ``sorted(glob("*.pth"))[rank]`` and asserts
  one file per rank). Llama's ``Attention`` uses ``head_dim = dim // n_heads``: a config
  whose head_dim differs has no params.json.
- ``megatron``, ``vllm`` and ``plain`` (degree t): one safetensors file per rank,
  ``model-rank-{rank}-part-0.safetensors``, holding that rank's local tensors as the
  convention declares them, and a ``config.json`` (the HF one) for the geometry. The
  pattern is vLLM's ``ShardedStateLoader.DEFAULT_PATTERN``
  (``vllm/model_executor/model_loader/sharded_state_loader.py``; ``--load-format
  sharded_state`` reads each rank's tensors in their final, post-loading layout, and
  ``examples/.../save_sharded_state.py`` copies config.json beside them). A rank may be
  split over several ``part`` files, as that loader allows. Megatron-Core itself writes
  ``torch_dist`` or ``mp_rank_XX/model_optim_rng.pt`` checkpoints; the harness stores
  Megatron's rank-local tensors in the same per-rank safetensors files instead.

Writing is atomic as a whole: every file goes into a hidden sibling directory, renamed to
the checkpoint's name when all are written (``write_checkpoint``). Reading opens only regular
files inside the directory (``files.inside``: no index entry or symlink leads out) and checks
every file against the convention before any tensor is compared: a file missing, truncated
or mis-named, a tensor missing, extra or of the wrong shape is a ``CheckpointError`` naming
the file. Dtypes are kept as stored (compared exactly by the check, never assumed).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.errors import CheckpointError, InvalidConfig, UnsupportedConvention
from weight_sync_bench.files import inside, read_bounded
from weight_sync_bench.conventions.coordinates import rank_coordinates
from weight_sync_bench.conventions.maps import gather_canonical
from weight_sync_bench.model.config import MOE_FIELDS

if TYPE_CHECKING:
    from weight_sync_bench.conventions.convention import Endpoint
    from weight_sync_bench.model.config import ModelConfig

Params = dict[str, torch.Tensor]

HF_CONFIG = "config.json"
HF_SINGLE = "model.safetensors"  # transformers SAFE_WEIGHTS_NAME
HF_INDEX = "model.safetensors.index.json"  # transformers SAFE_WEIGHTS_INDEX_NAME
HF_SHARD = "model-{index:05d}-of-{total:05d}.safetensors"
META_PARAMS = "params.json"
META_FILE = "consolidated.{rank:02d}.pth"
RANK_FILE = "model-rank-{rank}-part-{part}.safetensors"  # vLLM ShardedStateLoader
_RANK_RE = re.compile(r"model-rank-(\d+)-part-(\d+)\.safetensors")
_META_RE = re.compile(r"consolidated\.(\d{2})\.pth")
# Of a ModelConfig, the fields a config.json or params.json states (the rest is the check's).
GEOMETRY = ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn",
            "rope_theta", "norm_eps", "tie_embeddings", "qkv_bias", "o_bias", "qk_norm",
            *MOE_FIELDS)


@dataclass(frozen=True)
class Checkpoint:
    """What ``read_checkpoint`` found: each rank's tensors and, per rank and tensor, the file
    it came from (to name the file when a later check finds it wrong)."""

    directory: Path
    shards: list[Params]
    files: list[dict[str, Path]]

    def file_of(self, rank: int, name: str) -> Path:
        return self.files[rank].get(name, self.directory)


def layout_of(where: Endpoint) -> str:
    """The on-disk layout of a convention: ``hf``, ``meta`` or ``ranks`` (per-rank files)."""
    return where.name if where.name in ("hf", "meta") else "ranks"


# -- writing


def write_checkpoint(directory: str | Path, shards: Sequence[Mapping[str, torch.Tensor]],
                     where: Endpoint, config: ModelConfig, *,
                     max_shard_size: int | None = None) -> list[Path]:
    """Write ``shards`` (``where``'s rank-local tensors, e.g. ``shards_for``) into
    ``directory`` (created; it must be new or empty) in ``where``'s files; returns the files
    written, in order. ``max_shard_size`` (bytes, HF only): the largest safetensors file
    before the next one starts; default a quarter of the model, so the synthetic model is
    cut into about four files like a real 7-8B checkpoint at HF's 5 GB; at or above the
    model's size it is one ``model.safetensors``, as ``save_pretrained`` writes it.

    Atomic as a whole: the files are written into a hidden sibling directory
    (``.DIR.wsb-partial-PID``) and renamed into place when all are complete, so a failed or
    interrupted write leaves no ``directory`` and no partial file, and a rerun works; a
    sibling left by a killed writer (its PID no longer running) is removed by the next
    write. Every file and the directory get the modes the umask gives a new file. A
    file-system error (disk full, read-only, permissions) is a ``CheckpointError`` naming
    the path."""
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: not a new or empty directory (emit does not mix its "
                              "files with others)", path=str(out))
    if len(shards) != where.world:
        raise CheckpointError(f"{where}: {len(shards)} rank dicts to write, expected "
                              f"{where.world}", path=str(out))
    if max_shard_size is not None and (isinstance(max_shard_size, bool) or not isinstance(
            max_shard_size, int) or max_shard_size < 1):
        raise CheckpointError(f"max_shard_size must be an int >= 1 (bytes), got "
                              f"{max_shard_size!r}", path=str(out))
    kind = layout_of(where)
    # what the format cannot state is refused before anything is written
    described = meta_params(config) if kind == "meta" else hf_config_json(config, _dtype(shards))
    if where.quantized:  # an FP8 checkpoint says so, as the public ones do
        from weight_sync_bench.conventions.fp8 import quantization_config, scheme_of

        described["quantization_config"] = quantization_config(scheme_of(where))
    with _staged(out) as stage:
        match kind:
            case "hf":
                written = _write_hf(stage, dict(shards[0]), described, max_shard_size)
            case "meta":
                written = [_write_text(stage / META_PARAMS, json.dumps(described, indent=2))] + [
                    _write_torch(stage / META_FILE.format(rank=r), dict(s))
                    for r, s in enumerate(shards)]
            case _:
                written = [_write_text(stage / HF_CONFIG, json.dumps(described, indent=2,
                                                                     sort_keys=True))] + [
                    _write_safetensors(stage / RANK_FILE.format(rank=r, part=0), dict(s))
                    for r, s in enumerate(shards)]
    return [out / path.name for path in written]


def _write_hf(out: Path, params: Params, described: dict[str, Any],
              max_shard_size: int | None) -> list[Path]:
    sizes = {name: x.numel() * x.element_size() for name, x in params.items()}
    total = sum(sizes.values())
    limit = max_shard_size if max_shard_size is not None else max(1, math.ceil(total / 4))
    # split_state_dict_into_shards_factory: in order; a tensor over the limit alone.
    groups: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > limit:
            groups.append([name])
            continue
        if current and current_size + size > limit:
            groups.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        groups.append(current)
    files = [_write_text(out / HF_CONFIG, json.dumps(described, indent=2, sort_keys=True))]
    if len(groups) == 1:
        return files + [_write_safetensors(out / HF_SINGLE, params)]
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        path = _write_safetensors(out / HF_SHARD.format(index=i, total=len(groups)),
                                   {n: params[n] for n in names})
        files.append(path)
        weight_map.update(dict.fromkeys(names, path.name))
    index = {"metadata": {"total_parameters": sum(x.numel() for x in params.values()),
                          "total_size": total}, "weight_map": weight_map}
    files.append(_write_text(out / HF_INDEX, json.dumps(index, indent=2, sort_keys=True)))
    return files


def hf_config_json(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF ``config.json`` ``ModelConfig.from_hf_config`` reads back as ``config`` (its
    inverse on ``GEOMETRY``): ``ModelConfig.to_hf_config`` (Llama, Qwen2, Qwen3 or an MoE
    family's) with the weights' ``torch_dtype``."""
    try:
        out = config.to_hf_config()
    except InvalidConfig as exc:  # what HF cannot state, named as the format's refusal
        raise UnsupportedConvention(f"hf: config.json cannot state it: {exc}") from None
    # ``_name_or_path``: where transformers' ``PretrainedConfig`` keeps the name a model was
    # loaded under; here the geometry's name, so ``checkpoint_geometry`` names it back
    return {**out, "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
            "_name_or_path": config.name}


def meta_ffn(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """``llama/model.py::FeedForward``'s hidden size for ``TransformerBlock``'s
    ``hidden_dim=4 * dim``: ``int(2 * 4 dim / 3)``, times the multiplier, rounded up to a
    multiple of ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def meta_params(config: ModelConfig) -> dict[str, Any]:
    """``params.json`` for ``config``: the first ``multiple_of`` (1024, 256, then ffn itself)
    and ``ffn_dim_multiplier`` (none, Llama 3's 1.3, then ffn over the base) for which
    ``meta_ffn`` gives ``config.ffn``."""
    if config.head_dim * config.n_heads != config.d_model:
        raise UnsupportedConvention(
            f"meta: params.json has no head_dim (Llama's Attention uses dim // n_heads), so it "
            f"cannot state head_dim={config.head_dim} != d_model / n_heads = "
            f"{config.d_model} / {config.n_heads}")
    base = int(2 * (4 * config.d_model) / 3)
    choice = next((m, f) for m in (1024, 256, config.ffn) for f in (None, 1.3, config.ffn / base)
                  if meta_ffn(config.d_model, m, f) == config.ffn)
    return {"dim": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads,
            "n_kv_heads": config.n_kv_heads, "vocab_size": config.vocab,
            "multiple_of": choice[0], "ffn_dim_multiplier": choice[1],
            "norm_eps": config.norm_eps, "rope_theta": config.rope_theta}


def _dtype(shards: Sequence[Mapping[str, torch.Tensor]]) -> torch.dtype:
    return next(iter(shards[0].values())).dtype if shards and shards[0] else torch.float32


STAGE = ".{name}.wsb-partial-{pid}"  # where write_checkpoint writes before the rename


def _umask() -> int:
    """The process's umask (read from /proc, where setting and restoring it would race
    with other threads creating files; set and restored where /proc is not there)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _stale_stages(out: Path) -> None:
    """Remove the staging siblings of ``out`` left by writers that no longer run (killed
    with SIGKILL, where no handler could clean up)."""
    import glob
    import shutil

    prefix = STAGE.format(name=out.name, pid="")
    for path in out.parent.glob(f"{glob.escape(prefix)}*"):
        pid = path.name[len(prefix):]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # running, as another user


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A new directory to write ``out``'s files into, renamed to ``out`` when the block
    completes (``out`` absent or an empty directory: rename(2) replaces an empty one) and
    removed when it raises. Every file's and directory's mode, at any depth, set to what the
    umask gives a new one (a writer may have made some 0o600); an ``OSError`` (or
    safetensors' error) becomes a ``CheckpointError`` naming the path."""
    import shutil

    from safetensors import SafetensorError

    stage = out.parent / STAGE.format(name=out.name, pid=os.getpid())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _stale_stages(out)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        yield stage
        umask = _umask()
        for path in stage.rglob("*"):  # a directory (iter_*) keeps its x bits: traversable
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        os.rename(stage, out)
    except (OSError, SafetensorError) as exc:
        where = getattr(exc, "filename", None) or stage
        raise CheckpointError(f"{out}: not written, {exc} (at {where}); nothing was left "
                              "behind", path=str(out)) from None
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    return path


def _write_safetensors(path: Path, params: Params) -> Path:
    from safetensors.torch import save_file

    save_file({name: x.detach().contiguous() for name, x in params.items()}, str(path),
              metadata={"format": "pt"})
    return path


def _write_torch(path: Path, params: Params) -> Path:
    torch.save({n: x.detach().clone() for n, x in params.items()}, path)
    return path


# -- reading


def read_checkpoint(directory: str | Path, where: Endpoint, config: ModelConfig, *,
                    roots: Sequence[str | Path] = ()) -> Checkpoint:
    """The rank-local tensors of a checkpoint ``directory`` said to be ``where`` (``vllm:2``:
    per-rank safetensors files; ``hf``: an HF directory; ``meta:2``: consolidated files),
    checked against ``where``'s declared names and shapes for ``config`` and against the
    directory's ``config.json`` / ``params.json`` where the format has one. Raises
    ``CheckpointError`` naming the file that is missing, truncated, mis-named or wrong.

    Every file is checked before it is opened (``files.inside``): a regular file inside
    ``directory`` after resolving symlinks, or inside the Hugging Face cache ``blobs/`` of a
    snapshot directory, or inside one of ``roots``; anything else (an index entry naming
    ``../x`` or an absolute path, a symlink out, a FIFO or device) is ``UnsafeFile``."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory", path=str(root))
    files_of = _Files(root, tuple(roots))
    match layout_of(where):
        case "hf":
            _check_geometry(root / HF_CONFIG, _read_hf_config(files_of, config), config)
            shards, files = _read_hf(files_of)
        case "meta":
            _check_geometry(root / META_PARAMS, _read_meta_params(files_of), config)
            shards, files = _read_meta(files_of, where.world)
        case _:  # a config.json beside the rank files (vLLM's save_sharded_state copies
            # it there) must agree; a converter tool may write none
            if (root / HF_CONFIG).exists() or (root / HF_CONFIG).is_symlink():
                _check_geometry(root / HF_CONFIG, _read_hf_config(files_of, config), config)
            shards, files = _read_ranks(files_of, where.world)
    checkpoint = Checkpoint(root, shards, files)
    _check_names_and_shapes(checkpoint, where, config)
    return checkpoint


def read_rank_dumps(directory: str | Path, where: Endpoint, *,
                    roots: Sequence[str | Path] = (),
                    ranks: Sequence[int] | None = None) -> list[LazyTensors]:
    """Each rank's tensors as an engine dumped them after a sync (``wsb verify-state``):
    ``model-rank-{rank}-part-{part}.safetensors`` per rank of ``where`` (vLLM's sharded-state
    pattern, as ``wsb emit`` writes ranks), with the same file checks as ``read_checkpoint``
    but not held to the declared names and shapes (which tensors are missing, unexpected or
    wrong is what the state check reports), each tensor read when asked for
    (``LazyTensors``). ``ranks``: only these ranks' files must be there (the others' are
    empty mappings)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory of rank dumps", path=str(root))
    return _read_ranks(_Files(root, tuple(roots)), where.world, lazy=True, needed=ranks)[0]


def hf_weights(directory: str | Path, where: Endpoint, config: ModelConfig, *,
               roots: Sequence[str | Path] = ()) -> CanonicalWeights:
    """The canonical parameters of a Hugging Face checkpoint directory, each assembled from
    its stored tensors when asked for (one parameter's tensors in memory at a time): the
    trainer's weights a sync sends, for ``wsb verify-state``. The directory is checked as
    ``read_checkpoint`` checks it (``config.json`` against ``config``, every file inside it,
    the index, every declared name present with its declared shape, read from the headers)
    before anything is read. ``where``: the ``hf`` endpoint (its options: the experts'
    layout)."""
    if layout_of(where) != "hf":
        raise CheckpointError(f"{directory}: hf_weights reads a Hugging Face directory, not "
                              f"{where}", path=str(directory))
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory", path=str(root))
    files_of = _Files(root, tuple(roots))
    _check_geometry(root / HF_CONFIG, _read_hf_config(files_of, config), config)
    (stored,), _ = _read_hf(files_of, lazy=True)
    (pieces,) = where.pieces(config)
    for name, piece in pieces.items():
        if name not in stored:
            raise CheckpointError(f"{root}: hf is missing {name}", path=str(root))
        want = piece.local_shape(config.param_shapes()[piece.source])
        if stored.shape(name) != want:
            raise CheckpointError(f"{stored.file_of(name)}: hf {name} has shape "
                                  f"{list(stored.shape(name))}, declared {list(want)}",
                                  path=str(stored.file_of(name)))
    return CanonicalWeights(stored, pieces, config.param_shapes())


class LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors in a checkpoint directory's safetensors files (``where``: tensor name -> file
    name in it), each read with ``safe_open`` when asked for, nothing kept: one tensor in
    memory at a time. Each open checks the file again (``files.inside``, as when the
    directory was read), so a file swapped for a symlink out of it since is refused."""

    def __init__(self, where: Mapping[str, str], files: _Files | None = None) -> None:
        self.where, self.files = dict(where), files

    def file_of(self, name: str) -> Path:
        assert self.files is not None
        return self.files.root / self.where[name]

    def _path(self, name: str) -> Path:
        assert self.files is not None
        return self.files.checked(self.where[name])

    def __getitem__(self, name: str) -> torch.Tensor:
        with _opened(self._path(name)) as f:
            return f.get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        with _opened(self._path(name)) as f:
            return tuple(f.get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class CanonicalWeights(Mapping[str, torch.Tensor]):
    """Canonical parameters assembled on demand from a convention's stored tensors at
    degree 1 (``stored``: name -> tensor, lazily read): ``weights[source]`` reads the tensors
    of that one parameter and writes them back into place (``gather_canonical``)."""

    def __init__(self, stored: Mapping[str, torch.Tensor], pieces: Mapping[str, Any],
                 shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.stored, self.pieces, self.shapes = stored, pieces, shapes
        self.names: dict[str, list[str]] = {}
        for name, piece in pieces.items():
            self.names.setdefault(piece.source, []).append(name)

    def __contains__(self, source: object) -> bool:  # Mapping's would assemble it
        return source in self.shapes

    def __getitem__(self, source: str) -> torch.Tensor:
        names = self.names[source]
        pieces = [self.pieces[n] for n in names]
        size = self.shapes[source][pieces[0].dim] if pieces else 0
        runs = sorted((p.span, n) for n, p in zip(names, pieces)
                      if p.span is not None and not p.is_stacked and p.dim == pieces[0].dim)
        if len(runs) == len(names) and runs[0][0][0] == 0 and runs[-1][0][1] == size and all(
                a[1] == b[0] for (a, _), (b, _) in zip(runs, runs[1:])):
            # stored tensors that tile it in order (a norm, [q; k; v], [gate; up]): as they
            # are, or concatenated, without the zeros gather_canonical starts from
            parts = [self.stored[n] for _, n in runs]
            return parts[0] if len(parts) == 1 else torch.cat(parts, pieces[0].dim)
        return gather_canonical([{n: self.stored[n] for n in names}],
                                [{n: self.pieces[n] for n in names}],
                                {source: self.shapes[source]}, [source])[source]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """``safe_open`` of a checked file, its errors as ``CheckpointError`` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file, truncated or corrupt "
                              f"({exc})", path=str(path)) from None


@dataclass(frozen=True)
class _Files:
    """A checkpoint directory's files, each opened only once ``files.inside`` allows it."""

    root: Path
    roots: tuple[str | Path, ...]

    def checked(self, name: str, what: str = "", missing: str = "") -> Path:
        """The resolved path of the file ``name``; ``CheckpointError`` where it is missing
        (``missing`` says why it should be there), ``UnsafeFile`` where it may not be read."""
        try:
            return inside(self.root, name, roots=self.roots, what=what)
        except FileNotFoundError:
            path = self.root / name
            raise CheckpointError(f"{path}: missing{f' ({missing})' if missing else ''}",
                                  path=str(path)) from None

    def unsafe(self, name: str, what: str = "") -> None:
        """``UnsafeFile`` where the file ``name`` exists and may not be read; nothing where it
        may, or does not exist (a missing file is named where it is read)."""
        try:
            inside(self.root, name, roots=self.roots, what=what)
        except FileNotFoundError:
            pass

    def json(self, name: str) -> Any:
        path = self.root / name
        try:
            return json.loads(read_bounded(self.checked(name), shown=path))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing", path=str(path)) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: not readable JSON ({exc})", path=str(path)) from None

    def safetensors(self, name: str, what: str = "", missing: str = "") -> Params:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.root / name
        resolved = self.checked(name, what, missing)
        try:
            return load_file(str(resolved))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing", path=str(path)) from None
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file, truncated or "
                                  f"corrupt ({exc})", path=str(path)) from None


def checkpoint_geometry(directory: str | Path, where: Endpoint, *,
                        roots: Sequence[str | Path] = ()) -> ModelConfig:
    """The geometry a checkpoint directory states, for a check that was given none: its
    ``config.json`` (hf and per-rank layouts) or ``params.json`` (meta), read as
    ``read_checkpoint`` reads it (inside the directory, bounded). A built-in config whose
    geometry it is (its name, its committed floors); else the geometry named by
    ``config.json``'s ``_name_or_path`` (``wsb emit`` writes the config's name there), else
    by the directory. ``CheckpointError`` where the file is missing or states no geometry."""
    from weight_sync_bench.model.config import CONFIGS, MOE_CONFIGS, ModelConfig

    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory", path=str(root))
    files = _Files(root, tuple(roots))
    named = root.resolve().name or "checkpoint"
    if layout_of(where) == "meta":
        stated = _read_meta_params(files)
        found = None
    else:
        found = _hf_geometry(files, None)
        named = found.name
        stated = {f: getattr(found, f) for f in GEOMETRY}
    for builtin in (*CONFIGS.values(), *MOE_CONFIGS.values()):
        if all(getattr(builtin, f) == v for f, v in stated.items()):
            return builtin
    if found is not None:
        return found
    try:
        return ModelConfig(name=named, **stated)
    except InvalidConfig as exc:
        path = root / META_PARAMS
        raise CheckpointError(f"{path}: states no geometry the harness can check ({exc})",
                              path=str(path)) from None


def _hf_geometry(files: _Files, name: str | None) -> ModelConfig:
    """The geometry of the directory's ``config.json``, named ``name`` (None: its
    ``_name_or_path``, else the directory's name)."""
    from weight_sync_bench.model.config import ModelConfig

    path = files.root / HF_CONFIG
    data = files.json(HF_CONFIG)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: an HF config is a JSON object, got "
                              f"{type(data).__name__}", path=str(path))
    if name is None:
        given = data.get("_name_or_path")
        name = given if isinstance(given, str) and given.strip() else (
            files.root.resolve().name or "checkpoint")
    try:
        return ModelConfig.from_hf_config(data, name=name)
    except InvalidConfig as exc:
        raise CheckpointError(f"{path}: {exc}", path=str(path)) from None


def _read_hf_config(files: _Files, config: ModelConfig) -> dict[str, Any]:
    found = _hf_geometry(files, config.name)
    return {f: getattr(found, f) for f in GEOMETRY}


def _read_meta_params(files: _Files) -> dict[str, Any]:
    path = files.root / META_PARAMS
    data = files.json(META_PARAMS)
    try:
        if not isinstance(data, dict):
            raise TypeError(f"a JSON object expected, got {type(data).__name__}")
        dim, heads = int(data["dim"]), int(data["n_heads"])
        return {"vocab": int(data["vocab_size"]), "d_model": dim,
                "n_layers": int(data["n_layers"]), "n_heads": heads,
                "n_kv_heads": int(data.get("n_kv_heads") or heads), "head_dim": dim // heads,
                "ffn": meta_ffn(dim, int(data["multiple_of"]), data.get("ffn_dim_multiplier")),
                "norm_eps": float(data["norm_eps"]),
                "rope_theta": float(data.get("rope_theta", 10000.0))}
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"{path}: not a Llama params.json ({type(exc).__name__}: {exc})",
                              path=str(path)) from None


def _check_geometry(path: Path, found: Mapping[str, Any], config: ModelConfig) -> None:
    for field, value in found.items():
        if value != getattr(config, field):
            raise CheckpointError(f"{path}: {field} is {value!r}, the config checked "
                                  f"({config.name}) has {getattr(config, field)!r}",
                                  path=str(path))


def _strays(root: Path, suffix: str, known: set[str], pattern: str) -> None:
    for path in sorted(root.glob(f"*{suffix}")):
        if path.name not in known:
            raise CheckpointError(f"{path}: a {suffix} file the checkpoint does not name "
                                  f"(expected {pattern})", path=str(path))


def _read_hf(files: _Files, *, lazy: bool = False
             ) -> tuple[list[Any], list[dict[str, Path]]]:
    """The one rank of an HF directory: its tensors (``lazy``: a ``LazyTensors`` over the
    checked files, read from their headers only) and the file of each."""
    root = files.root
    index_path = root / HF_INDEX
    if not index_path.exists() and not index_path.is_symlink():
        single = root / HF_SINGLE
        if not single.exists() and not single.is_symlink():
            raise CheckpointError(f"{index_path}: missing (and no single {HF_SINGLE})",
                                  path=str(index_path))
        _strays(root, ".safetensors", {HF_SINGLE}, HF_SINGLE)
        if lazy:
            with _opened(files.checked(HF_SINGLE)) as f:
                where = dict.fromkeys(f.keys(), single)
            return [LazyTensors(dict.fromkeys(where, HF_SINGLE), files)], [where]
        params = files.safetensors(HF_SINGLE)
        return [params], [dict.fromkeys(params, single)]
    index = files.json(HF_INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no weight_map of tensor name -> file name",
                              path=str(index_path))
    names = sorted(set(weight_map.values()))
    # every entry is checked before any file is opened: one that escapes refuses the whole
    # checkpoint, before the directory's other files are looked at
    said = {name: f"{index_path.name} maps {sum(v == name for v in weight_map.values())} "
            "tensors to it" for name in names}
    for name in names:
        files.unsafe(name, said[name])
    _strays(root, ".safetensors", set(names), f"one of the files {index_path.name} names: "
            + ", ".join(names))
    params: Params = {}
    where: dict[str, Path] = {}
    resolved: dict[str, Path] = {}
    for name in names:
        path = root / name
        if lazy:
            with _opened(files.checked(name, said[name], said[name])) as f:
                held = dict.fromkeys(f.keys())
            resolved.update(dict.fromkeys(held, name))
        else:
            held = files.safetensors(name, said[name], said[name])
        for tensor, x in held.items():
            if weight_map.get(tensor) != name:
                raise CheckpointError(f"{path}: holds {tensor}, which {index_path.name} maps "
                                      f"to {weight_map.get(tensor)!r}", path=str(path))
            params[tensor], where[tensor] = x, path
    for tensor, name in weight_map.items():
        if tensor not in params:
            raise CheckpointError(f"{root / name}: has no {tensor} ({index_path.name} maps "
                                  "it there)", path=str(root / name))
    if lazy:
        return [LazyTensors(resolved, files)], [where]
    return [params], [where]


# -- Megatron's legacy ``torch`` checkpoint format (``--ckpt-format torch``), read as the
# weights a sync sends. Followed: Megatron-LM d98e8a64, megatron/training/checkpointing.py
# ``get_checkpoint_name`` (``iter_{:07d}`` or ``release``, then ``mp_rank_{tp:02d}``,
# ``_{pp:03d}`` with pipeline stages, ``_{ep:03d}`` with expert parallelism, then
# ``model_optim_rng.pt``), ``get_checkpoint_tracker_filename`` / ``read_metadata``
# (``latest_checkpointed_iteration.txt``: an iteration or ``release``) and
# ``generate_state_dict`` (``args``, ``checkpoint_version`` 3.0, ``iteration``, and the model
# under ``model``, or ``model{v}`` per virtual stage); megatron/core/safe_globals.py for what
# Megatron itself loads with ``weights_only=True`` (an argparse Namespace, numpy arrays of
# the RNG state, BytesIO extra state, a few enums and configs of its own).

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_FILE = "model_optim_rng.pt"


def megatron_rank_dir(config: ModelConfig, where: Endpoint, rank: int) -> str:
    """The legacy checkpoint directory of ``where``'s rank (``get_checkpoint_name``)."""
    at = rank_coordinates(config, where, rank)
    return (f"mp_rank_{at.tp:02d}" + (f"_{at.pp:03d}" if where.pp > 1 else "")
            + (f"_{at.ep:03d}" if where.ep > 1 else ""))


def _legacy_rank_dirs(config: ModelConfig, where: Endpoint, path: Path) -> list[str]:
    """Each rank's legacy directory (``megatron_rank_dir``), refused where two ranks that hold
    different tensors would share one: the legacy file is named by the TP, PP and EP ranks
    only, so at an expert-TP degree above TP (``megatron:tp=1,ep=2,etp=2``) two expert-TP
    ranks would write, and read, one file. Data-parallel replicas share theirs rightly."""
    pieces = where.pieces(config)
    first: dict[str, int] = {}
    dirs = []
    for rank in range(where.world):
        name = megatron_rank_dir(config, where, rank)
        other = first.setdefault(name, rank)
        if other != rank and not (pieces[other].keys() == pieces[rank].keys() and all(
                p.same_cut(pieces[rank][n]) for n, p in pieces[other].items())):
            raise CheckpointError(
                f"{where}: ranks {other} and {rank} hold different tensors, but Megatron's "
                f"legacy format names both {name} (a file per TP, PP and EP rank; expert-TP "
                f"{where.etp} is wider than TP {where.degree}): use the torch_dist format",
                path=str(path))
        dirs.append(name)
    return dirs


def _chunks(params: Mapping[str, torch.Tensor], where: Endpoint) -> dict[str, Params]:
    """A rank's stored tensors as Megatron's state dict holds them: ``model`` (or ``model{v}``
    per virtual stage, the ``model{v}.`` prefix of the harness's names taken off)."""
    if where.vpp <= 1:
        return {"model": dict(params)}
    out: dict[str, Params] = {f"model{v}": {} for v in range(where.vpp)}
    for name, x in params.items():
        chunk, _, rest = name.partition(".")
        out[chunk][rest] = x
    return out


def megatron_args(config: ModelConfig, where: Endpoint, **extra: Any) -> Any:
    """The ``args`` Namespace a Megatron checkpoint the harness writes records: the degrees
    it was saved at and the sizes ``_check_args`` reads back (megatron/training/arguments.py
    names), plus ``extra``."""
    import argparse

    pipeline = where.pipeline
    return argparse.Namespace(
        tensor_model_parallel_size=where.degree, pipeline_model_parallel_size=where.pp,
        expert_model_parallel_size=where.ep,
        # as validate_args leaves them: expert-TP defaults to TP; the rest None or False
        # unless set (what saved_at reads back)
        expert_tensor_parallel_size=where.etp or where.degree,
        virtual_pipeline_model_parallel_size=where.vpp if where.vpp > 1 else None,
        decoder_first_pipeline_num_layers=where.pp_first or None,
        decoder_last_pipeline_num_layers=where.pp_last or None,
        account_for_embedding_in_pipeline_split=pipeline.embedding,
        account_for_loss_in_pipeline_split=pipeline.loss,
        num_layers=config.n_layers,
        hidden_size=config.d_model, num_attention_heads=config.n_heads,
        group_query_attention=config.n_kv_heads != config.n_heads,
        num_query_groups=config.n_kv_heads, kv_channels=config.head_dim,
        ffn_hidden_size=config.ffn, num_experts=config.n_experts or None,
        moe_ffn_hidden_size=config.expert_ffn or None, **extra)


def write_megatron_legacy(directory: str | Path, shards: Sequence[Mapping[str, torch.Tensor]],
                          where: Endpoint, config: ModelConfig, *, iteration: int = 1) -> Path:
    """``shards`` (``where``'s rank-local tensors, a ``megatron`` endpoint) written as
    Megatron's legacy ``torch`` checkpoint: the tracker file, and per (TP, PP, EP) rank
    ``iter_{iteration:07d}/mp_rank_.../model_optim_rng.pt`` holding ``args`` (a Namespace of
    the degrees and sizes), ``checkpoint_version`` 3.0, ``iteration`` and the model (data
    parallel replicas of a rank write nothing more: they hold the same tensors). Atomic as
    ``write_checkpoint``. Returns the iteration directory."""

    out = Path(directory)
    if where.name != "megatron":
        raise CheckpointError(f"{where}: Megatron's legacy format holds a megatron endpoint",
                              path=str(out))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: not a new or empty directory", path=str(out))
    if len(shards) != where.world:
        raise CheckpointError(f"{where}: {len(shards)} rank dicts to write, expected "
                              f"{where.world}", path=str(out))
    dirs = _legacy_rank_dirs(config, where, out)
    args = megatron_args(config, where, ckpt_format="torch")
    step = f"iter_{iteration:07d}"
    with _staged(out) as stage:
        _write_text(stage / MEGATRON_TRACKER, str(iteration))
        for rank, params in enumerate(shards):
            path = stage / step / dirs[rank] / MEGATRON_FILE
            if path.exists():
                continue  # a data-parallel replica of a rank already written
            path.parent.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                        **_chunks(params, where)}, path)
    return out / step


def megatron_weights(directory: str | Path, where: Endpoint | None, config: ModelConfig, *,
                     roots: Sequence[str | Path] = ()) -> Params:
    """The canonical parameters of a Megatron checkpoint: the tracker's iteration (or
    ``release``; ``directory`` may also be an ``iter_*`` directory itself), in either format
    Megatron-Core saves.

    - ``torch_dist`` (the iteration holds ``metadata.json``): ``megatron_dist_weights``;
      ``where`` is not needed (every tensor is whole).
    - legacy ``torch``: each rank's ``model_optim_rng.pt`` of ``where``
      (``megatron:tp=2,pp=2``: the degrees it was saved at; None: the degrees its rank 0's
      ``args`` state, ``saved_at``) loaded with ``weights_only=True`` (memory-mapped),
      Megatron's own classes in it (enums and configs of its ``args`` and optimizer state)
      replaced by inert stand-ins and anything else refused naming it, TE's ``_extra_state``
      entries left out, every rank's names and shapes checked against ``where``
      (``CheckpointError`` naming the file), then written back into canonical parameters
      (``gather_canonical``).

    Where the checkpoint's ``args`` state the geometry's sizes, they are checked against
    ``config``'s."""
    from weight_sync_bench.conventions.convention import parse_endpoint
    from weight_sync_bench.conventions.megatron import MEGATRON

    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory", path=str(root))
    if where is not None and where.name != "megatron":
        raise CheckpointError(f"{root}: a Megatron checkpoint is read as a megatron endpoint, "
                              f"not {where}", path=str(root))
    files = _Files(root, tuple(roots))
    step = _megatron_step(files)
    if is_dist_checkpoint(root / step):
        return megatron_dist_weights(files, step, where or parse_endpoint("megatron",
                                                                          {"megatron": MEGATRON}),
                                     config)
    if where is None:
        where = parse_endpoint(saved_at(files, step), {"megatron": MEGATRON})
    dirs = _legacy_rank_dirs(config, where, root)
    shards: list[Params] = []
    found: list[dict[str, Path]] = []
    loaded: dict[str, Params] = {}
    for rank in range(where.world):
        rel = "/".join(p for p in (step, dirs[rank], MEGATRON_FILE) if p)
        if rel not in loaded:
            loaded[rel] = _megatron_model(files, rel, where, config)
        shards.append(loaded[rel])
        found.append(dict.fromkeys(loaded[rel], root / rel))
    _check_names_and_shapes(Checkpoint(root, shards, found), where, config)
    return gather_canonical(shards, where.pieces(config), config.param_shapes())


def saved_at(files: _Files, step: str) -> str:
    """The endpoint a legacy Megatron checkpoint was saved at, as its first rank file's
    ``args`` state it (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``expert_model_parallel_size``, ``expert_tensor_parallel_size``,
    ``virtual_pipeline_model_parallel_size``, ``decoder_first/last_pipeline_num_layers``,
    ``account_for_embedding/loss_in_pipeline_split``: megatron/training/arguments.py)."""
    base = files.root / step
    first = sorted(p for p in base.glob("mp_rank_00*") if p.is_dir())
    if not first:
        raise CheckpointError(f"{base}: no mp_rank_00* directory (a legacy Megatron "
                              "checkpoint holds one per rank)", path=str(base))
    rel = "/".join(p for p in (step, first[0].name, MEGATRON_FILE) if p)
    state = _megatron_pickle(files.checked(rel), files.root / rel)
    args = state.get("args") if isinstance(state, dict) else None
    fields = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    if "tensor_model_parallel_size" not in fields:
        raise CheckpointError(f"{files.root / rel}: no args stating the degrees it was saved "
                              "at; say them (--weights-from megatron:tp=2,pp=2)",
                              path=str(files.root / rel))

    def size(name: str) -> int:
        value = fields.get(name)
        return int(value) if isinstance(value, int) and value > 0 else 0

    items = [f"tp={size('tensor_model_parallel_size') or 1}"]
    for key, arg in (("pp", "pipeline_model_parallel_size"), ("ep", "expert_model_parallel_size"),
                     ("vpp", "virtual_pipeline_model_parallel_size"),
                     ("pp_first", "decoder_first_pipeline_num_layers"),
                     ("pp_last", "decoder_last_pipeline_num_layers")):
        if size(arg) > 1 or (key.startswith("pp_") and size(arg)):
            items.append(f"{key}={size(arg)}")
    etp = size("expert_tensor_parallel_size")
    if etp and etp != (size("tensor_model_parallel_size") or 1):
        items.append(f"etp={etp}")
    embedding = bool(fields.get("account_for_embedding_in_pipeline_split"))
    loss = bool(fields.get("account_for_loss_in_pipeline_split"))
    if embedding or loss:
        items.append("pp_account=" + ("both" if embedding and loss else
                                      "embedding" if embedding else "loss"))
    return "megatron:" + ",".join(items)


def is_megatron_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` is laid out as a Megatron checkpoint: its tracker file, or one
    iteration's ``mp_rank_*`` directories (legacy) or ``metadata.json`` (torch_dist)."""
    root = Path(directory)
    return root.is_dir() and ((root / MEGATRON_TRACKER).exists() or _holds_ranks(root)
                              or is_dist_checkpoint(root))


def _holds_ranks(root: Path) -> bool:
    return any(p.name.startswith("mp_rank_") for p in root.iterdir())


def _megatron_step(files: _Files) -> str:
    """The iteration directory to read, relative to the checkpoint's root ("" where the root
    holds the ``mp_rank_*`` directories itself)."""
    root = files.root
    if _holds_ranks(root) or is_dist_checkpoint(root):
        return ""
    if not (root / MEGATRON_TRACKER).exists():
        raise CheckpointError(f"{root / MEGATRON_TRACKER}: missing (a Megatron checkpoint "
                              "directory has it, or is an iter_* directory holding mp_rank_*)",
                              path=str(root / MEGATRON_TRACKER))
    # read as text, as Megatron-LM's training/checkpointing.py read_metadata reads it
    said = read_bounded(files.checked(MEGATRON_TRACKER), shown=root / MEGATRON_TRACKER
                        ).decode("utf-8", "replace").strip()
    if said == "release":
        return "release"
    if not said.isdigit():
        raise CheckpointError(f"{root / MEGATRON_TRACKER}: {said[:40]!r} is neither an "
                              "iteration nor 'release'", path=str(root / MEGATRON_TRACKER))
    return f"iter_{int(said):07d}"


class MegatronObject:
    """An inert stand-in for one of Megatron's own classes in a checkpoint's pickle (an enum
    of its ``args``, an optimizer config): it keeps what it was built with and runs
    nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _safe_globals() -> list[Any]:
    """What a Megatron legacy checkpoint's pickle may name besides tensors, as Megatron's own
    ``safe_globals.SAFE_GLOBALS`` allows: stdlib and numpy types, under both numpy 1's and
    numpy 2's names of the array reconstructor. A ``Path`` pickles as its concrete class,
    ``PosixPath`` here, which is the name Megatron allows (megatron/core/safe_globals.py,
    2025: ``SimpleNamespace, PosixPath, _reconstruct, ndarray, dtype, UInt32DType,
    Namespace`` and its own enums)."""
    import argparse
    import io
    import pathlib
    import signal
    import types

    import numpy
    from numpy.core.multiarray import _reconstruct

    return [argparse.Namespace, types.SimpleNamespace, Path, pathlib.PosixPath, io.BytesIO,
            signal.Signals, torch._C.Generator, numpy.ndarray, numpy.dtype,
            type(numpy.dtype("uint32")),
            (_reconstruct, "numpy.core.multiarray._reconstruct"),
            (_reconstruct, "numpy._core.multiarray._reconstruct")]


def _megatron_pickle(source: Path | io.BytesIO, path: Path) -> Any:
    """What a Megatron ``torch.save`` holds (a rank file, or the common state of a
    ``torch_dist`` checkpoint), loaded with ``weights_only=True`` (a file memory-mapped):
    Megatron's own classes replaced by ``MegatronObject`` stand-ins, any other global refused
    naming it (``CheckpointError`` naming ``path``): nothing in it runs."""
    stand_ins: list[str] = []
    while True:
        try:
            if isinstance(source, io.BytesIO):
                source.seek(0)
            with torch.serialization.safe_globals(
                    _safe_globals() + [(MegatronObject, n) for n in stand_ins]):
                return torch.load(source, map_location="cpu", weights_only=True,
                                  mmap=isinstance(source, Path))
        except pickle.UnpicklingError as exc:
            named = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            name = named.group(1) if named else None
            if name is None or not name.startswith("megatron.") or name in stand_ins \
                    or len(stand_ins) > 64:
                raise CheckpointError(f"{path}: refused, its pickle holds more than tensors and "
                                      f"Megatron's own records ({_refused_pickle(exc)})",
                                      path=str(path)) from None
            stand_ins.append(name)
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable torch checkpoint, truncated or "
                                  f"corrupt ({type(exc).__name__}: {_refused_pickle(exc)})",
                                  path=str(path)) from None


def _megatron_model(files: _Files, rel: str, where: Endpoint, config: ModelConfig) -> Params:
    """One rank file's model tensors under the harness's names (``model{v}.`` prefixed per
    virtual stage), TE's ``_extra_state`` left out."""
    path = files.root / rel
    state = _megatron_pickle(files.checked(rel, missing=f"{where} saves one per (TP, PP, EP) "
                                                         "rank"), path)
    keys = ["model"] if where.vpp <= 1 else [f"model{v}" for v in range(where.vpp)]
    if isinstance(state, dict):
        _check_args(path, state.get("args"), config)
    if not isinstance(state, dict) or any(not isinstance(state.get(k), dict) for k in keys):
        raise CheckpointError(f"{path}: no {' and '.join(keys)} state dict (saved at another "
                              f"virtual-stage count than {where}, or not Megatron's)",
                              path=str(path))
    out: Params = {}
    for v, key in enumerate(keys):
        prefix = f"model{v}." if where.vpp > 1 else ""
        for name, x in state[key].items():
            if name.endswith("._extra_state") or name == "_extra_state":
                continue  # Transformer Engine's FP8 metadata: not a weight
            if not isinstance(x, torch.Tensor):
                raise CheckpointError(f"{path}: {key}[{name!r}] is a {type(x).__name__}, not a "
                                      "tensor", path=str(path))
            out[prefix + name] = x
    return out


def _refused_pickle(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, without torch's advice to rerun
    it with ``weights_only=False`` (which would run the pickle's code): the lines that name
    what the pickle calls."""
    named = re.findall(r"Unsupported (?:global: GLOBAL|operand) \S+", str(exc))
    if named:  # what the pickle calls, and nothing of torch's advice around it
        return "; ".join(dict.fromkeys(named))
    said = [line.strip() for line in str(exc).splitlines()
            if line.strip() and "weights_only" not in line and "trust" not in line
            and "documentation" not in line and "can still be loaded" not in line]
    return "; ".join(said) or type(exc).__name__


def _read_meta(files: _Files, degree: int) -> tuple[list[Params], list[dict[str, Path]]]:
    root = files.root
    expected = [root / META_FILE.format(rank=r) for r in range(degree)]
    _strays(root, ".pth", {p.name for p in expected},
            f"consolidated.00.pth .. consolidated.{degree - 1:02d}.pth, one per rank at t={degree}")
    shards, where = [], []
    for path in expected:
        resolved = files.checked(path.name, missing=f"meta:{degree} has one consolidated file "
                                 "per model-parallel rank")
        try:
            loaded = torch.load(resolved, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (meta:{degree} has one consolidated file "
                                  "per model-parallel rank)", path=str(path)) from None
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{path}: refused, its pickle holds more than tensors, which "
                                  f"the harness never loads ({_refused_pickle(exc)})",
                                  path=str(path)) from None
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable torch checkpoint, truncated or "
                                  f"corrupt ({type(exc).__name__}: {_refused_pickle(exc)})",
                                  path=str(path)) from None
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise CheckpointError(f"{path}: not a dict of tensor name -> tensor",
                                  path=str(path))
        shards.append(loaded)
        where.append(dict.fromkeys(loaded, path))
    return shards, where


def _read_ranks(files: _Files, degree: int, *, lazy: bool = False,
                needed: Sequence[int] | None = None
                ) -> tuple[list[Any], list[dict[str, Path]]]:
    """Each rank's tensors from its files (``lazy``: a ``LazyTensors`` over the checked files,
    read from their headers only) and the file of each; ``needed``: the ranks whose files
    must be there (default all; another's missing files leave it empty)."""
    root = files.root
    pattern = RANK_FILE.format(rank="{rank}", part="{part}")
    parts: dict[int, list[tuple[int, Path]]] = {}
    for path in sorted(root.glob("*.safetensors")):
        match = _RANK_RE.fullmatch(path.name)
        if match is None:
            raise CheckpointError(f"{path}: not named {pattern} (one file per rank, vLLM's "
                                  "sharded-state pattern)", path=str(path))
        rank, part = int(match[1]), int(match[2])
        if rank >= degree:
            raise CheckpointError(f"{path}: rank {rank}, but the checkpoint is checked at "
                                  f"t={degree} (ranks 0..{degree - 1})", path=str(path))
        parts.setdefault(rank, []).append((part, path))
    shards, found = [], []
    for rank in range(degree):
        if rank not in parts and needed is not None and rank not in needed:
            shards.append(LazyTensors({}, files) if lazy else {})
            found.append({})
            continue
        if rank not in parts:
            path = root / RANK_FILE.format(rank=rank, part=0)
            raise CheckpointError(f"{path}: missing (no {RANK_FILE.format(rank=rank, part='*')}"
                                  f" for rank {rank} of t={degree})", path=str(path))
        params: Params = {}
        where: dict[str, Path] = {}
        for _, path in sorted(parts[rank]):
            if lazy:
                with _opened(files.checked(path.name)) as f:
                    held = dict.fromkeys(f.keys())
            else:
                held = files.safetensors(path.name)
            for name, x in held.items():
                if name in params:
                    raise CheckpointError(f"{path}: {name} is also in {where[name].name}",
                                          path=str(path))
                params[name], where[name] = x, path
        shards.append(LazyTensors({n: p.name for n, p in where.items()}, files) if lazy
                      else params)
        found.append(where)
    return shards, found


def _check_names_and_shapes(checkpoint: Checkpoint, where: Endpoint, config: ModelConfig
                            ) -> None:
    if where.quantized:
        from weight_sync_bench.conventions.fp8 import fp8_shapes

        declared = fp8_shapes(config, where)
        _check_fp8_config(checkpoint, where)
        shapes = [{n: shape for n, (shape, _) in rank.items()} for rank in declared]
        for rank, (params, want) in enumerate(zip(checkpoint.shards, declared)):
            for name, (_, dtype) in want.items():
                if dtype is not None and name in params and params[name].dtype != dtype:
                    path = checkpoint.file_of(rank, name)
                    raise CheckpointError(f"{path}: {where} rank {rank} {name} is "
                                          f"{params[name].dtype}, declared {dtype}",
                                          path=str(path))
    else:
        shapes = where.convention.local_shapes(config, where)
    for rank, (params, expected) in enumerate(zip(checkpoint.shards, shapes)):
        rank_files = sorted(set(checkpoint.files[rank].values())) or [checkpoint.directory]
        label = ", ".join(str(p) for p in rank_files)
        missing = [n for n in expected if n not in params]
        if missing:
            raise CheckpointError(f"{label}: {where} rank {rank} is missing "
                                  f"{', '.join(missing[:4])}"
                                  + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""),
                                  path=str(rank_files[0]))
        for name in params:
            if name not in expected:
                tied = (" (tied embeddings: the output layer reads the embedding table, not a "
                        "stored copy)" if config.tie_embeddings else "")
                raise CheckpointError(f"{checkpoint.file_of(rank, name)}: {where} rank {rank} "
                                      f"has no tensor {name}{tied}",
                                      path=str(checkpoint.file_of(rank, name)))
        for name, want in expected.items():
            actual = tuple(params[name].shape)
            if actual != want:
                raise CheckpointError(f"{checkpoint.file_of(rank, name)}: {where} rank {rank} "
                                      f"{name} has shape {list(actual)}, declared {list(want)}",
                                      path=str(checkpoint.file_of(rank, name)))


# Megatron-Core's ``torch_dist`` format: PyTorch Distributed Checkpoint underneath.
# Followed: NVIDIA/Megatron-LM d98e8a64 (core 0.20.0): ``dist_checkpointing/core.py``
# (``metadata.json``, ``CONFIG_FNAME``: ``{"sharded_backend": "torch_dist", ...}``, which
# makes a directory a distributed checkpoint), ``serialization.py::save`` (the non-tensor state
# as one ``ShardedObject("common_state")``, a ``torch.save``d list holding the dict;
# ``load_common_state_dict`` reads it, or a ``common.pt`` beside the data in older
# checkpoints), ``strategies/torch.py`` (each ``ShardedTensor`` is a DCP tensor under its
# global key), ``transformer/transformer_block.py::TransformerBlock.sharded_state_dict`` (a
# homogeneous decoder's layers stacked on a new leading axis under ``decoder.layers.<rest>``;
# ``decoder.layers.<global i>.<rest>`` where layers differ, ``moe_layer_freq > 1``),
# ``transformer/moe/experts.py::TEGroupedMLP`` / ``SequentialMLP.sharded_state_dict``
# (experts on the next axis, ``mlp.experts.experts.linear_fc{1,2}.weight``, interchangeable
# between the two), ``transformer/mlp.py::apply_swiglu_sharded_factory`` (fc1's gate chunks
# of every TP rank, then the up chunks: ``[gate; up]`` whole). Every tensor is stored whole
# (the concatenation of the TP shards: ``megatron`` at TP 1), the vocabulary padded as the
# saving run padded it.
DIST_CONFIG = "metadata.json"
DIST_COMMON = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,))
DIST_COMMON_LEGACY = "common.pt"  # strategies/common.py COMMON_STATE_FNAME
DIST_METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem
_DIST_FILE_RE = re.compile(r"__\d+_\d+\.distcp")
_DIST_EXPERT_RE = re.compile(
    r"mlp\.experts\.(?:(linear_fc[12])\.weight(\d+)|local_experts\.(\d+)\.(linear_fc[12])\.weight)")
# What a DCP ``.metadata`` pickle may name (torch 2.13's Metadata and its parts, records
# that build nothing but themselves): anything else is refused before it is built.
_DIST_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    # Megatron-Core's save keeps every rank's plan in the metadata (``all_local_plans``)
    *(("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"))})


# Where Megatron-Core's local layer spec saves what the TE spec names otherwise: an MoE
# layer's pre-MLP norm (``get_gpt_layer_local_spec``'s ``sharded_state_dict_keys_map`` maps
# ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_`` whatever the MLP; seen in a
# checkpoint saved by megatron-core 0.16.1, tests/data/megatron_core/moe_tp1).
_DIST_ALIASES = {"decoder.layers.{i}.pre_mlp_layernorm.weight":
                 ("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",)}


def dist_key(name: str, *, stacked: bool = True) -> tuple[str, tuple[int, ...]]:
    """The ``torch_dist`` key that holds a ``megatron`` (TP 1) tensor, and its index along
    the key's leading axes: ``decoder.layers.3.self_attention.linear_qkv.weight`` ->
    ``("decoder.layers.self_attention.linear_qkv.weight", (3,))``; expert j of layer 3 ->
    ``("decoder.layers.mlp.experts.experts.linear_fc1.weight", (3, j))``. ``stacked=False``:
    the per-layer keys of a decoder whose layers differ (``decoder.layers.3....``, experts
    ``(j,)``)."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return name, ()
    layer, rest = int(m[1]), m[2]
    prefix, index = ("decoder.layers.", (layer,)) if stacked else (f"decoder.layers.{layer}.", ())
    expert = _DIST_EXPERT_RE.fullmatch(rest)
    if expert is not None:
        fc, j = (expert[1], int(expert[2])) if expert[1] else (expert[4], int(expert[3]))
        return f"{prefix}mlp.experts.experts.{fc}.weight", (*index, j)
    return prefix + rest, index


def is_dist_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` (an ``iter_*`` directory) is a distributed checkpoint: its
    ``metadata.json`` states a ``sharded_backend`` (``check_is_distributed_checkpoint``,
    ``CheckpointingConfig``); another file of that name (an HF directory's) is not one."""
    path = Path(directory) / DIST_CONFIG
    if not path.is_file() or path.is_symlink():
        return False
    try:
        stated = json.loads(read_bounded(path, shown=path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError):
        return False
    return isinstance(stated, dict) and isinstance(stated.get("sharded_backend"), str)


def _dist_pieces(where: Endpoint, config: ModelConfig) -> dict[str, Any]:
    """``megatron`` at TP 1 with the vocabulary as it is: the whole tensors torch_dist keys
    hold, the embedding and output rows before the saving run's padding."""
    from weight_sync_bench.conventions.convention import Endpoint

    (pieces,) = Endpoint(where.convention, 1, options=(("vocab", "unpadded"),)).pieces(config)
    return pieces


def _dist_classes() -> tuple[type, type]:
    """A DCP reader whose ``.metadata`` is unpickled naming only DCP's own records (torch's
    ``FileSystemReader.read_metadata`` is a plain ``pickle.load``) and whose data files are
    checked plain names inside the directory, and a load planner that keeps bytes as bytes
    (torch's ``DefaultLoadPlanner.load_bytes`` is ``torch.load(weights_only=False)``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in _DIST_GLOBALS or (
                    module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")

    class Reader(FileSystemReader):
        def __init__(self, files: _Files, step: str) -> None:
            super().__init__(str(files.root / step))
            self.files, self.step = files, step
            self.parsed: Metadata | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if self.parsed is None:  # once per reader: Megatron's holds every rank's plan
                self.parsed = self._parse()
            self.parsed.storage_meta.load_id = self.load_id
            return self.parsed

        def _parse(self) -> Metadata:
            rel = "/".join(p for p in (self.step, DIST_METADATA) if p)
            path = self.files.root / rel
            resolved = self.files.checked(rel, missing="DCP's index of the tensors")
            try:
                with open(resolved, "rb") as f:
                    metadata = Unpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError,
                    KeyError, IndexError, ImportError) as exc:
                raise CheckpointError(f"{path}: refused, not DCP's metadata "
                                      f"({_refused_pickle(exc)})", path=str(path)) from None
            if not isinstance(metadata, Metadata) or not isinstance(
                    metadata.storage_data, dict):
                raise CheckpointError(f"{path}: not DCP's metadata (a "
                                      f"{type(metadata).__name__})", path=str(path))
            named: set[str] = set()
            for info in metadata.storage_data.values():
                rel_file = getattr(info, "relative_path", None)
                if not isinstance(rel_file, str) or not _DIST_FILE_RE.fullmatch(rel_file):
                    raise CheckpointError(f"{path}: names the data file {rel_file!r}; DCP's "
                                          "are __<rank>_<n>.distcp inside the directory",
                                          path=str(path))
                if getattr(info, "transform_descriptors", None):  # compressed: unbounded
                    raise CheckpointError(f"{path}: {rel_file} is stored through "
                                          f"{list(info.transform_descriptors)}; the harness "
                                          "reads plain DCP data only (Megatron writes it)",
                                          path=str(path))
                named.add(rel_file)
            for rel_file in sorted(named):
                self.files.checked("/".join(p for p in (self.step, rel_file) if p),
                                   what=f"{DIST_METADATA} names it",
                                   missing=f"{DIST_METADATA} names it")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            dest = self.state_dict[read_item.dest_index.fqn]  # the caller's BytesIO
            dest.seek(0)
            dest.truncate()
            dest.write(value.read())

    return Reader, Planner


def _dist_load(files: _Files, step: str, wanted: dict[str, Any], reader: Any = None
               ) -> dict[str, Any]:
    """``wanted`` (key -> an empty tensor of its stored shape and dtype, or a ``BytesIO``)
    filled from the checkpoint by DCP on CPU, in this process (``no_dist``)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_class, planner = _dist_classes()
    reader = reader if reader is not None else reader_class(files, step)
    path = files.root / step
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": it is
            dcp.load(wanted, storage_reader=reader,
                     planner=planner(flatten_state_dict=False), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # a BaseException: a rank's failure
        inner: BaseException = exc  # wrapped, (exception, traceback) per rank
        for cause in (exc.failures.values() if isinstance(exc, CheckpointException) else ()):
            inner = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"{path}: not a readable torch_dist checkpoint, truncated or "
                              f"corrupt ({type(inner).__name__}: {_refused_pickle(inner)})",
                              path=str(path)) from None
    return wanted


def _dist_reader(files: _Files, step: str) -> Any:
    """The one DCP reader of a checkpoint read (its metadata parsed and checked once)."""
    reader, _ = _dist_classes()
    return reader(files, step)


def dist_common(files: _Files, step: str, reader: Any = None) -> dict[str, Any]:
    """A torch_dist checkpoint's common state (``args``, ``iteration``, ...): the
    ``common_state`` object, or an older checkpoint's ``common.pt``, loaded as a legacy rank
    file is (``MegatronObject`` stand-ins, nothing run)."""
    legacy = "/".join(p for p in (step, DIST_COMMON_LEGACY) if p)
    if (files.root / legacy).exists():
        state = _megatron_pickle(files.checked(legacy), files.root / legacy)
    else:
        reader = reader if reader is not None else _dist_reader(files, step)
        metadata = reader.read_metadata()
        path = files.root / step
        if DIST_COMMON not in metadata.state_dict_metadata:
            raise CheckpointError(f"{path}: no common state (neither {DIST_COMMON_LEGACY} nor "
                                  f"a {DIST_COMMON} object)", path=str(path))
        raw = _dist_load(files, step, {DIST_COMMON: io.BytesIO()}, reader)[DIST_COMMON]
        held = _megatron_pickle(raw, path / DIST_COMMON)
        if isinstance(held, io.BytesIO):  # DCP torch.saves the BytesIO Megatron hands it
            held = _megatron_pickle(held, path / DIST_COMMON)
        state = held[0] if isinstance(held, list) and held else held
    if not isinstance(state, dict):
        raise CheckpointError(f"{files.root / step}: the common state is a "
                              f"{type(state).__name__}, not a dict", path=str(files.root / step))
    return state


def megatron_dist_weights(files: _Files, step: str, where: Endpoint, config: ModelConfig
                          ) -> Params:
    """The canonical parameters of a torch_dist checkpoint's ``step`` directory: each key
    read whole by DCP (one key beyond the result in memory at a time), every declared tensor
    present with its declared shape (the embedding and output layer with at least the
    vocabulary's rows: the rest is the saving run's padding, left out), the Megatron records
    of its ``args`` checked against ``config``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = files.root / step
    backend = files.json("/".join(p for p in (step, DIST_CONFIG) if p)).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(f"{path / DIST_CONFIG}: sharded_backend {backend!r}; the harness "
                              "reads torch_dist (Megatron's zarr format is deprecated there)",
                              path=str(path / DIST_CONFIG))
    reader = _dist_reader(files, step)
    metadata = reader.read_metadata()
    held = metadata.state_dict_metadata
    _check_args(path, dist_common(files, step, reader).get("args"), config)
    pieces = _dist_pieces(where, config)
    shapes = config.param_shapes()
    by_key: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name in pieces:
        for stored in (name, *_DIST_ALIASES.get(re.sub(r"\.\d+\.", ".{i}.", name, 1), ())):
            stored = stored.replace("{i}", name.split(".")[2]) if "{i}" in stored else stored
            key, index = dist_key(stored)
            if key not in held:
                key, index = dist_key(stored, stacked=False)
            if key in held:
                break
        if key not in held:
            raise CheckpointError(f"{path}: torch_dist holds no {dist_key(name)[0]} (nor "
                                  f"{key}), where {name} is kept", path=str(path))
        by_key.setdefault(key, []).append((name, index))
    stored: Params = {}
    for key, names in by_key.items():
        md = held[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{path}: {key} is not a tensor", path=str(path))
        size = tuple(md.size)
        _check_chunks(path, key, size, md.chunks)
        for name, index in names:
            want = pieces[name].local_shape(shapes[pieces[name].source])
            got = size[len(index):]
            vocab_rows = name in ("embedding.word_embeddings.weight", "output_layer.weight")
            # the leading axes are the layers (and the experts) exactly; the vocabulary rows
            # at most its padding to 128 x a TP degree of 1024
            lead = (config.n_layers, config.n_experts)[:len(index)] if index and (
                key.startswith("decoder.layers.") and not key[15].isdigit()) else ()
            fits = (got[1:] == want[1:] and want[0] <= got[0] < want[0] + 128 * 1024) \
                if vocab_rows else got == want
            if len(size) < len(index) or any(i >= n for i, n in zip(index, size)) or not fits \
                    or (lead and tuple(size[:len(lead)]) != lead):
                raise CheckpointError(f"{path}: torch_dist {key} has shape {list(size)}; "
                                      f"{name} declares {list(want)}"
                                      + (f" at index {list(index)}" if index else "")
                                      + (f", on leading axes of {list(lead)} (the layers, "
                                         "the experts)" if lead else ""),
                                      path=str(path))
        try:
            empty = torch.empty(size, dtype=md.properties.dtype)
        except (RuntimeError, MemoryError, TypeError) as exc:
            raise CheckpointError(f"{path}: torch_dist {key} of shape {list(size)} cannot be "
                                  f"held ({type(exc).__name__})", path=str(path)) from None
        full = _dist_load(files, step, {key: empty}, reader)[key]
        for name, index in names:
            x = full[index] if index else full
            want = pieces[name].local_shape(shapes[pieces[name].source])
            stored[name] = x.narrow(0, 0, want[0]).clone()
        del full
    return gather_canonical([stored], [pieces], shapes)


def _check_chunks(path: Path, key: str, size: tuple[int, ...], chunks: Any) -> None:
    """``CheckpointError`` unless ``chunks`` (DCP's ``ChunkStorageMetadata`` of ``key``)
    tile its ``size`` exactly: each inside it, none overlapping another, their volumes
    summing to its own. DCP fills only the chunks it is told of: a gap would leave the
    tensor's memory as it was allocated."""
    boxes = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise CheckpointError(f"{path}: torch_dist {key}: a chunk at {list(offsets)} of "
                                  f"{list(sizes)} lies outside its shape {list(size)}",
                                  path=str(path))
        boxes.append((offsets, sizes))
    if sum(math.prod(n) for _, n in boxes) != math.prod(size):
        raise CheckpointError(f"{path}: torch_dist {key}: its chunks hold "
                              f"{sum(math.prod(n) for _, n in boxes)} elements of "
                              f"{math.prod(size)}", path=str(path))
    boxes.sort()
    for i, (a, n) in enumerate(boxes):
        for b, m in boxes[i + 1:]:
            if b[0] >= a[0] + n[0]:
                break  # sorted by the first offset: no later box meets this one
            if all(x < y + k and y < x + j for x, j, y, k in zip(a, n, b, m)):
                raise CheckpointError(f"{path}: torch_dist {key}: chunks at {list(a)} and "
                                      f"{list(b)} overlap", path=str(path))


# The ``args`` fields that state the geometry (megatron/training/arguments.py), beside the
# config's; a field the checkpoint does not hold is not checked.
_ARGS_GEOMETRY = (("num_layers", "n_layers"), ("hidden_size", "d_model"),
                  ("num_attention_heads", "n_heads"), ("kv_channels", "head_dim"),
                  ("ffn_hidden_size", "ffn"), ("num_experts", "n_experts"),
                  ("moe_ffn_hidden_size", "expert_ffn"))


def _check_args(path: Path, args: Any, config: ModelConfig) -> None:
    """``CheckpointError`` where a Megatron checkpoint's ``args`` state another geometry
    than ``config``'s (the field, both values)."""
    if args is None:
        return
    fields = dict(vars(args)) if hasattr(args, "__dict__") else {}
    groups = fields.get("num_query_groups") if fields.get("group_query_attention", True) \
        else fields.get("num_attention_heads")
    stated = [*((a, fields.get(a), getattr(config, c)) for a, c in _ARGS_GEOMETRY),
              ("num_query_groups", groups, config.n_kv_heads)]
    for arg, value, want in stated:
        if value is None or (arg == "ffn_hidden_size" and not config.has_dense_mlp) or (
                arg in ("num_experts", "moe_ffn_hidden_size") and not config.n_experts):
            continue
        if value != want:
            raise CheckpointError(f"{path}: its args say {arg}={value!r}, the config checked "
                                  f"({config.name}) has {want!r}", path=str(path))


def write_megatron_dist(directory: str | Path, params: Mapping[str, torch.Tensor],
                        where: Endpoint, config: ModelConfig, *, iteration: int = 1,
                        stacked: bool = True) -> Path:
    """Canonical ``params`` written as Megatron-Core's ``torch_dist`` checkpoint, as a run at
    ``where``'s TP degree saves it: the tracker file, ``iter_{iteration:07d}/`` with
    ``metadata.json``, DCP's ``.metadata`` and ``__0_0.distcp`` (every tensor whole, the
    layers stacked unless ``stacked=False``, the vocabulary rows padded as ``where`` pads
    them, the padding rows filled with 7, not zeros: Megatron initializes them as any row), and
    the common state
    (``args`` with the degrees and sizes, ``checkpoint_version``, ``iteration``). Atomic as
    ``write_checkpoint``. Returns the iteration directory."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from weight_sync_bench.conventions.megatron import padded_vocab

    out = Path(directory)
    if where.name != "megatron":
        raise CheckpointError(f"{where}: Megatron's torch_dist format holds a megatron "
                              "endpoint", path=str(out))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: not a new or empty directory", path=str(out))
    pieces = _dist_pieces(where, config)
    rows = (padded_vocab(config.vocab, where.degree) if where.option("vocab") == "padded"
            else config.vocab)
    grouped: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    for name, piece in pieces.items():
        x = piece.take(params[piece.source])
        if name in ("embedding.word_embeddings.weight", "output_layer.weight") \
                and rows > x.shape[0]:
            x = torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), 7.0)])
        key, index = dist_key(name, stacked=stacked)
        grouped.setdefault(key, {})[index] = x
    state: dict[str, Any] = {}
    for key, members in grouped.items():
        if list(members) == [()]:
            state[key] = members[()]
            continue
        dims = [max(i[d] for i in members) + 1 for d in range(len(next(iter(members))))]
        first = next(iter(members.values()))
        full = first.new_empty((*dims, *first.shape))
        for index, x in members.items():
            full[index] = x
        state[key] = full
    args = megatron_args(config, where, ckpt_format="torch_dist", padded_vocab_size=rows)
    common = io.BytesIO()
    torch.save([{"args": args, "checkpoint_version": 3.0, "iteration": iteration}], common)
    state[DIST_COMMON] = common
    step = f"iter_{iteration:07d}"
    with _staged(out) as stage:
        _write_text(stage / MEGATRON_TRACKER, str(iteration))
        (stage / step).mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": one process
            dcp.save(state, storage_writer=FileSystemWriter(str(stage / step)),
                     planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
        _write_text(stage / step / DIST_CONFIG,
                    json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    return out / step


def read_weights(directory: str | Path, config: ModelConfig, *, where: Endpoint | None = None,
                 roots: Sequence[str | Path] = ()) -> Mapping[str, torch.Tensor]:
    """The canonical parameters of the weights a check starts from, read from a checkpoint
    directory: a Megatron checkpoint (``is_megatron_checkpoint``; ``megatron_weights``, in
    either format, ``where`` the degrees a legacy one was saved at, else its ``args``'), or a
    Hugging Face directory (``hf_weights``, ``where`` an ``hf`` endpoint for its experts'
    layout, default ``hf``). The one place a check's ``weights=`` / ``--weights`` is read."""
    from weight_sync_bench.conventions.convention import parse_endpoint
    from weight_sync_bench.conventions.hf import HF

    if where is not None and where.name == "megatron" or (
            where is None and is_megatron_checkpoint(directory)):
        return megatron_weights(directory, where, config, roots=roots)
    return hf_weights(directory, where or parse_endpoint("hf", {"hf": HF}), config, roots=roots)


def _check_fp8_config(checkpoint: Checkpoint, where: Endpoint) -> None:
    """An FP8 checkpoint with a ``config.json`` states its ``quantization_config`` as the
    harness's reference quantizer makes it (e4m3; block 128 x 128, or no block size per
    tensor): ``CheckpointError`` naming the file where it does not."""
    from weight_sync_bench.conventions.fp8 import quantization_config, scheme_of

    path = checkpoint.directory / HF_CONFIG
    if not path.is_file():
        return
    try:
        data = json.loads(read_bounded(path, shown=path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})", path=str(path)) from None
    stated = data.get("quantization_config") if isinstance(data, dict) else None
    # what vLLM's Fp8Config reads (``fmt`` it does not: HF's FineGrainedFP8Config omits it);
    # a per-tensor checkpoint states no weight_block_size
    want = {k: v for k, v in quantization_config(scheme_of(where)).items() if k != "fmt"}
    keys = (*want, "weight_block_size")
    if not isinstance(stated, dict) or any(stated.get(k) != want.get(k) for k in keys):
        raise CheckpointError(f"{path}: {where} expects quantization_config {want}, the file "
                              f"states {stated!r}", path=str(path))
