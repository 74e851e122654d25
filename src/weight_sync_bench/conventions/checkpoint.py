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
    removed when it raises. File modes set to what the umask gives a new file; an
    ``OSError`` (or safetensors' error) becomes a ``CheckpointError`` naming the path."""
    import shutil

    from safetensors import SafetensorError

    stage = out.parent / STAGE.format(name=out.name, pid=os.getpid())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _stale_stages(out)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        yield stage
        mode = 0o666 & ~_umask()
        for path in stage.iterdir():
            path.chmod(mode)
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
                      if p.span is not None and p.stack == 1 and p.dim == pieces[0].dim)
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


def write_megatron_legacy(directory: str | Path, shards: Sequence[Mapping[str, torch.Tensor]],
                          where: Endpoint, config: ModelConfig, *, iteration: int = 1) -> Path:
    """``shards`` (``where``'s rank-local tensors, a ``megatron`` endpoint) written as
    Megatron's legacy ``torch`` checkpoint: the tracker file, and per (TP, PP, EP) rank
    ``iter_{iteration:07d}/mp_rank_.../model_optim_rng.pt`` holding ``args`` (a Namespace of
    the degrees and sizes), ``checkpoint_version`` 3.0, ``iteration`` and the model (data
    parallel replicas of a rank write nothing more: they hold the same tensors). Atomic as
    ``write_checkpoint``. Returns the iteration directory."""
    import argparse

    out = Path(directory)
    if where.name != "megatron":
        raise CheckpointError(f"{where}: Megatron's legacy format holds a megatron endpoint",
                              path=str(out))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: not a new or empty directory", path=str(out))
    if len(shards) != where.world:
        raise CheckpointError(f"{where}: {len(shards)} rank dicts to write, expected "
                              f"{where.world}", path=str(out))
    args = argparse.Namespace(
        tensor_model_parallel_size=where.degree, pipeline_model_parallel_size=where.pp,
        expert_model_parallel_size=where.ep, num_layers=config.n_layers,
        hidden_size=config.d_model, num_attention_heads=config.n_heads,
        num_query_groups=config.n_kv_heads, ffn_hidden_size=config.ffn, ckpt_format="torch")
    step = f"iter_{iteration:07d}"
    with _staged(out) as stage:
        _write_text(stage / MEGATRON_TRACKER, str(iteration))
        for rank, params in enumerate(shards):
            path = stage / step / megatron_rank_dir(config, where, rank) / MEGATRON_FILE
            if path.exists():
                continue  # a data-parallel replica of a rank already written
            path.parent.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                        **_chunks(params, where)}, path)
        mode = 0o666 & ~_umask()
        for path in (stage / step).rglob("*"):
            path.chmod(mode | (0o111 & ~_umask()) if path.is_dir() else mode)
    return out / step


def megatron_weights(directory: str | Path, where: Endpoint, config: ModelConfig, *,
                     roots: Sequence[str | Path] = ()) -> Params:
    """The canonical parameters of a Megatron legacy ``torch`` checkpoint of ``where``
    (``megatron:tp=2,pp=2``: the degrees it was saved at): the tracker's iteration (or
    ``release``; ``directory`` may also be an ``iter_*`` directory itself), each rank's
    ``model_optim_rng.pt`` loaded with ``weights_only=True`` (memory-mapped), Megatron's own
    classes in it (enums and configs of its ``args`` and optimizer state) replaced by inert
    stand-ins and anything else refused naming it, TE's ``_extra_state`` entries left out,
    every rank's names and shapes checked against ``where`` (``CheckpointError`` naming the
    file), then written back into canonical parameters (``gather_canonical``)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory", path=str(root))
    if where.name != "megatron":
        raise CheckpointError(f"{root}: a Megatron checkpoint is read as a megatron endpoint, "
                              f"not {where}", path=str(root))
    files = _Files(root, tuple(roots))
    step = _megatron_step(files)
    shards: list[Params] = []
    found: list[dict[str, Path]] = []
    loaded: dict[str, Params] = {}
    for rank in range(where.world):
        rel = "/".join(p for p in (step, megatron_rank_dir(config, where, rank), MEGATRON_FILE)
                       if p)
        if rel not in loaded:
            loaded[rel] = _megatron_model(files, rel, where)
        shards.append(loaded[rel])
        found.append(dict.fromkeys(loaded[rel], root / rel))
    _check_names_and_shapes(Checkpoint(root, shards, found), where, config)
    return gather_canonical(shards, where.pieces(config), config.param_shapes())


def is_megatron_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` is laid out as a Megatron legacy checkpoint: its tracker file,
    or the ``mp_rank_*`` directories of one iteration."""
    root = Path(directory)
    return root.is_dir() and ((root / MEGATRON_TRACKER).exists() or _holds_ranks(root))


def _holds_ranks(root: Path) -> bool:
    return any(p.name.startswith("mp_rank_") for p in root.iterdir())


def _megatron_step(files: _Files) -> str:
    """The iteration directory to read, relative to the checkpoint's root ("" where the root
    holds the ``mp_rank_*`` directories itself)."""
    root = files.root
    if _holds_ranks(root):
        return ""
    if not (root / MEGATRON_TRACKER).exists():
        raise CheckpointError(f"{root / MEGATRON_TRACKER}: missing (a Megatron checkpoint "
                              "directory has it, or is an iter_* directory holding mp_rank_*)",
                              path=str(root / MEGATRON_TRACKER))
    said = read_bounded(files.checked(MEGATRON_TRACKER), shown=root / MEGATRON_TRACKER).strip()
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
    numpy 2's names of the array reconstructor."""
    import argparse
    import io
    import signal
    import types

    import numpy
    from numpy.core.multiarray import _reconstruct

    return [argparse.Namespace, types.SimpleNamespace, Path, io.BytesIO, signal.Signals,
            torch._C.Generator, numpy.ndarray, numpy.dtype, type(numpy.dtype("uint32")),
            (_reconstruct, "numpy.core.multiarray._reconstruct"),
            (_reconstruct, "numpy._core.multiarray._reconstruct")]


def _megatron_model(files: _Files, rel: str, where: Endpoint) -> Params:
    """One rank file's model tensors under the harness's names (``model{v}.`` prefixed per
    virtual stage), TE's ``_extra_state`` left out."""
    path = files.root / rel
    resolved = files.checked(rel, missing=f"{where} saves one per (TP, PP, EP) rank")
    stand_ins: list[str] = []
    while True:
        try:
            with torch.serialization.safe_globals(
                    _safe_globals() + [(MegatronObject, n) for n in stand_ins]):
                state = torch.load(resolved, map_location="cpu", weights_only=True, mmap=True)
            break
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
    keys = ["model"] if where.vpp <= 1 else [f"model{v}" for v in range(where.vpp)]
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
