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


class InvalidShards(WsbError, ValueError):
    """Rank-local shards (from a user's split or reshard function) that do not fit the layout:
    a missing or extra name, a wrong shape or dtype, or the wrong number of ranks."""


class ToleranceMismatch(WsbError, RuntimeError):
    """A tolerance artifact that does not describe the running check (geometry, token shape,
    phase), or that is missing or malformed."""


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
    raised. Subclasses say how the rank failed.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 remote_traceback: str | None = None, raised_at: float | None = None,
                 pids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank, self.remote_traceback, self.raised_at = rank, remote_traceback, raised_at
        self.pids = pids


class RankCrash(RankFailure):
    """A rank process exited without reporting: killed by a signal or a non-zero exit.
    ``signal_name`` is ``"SIGKILL"``-style, or None for a plain exit code."""

    def __init__(self, message: str, *, signal_name: str | None = None,
                 exit_code: int | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.signal_name, self.exit_code = signal_name, exit_code


class RankTimeout(RankFailure):
    """Ranks that did not finish (or did not arrive at rendezvous) before the parent's
    watchdog deadline. ``stuck`` are the ranks behind the others; ``stacks`` maps every
    live rank to its Python stacks, dumped by faulthandler before the ranks were killed."""

    def __init__(self, message: str, *, stuck: tuple[int, ...] = (),
                 stacks: dict[int, str] | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.stuck, self.stacks = stuck, stacks or {}


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
