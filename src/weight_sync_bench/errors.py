"""The typed errors a user of the harness can meet. Each message names what was wrong."""

from __future__ import annotations


class WsbError(Exception):
    """Base class of every error the harness raises on bad input."""


class InvalidConfig(WsbError, ValueError):
    """A ModelConfig whose fields cannot describe a model (or an unknown config name)."""


class UnsupportedLayout(WsbError, ValueError):
    """A placement that cannot split a parameter of this shape at this degree.

    The message names the parameter, the degree and the violated rule, e.g.
    ``layers.0.qkv.weight: HeadPartitioned needs n_kv_heads % t == 0 (n_kv_heads=2, t=4)``.
    """


class UnsupportedConvention(UnsupportedLayout):
    """A storage convention that cannot store this config at this degree, or a config
    field it has no counterpart for. The message names the convention, the stored
    parameter, the degree and the rule, e.g. ``vllm: model.layers.0.self_attn.qkv_proj.weight
    needs t % n_kv_heads == 0 when t > n_kv_heads (n_kv_heads=2, t=3)``."""


class UnknownConvention(WsbError, ValueError):
    """A convention name (or a ``name:degree`` endpoint) the harness does not define or
    cannot parse; the message lists the known conventions."""


class InvalidShards(WsbError, ValueError):
    """Rank-local shards (from a user's split or reshard function) that do not fit the layout:
    a missing or extra name, a wrong shape or dtype, or the wrong number of ranks."""


class Uncovered(InvalidShards):
    """Declared tensors the shards never write: a whole layer (two pipeline stages publishing
    the same local indices, a stage's offset wrong), a stage's tensors, a bucket of experts.
    A coverage failure, found before any byte is compared; ``missing`` maps each rank to the
    stored names it lacks."""

    def __init__(self, message: str, *, missing: dict[int, list[str]] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or {}


class ToleranceMismatch(WsbError, RuntimeError):
    """A tolerance artifact that does not describe the running check (geometry, token shape,
    phase), or that is missing or malformed."""


class FloorNotMeasured(ToleranceMismatch):
    """A check of a geometry (or weight dtype, or phase, or training mesh over gloo) that no
    measured floor covers: refused rather than judged by a threshold measured on another
    geometry (or mesh). Names why each artifact does not cover it and ``command``, what
    measures it; ``why``: the message without the remedy (what a caller that knows a better
    command, as ``wsb sync`` does for a user's config.json, says before its own)."""

    def __init__(self, message: str, *, command: str | None = None,
                 why: str | None = None) -> None:
        super().__init__(message)
        self.command = command
        self.why = why if why is not None else message


class WrongShardShape(InvalidShards):
    """A rank-local shard whose shape or dtype differs from the layout's, found before any
    collective moves it (gloo would abort in C++ with no Python traceback). Names the rank,
    the parameter, and the expected and actual shape."""

    def __init__(self, message: str, *, rank: int | None = None, name: str | None = None,
                 expected: tuple[int, ...] | None = None,
                 actual: tuple[int, ...] | None = None, expected_dtype: object = None,
                 actual_dtype: object = None) -> None:
        super().__init__(message)
        self.rank, self.name, self.expected, self.actual = rank, name, expected, actual
        # set only when the dtype is what differs (then expected/actual, the shapes, are None)
        self.expected_dtype, self.actual_dtype = expected_dtype, actual_dtype


class RankFailure(WsbError, RuntimeError):
    """A rank process of the phase 1b harness failed, so its process group is gone.

    ``rank`` is the rank blamed; the message quotes every rank's breadcrumb (phase,
    collective number, op, parameter or layer) and, where there is one, the rank's own
    traceback (``remote_traceback``) and the time it raised (``raised_at``, ``time.time()``
    on the rank). ``pids`` are the task's rank processes, all gone by the time this is
    raised. ``breadcrumb`` is the blamed rank's last breadcrumb, as text. Subclasses say how
    the rank failed.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 remote_traceback: str | None = None, raised_at: float | None = None,
                 pids: tuple[int, ...] = (), breadcrumb: str | None = None) -> None:
        super().__init__(message)
        self.rank, self.remote_traceback, self.raised_at = rank, remote_traceback, raised_at
        self.pids, self.breadcrumb = pids, breadcrumb


class RankCrash(RankFailure):
    """A rank process exited without reporting: killed by a signal or a non-zero exit.
    ``signal_name`` is ``"SIGKILL"``-style, or None for a plain exit code."""

    def __init__(self, message: str, *, signal_name: str | None = None,
                 exit_code: int | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.signal_name, self.exit_code = signal_name, exit_code


class UnguardedMain(RankCrash):
    """The rank processes re-imported the user's script (``__main__``, as multiprocessing does
    in every process it starts) and that script started the harness's ranks again at import
    time: its checks are not under ``if __name__ == "__main__":``."""


class LauncherCrash(RankCrash):
    """The process that starts the ranks died, and the ranks exited because their parent went
    away: no rank crashed on its own. ``launcher`` names that process (the rank pool's
    forkserver), ``launcher_pid`` is its pid and ``launcher_end`` how it ended
    (``"killed by SIGKILL"``, ``"exited with code 1"``, or ``"gone"`` where its status could
    not be read). ``rank`` is the first rank seen to go; its own exit status is unknown
    (``exit_code`` and ``signal_name`` are None: multiprocessing reports 255 for every rank
    whose forkserver is gone)."""

    def __init__(self, message: str, *, launcher: str, launcher_pid: int, launcher_end: str,
                 **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.launcher, self.launcher_pid, self.launcher_end = launcher, launcher_pid, launcher_end


class RankTimeout(RankFailure):
    """Ranks that did not finish (or did not arrive at rendezvous) before the parent's
    watchdog deadline. ``stuck`` are the ranks behind the others; ``stacks`` maps every
    live rank to its Python stacks, dumped by faulthandler before the ranks were killed."""

    def __init__(self, message: str, *, stuck: tuple[int, ...] = (),
                 stacks: dict[int, str] | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.stuck, self.stacks = stuck, stacks or {}


class RankStopped(RankTimeout):
    """Ranks that did not answer the watchdog's stack request because they were not running:
    stopped (``/proc`` state ``T``, SIGSTOP or SIGTSTP), traced (``t``) or in uninterruptible
    sleep (``D``). ``states`` maps each such rank to its one-letter process state, read from
    /proc when the deadline passed, not inferred from breadcrumbs."""

    def __init__(self, message: str, *, states: dict[int, str] | None = None,
                 **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.states = states or {}


class TooManyRanks(WsbError, ValueError):
    """More rank processes asked for (a degree, a world, a mesh) than the pool starts on
    this machine (``collectives.gloo.pool.max_ranks``), refused before any starts. Names the
    number asked for and the cap's arithmetic; ``WSB_MAX_RANKS`` raises the cap."""


class MismatchedOptions(WsbError, ValueError):
    """The ranks of one torchrun job were started with different options (a launch script
    that templates each rank's command line, a stale one on one host). ``differ`` maps each
    option that differs, as spelled on the command line (``--seed``), to every rank's value
    in rank order; found when the ranks join, before any of them plans or moves anything."""

    def __init__(self, message: str, *, differ: dict[str, tuple[str, ...]] | None = None
                 ) -> None:
        super().__init__(message)
        self.differ = differ or {}


class PeerAborted(WsbError, RuntimeError):
    """Raised on a rank because another rank failed first, at a point every rank agreed on
    (so the process group is still consistent). The pool reports the other rank's error."""


class UnknownMutation(WsbError, KeyError):
    """A mutation name the mutation layer does not define; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CorruptCorpusEntry(WsbError, ValueError):
    """A corpus file that cannot be read back as a case: not JSON, an unknown schema, or a
    field missing or of the wrong type. Names the file and the field."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.path, self.field = path, field


class CorpusNotWritable(WsbError):
    """A corpus directory that cannot be created or written (read-only, a file in the way, no
    space): ``directory`` and the operating system's ``reason``. A fuzz run refuses it
    before it runs anything; a counterexample found after it became unwritable is printed
    in full instead (``fuzz.corpus.save_entry``), never dropped."""

    def __init__(self, message: str, *, directory: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.directory, self.reason = directory, reason


class InvalidBatch(WsbError, ValueError):
    """A training batch that cannot be laid out: documents longer than the row, fewer rows
    than data-parallel ranks, or no valid label anywhere (a mean over zero tokens)."""


class InvalidMesh(WsbError, ValueError):
    """A data-parallel x tensor-parallel shape the config or the batch cannot take, e.g.
    ``dp=3 > batch rows 2`` or a TP degree the layout rejects."""


class UnevenSequence(InvalidMesh):
    """A sequence that a context- or sequence-parallel split cannot divide evenly. Names the
    rule and the numbers: ``context parallelism needs seq_len % cp == 0 (seq_len=10, cp=4)``.
    The harness rejects uneven splits rather than padding them."""


class MissingArtifacts(WsbError, FileNotFoundError):
    """The harness's committed files (tolerance artifacts, corpus) cannot be located: no
    checkout around the installed package and no environment variable naming them."""


class InvalidNumber(WsbError, ValueError):
    """A count, size, degree, duration or seed that is not a number in its range: zero or
    negative where work must be done, NaN or infinite, a bool, or a seed outside
    0..2^63-1. Names the argument and the value: ``--minutes must be a finite number > 0,
    got nan``. ``count``, ``positive`` and ``seed`` check one value and return it."""

    SEED_MAX = 2**63 - 1

    @classmethod
    def count(cls, name: str, value: object, *, minimum: int = 1) -> int:
        """``value`` as an int >= ``minimum`` (a bool is not a count)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise cls(f"{name} must be an int >= {minimum}, got {value!r}")
        return value

    @classmethod
    def positive(cls, name: str, value: object) -> float:
        """``value`` as a finite float > 0: a duration, a size or a limit."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not value > 0 or value == float("inf"):
            raise cls(f"{name} must be a finite number > 0, got {value!r}")
        return float(value)

    @classmethod
    def seed(cls, name: str, value: object) -> int:
        """``value`` as an int in 0..2^63-1, the range every seed of the harness takes."""
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 0 <= value <= cls.SEED_MAX:
            raise cls(f"{name} must be an int in 0..2^63-1, got {value!r}")
        return value


class UserCodeError(WsbError):
    """The user's own code failed as code: a resharder, splitter or converter
    (``--resharder``, ``--splitter``, ``--converter``, the function given to ``check_split``
    / ``check_reshard`` / ``check_convert``) raised, raised while its module was imported, or
    has a signature the harness cannot call (a module or function that does not exist is
    not the user's code failing: ``WsbError``, bad input). The message frames it
    ("your resharder `mod:fn` raised ValueError ...") and quotes the user's frames of the
    traceback, not the harness's (``user_traceback``); ``__cause__`` is the original."""

    def __init__(self, message: str, *, role: str | None = None, function: str | None = None,
                 user_traceback: str | None = None) -> None:
        super().__init__(message)
        self.role, self.function, self.user_traceback = role, function, user_traceback


class ModifiedInput(UserCodeError):
    """The user's function changed what the harness handed it: a source shard or full tensor
    modified, resized or re-strided in place, or a tensor of the given dicts replaced or
    removed. ``rank`` (None for a full model) and ``name`` say which tensor."""

    def __init__(self, message: str, *, rank: int | None = None, name: str | None = None,
                 **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.rank, self.name = rank, name


class UserCodeTimeout(UserCodeError):
    """The user's function did not return within the deadline (``--deadline``); the message
    and ``user_traceback`` give where it was."""


class Unsupported(WsbError):
    """Raised by a user's own splitter, resharder or converter to decline a case it does not
    support (``raise weight_sync_bench.Unsupported("only even vocabularies")``). Under
    ``wsb fuzz --resharder ...`` and ``weight_sync_bench.testing``'s properties a declined
    case is skipped and counted, never a pass; the summary gives how many were declined and
    the smallest. Narrow the domain instead where the declined cases are many."""


class InvalidUserShards(UserCodeError, InvalidShards):
    """The user's function returned something that is not shards of the layout: not a list
    of dicts of str -> CPU tensors (meta tensors, non-string keys), or shards with missing
    or extra names, wrong shapes or dtypes. Names the rank and the parameter."""


class WrongUserShard(InvalidUserShards):
    """``InvalidUserShards`` for a shard of the wrong shape or dtype, with
    ``WrongShardShape``'s fields: ``rank``, ``name``, ``expected`` / ``actual`` (shapes) or
    ``expected_dtype`` / ``actual_dtype`` (set only when the dtype is what differs)."""

    def __init__(self, message: str, *, rank: int | None = None, name: str | None = None,
                 expected: tuple[int, ...] | None = None,
                 actual: tuple[int, ...] | None = None, expected_dtype: object = None,
                 actual_dtype: object = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.rank, self.name, self.expected, self.actual = rank, name, expected, actual
        self.expected_dtype, self.actual_dtype = expected_dtype, actual_dtype


class GeometryTooLarge(WsbError, ValueError):
    """A geometry whose check would need more memory or work than the limit
    (``model.footprint``), refused before anything of it is allocated. Names the field that
    drives the estimate (``field``; None where none lies outside the reference geometries),
    the estimate (``estimate`` in bytes, ``flops``) and the flag that raises the limit."""

    def __init__(self, message: str, *, field: str | None = None, estimate: int | None = None,
                 flops: int | None = None) -> None:
        super().__init__(message)
        self.field, self.estimate, self.flops = field, estimate, flops


class CorpusEntryTooLarge(CorruptCorpusEntry, GeometryTooLarge):
    """A corpus entry whose geometry would need more memory or work than the replay limit,
    refused before anything is allocated: ``GeometryTooLarge`` for a file, which it names
    (``path``) besides the field that drives the estimate and the estimate."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None,
                 estimate: int | None = None, flops: int | None = None) -> None:
        WsbError.__init__(self, message)
        self.path, self.field, self.estimate, self.flops = path, field, estimate, flops


class ArtifactProtected(WsbError):
    """A measuring command that would replace a committed artifact without ``--write``, or a
    larger measurement with a smaller one without ``--force``. Names the file and the
    figures (samples, threshold or rule) on both sides."""


class InvalidCover(WsbError, ValueError):
    """A layout's index boxes that do not cover the canonical model as the layout states
    (phase 2, checked before anything moves): a box out of bounds, two boxes of one rank
    overlapping, a canonical index held more or fewer times than the stated replication, a
    total volume that differs. Names the layout, the parameter, the rank and the box."""

    def __init__(self, message: str, *, param: str | None = None, rank: int | None = None,
                 box: object = None) -> None:
        super().__init__(message)
        self.param, self.rank, self.box = param, rank, box


class UnsupportedLauncher(WsbError, ValueError):
    """A launcher or backend the running machine cannot provide (``--backend nccl`` without
    CUDA, ``--launcher torchrun`` outside a torchrun job). Names what is missing."""


class CheckpointError(WsbError, ValueError):
    """A checkpoint directory that cannot be read as the convention it is said to be in, or
    written: a file missing, truncated or unreadable, mis-named (a ``.safetensors`` or
    ``.pth`` file the convention's file pattern does not name), an index naming a file that is
    not there, a tensor missing, extra or of the wrong shape or dtype, a ``config.json`` or
    ``params.json`` that disagrees with the config checked. ``path`` is the file named (the
    directory where no single file is to blame)."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UnsafeFile(CheckpointError):
    """A file an input names that the harness refuses to open or read whole: outside the
    directory that names it (an absolute path, a ``..``, a symlink out of it), not a regular
    file (a directory, FIFO, socket or device), or over the stated size limit
    (``files.JSON_LIMIT``). Raised before the file is opened; ``entry`` is the name as the
    input gave it (an index's value, a file name), ``path`` the file in the directory."""

    def __init__(self, message: str, *, path: str | None = None, entry: str | None = None
                 ) -> None:
        super().__init__(message, path=path)
        self.entry = entry
