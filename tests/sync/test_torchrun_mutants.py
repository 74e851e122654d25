"""Phase 2 as one rank of a torchrun job, read exactly, in process (the mutation pass over
``sync/torchrun.py``): ``run_torchrun`` and ``_init_shards`` called for one rank at a time,
with stand-ins for everything a rank of a real job talks to: torchrun's environment
(``torchrun_env``, ``device_for``), the job (``TorchrunRanks``: its groups a token per
degree, a recording tracer), the floors (``floor_for``, ``require_cell``,
``environment_notes``), the rank side (``load``, ``existing_task``, ``reshard``,
``forward``), the judging (``raise_user_errors``, ``judge``, ``collect``) and
``torch.distributed``'s object collectives; the layouts and the plan are the real ones.

Pinned: the order of every call a rank makes and each one's arguments (the session key
``"torchrun"``, the seed's tokens, the groups: the world's for the reshard, the
destination's for the forward), the tracer's phases, the defaults, when the forward runs
(the destination runs one, the backend is gloo, the floor has the destination's cell) and
the notes saying why not, the refusals (``into``, ``--into existing`` off CPU, a world
that is not the plan's) with their messages, that a rank other than 0 returns None after
the forward and the job is left on every path; ``_init_shards``' reference, shards, sends
and receives, and the MoE guard broadcast from rank 0. The real job: ``tests/sync/
test_cli.py`` (``torchrun --standalone``, the long run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sync.conftest import MOE_FEW, tiny
from weight_sync_bench.collectives.gloo.rank import RankContext
from weight_sync_bench.conventions import materialize
from weight_sync_bench.errors import FloorNotMeasured, UnsupportedLauncher
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.sync import torchrun as T
from weight_sync_bench.sync.execute import DEFAULT_BUCKET, execute_plan
from weight_sync_bench.sync.layouts import sync_layout
from weight_sync_bench.sync.planner import plan_for
from weight_sync_bench.sync.session import InPlace, no_forward
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

CONFIG = tiny(2)
NAME = "weight_sync_bench.sync.execute:execute_plan"
LAUNCHED = "launched by torchrun ({} ranks, {})"


class Tracer:
    def __init__(self) -> None:
        self.marks: list[str] = []

    def mark(self, phase: str) -> None:
        self.marks.append(phase)


class Job:
    """One rank's world: every stand-in records ``(what, args...)`` into ``calls``."""

    def __init__(self, monkeypatch, rank: int, world: int, local_rank: int = 5) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.calls: list[tuple] = []
        self.tracer = Tracer()
        self.floor = SimpleNamespace(threshold=0.25)
        self.cell_error: Exception | None = None
        self.reference, self.init, self.guard = object(), {"init": 1}, object()
        self.record, self.logits, self.verdict, self.result = ({"rank": rank}, object(),
                                                               object(), object())
        job = self

        class Ranks:
            def __init__(self, backend, *, deadline, command, options):
                job.calls.append(("ranks", backend, deadline, command, options))
                self.groups = {d: f"group{d}" for d in range(1, job.world + 1)}
                self.tracer = job.tracer

            def leave(self):
                job.calls.append(("leave",))

        def device_for(backend, local_rank):
            job.calls.append(("device_for", backend, local_rank))
            return "cpu" if backend == "gloo" else f"cuda:{local_rank}"

        def require_cell(floor, config, at):
            job.calls.append(("require_cell", floor, config, at))
            if job.cell_error is not None:
                raise job.cell_error

        def init_shards(*args):
            job.calls.append(("init_shards", *args))
            return job.reference, job.init, job.guard

        def all_gather_object(out, obj, group=None):
            job.calls.append(("all_gather", list(out), obj, group))
            for r in range(len(out)):
                out[r] = obj if r == job.rank else {"rank": r}

        def record(what, value=None):
            def stand_in(*args, **kw):
                job.calls.append((what, args, kw))
                return value
            return stand_in

        for name, value in [
                ("torchrun_env", lambda command: (job.calls.append(("env", command)),
                                                  (job.rank, job.world, job.local_rank))[1]),
                ("device_for", device_for), ("TorchrunRanks", Ranks),
                ("floor_for", lambda config, phase: (job.calls.append(("floor_for", config,
                                                                       phase)), job.floor)[1]),
                ("require_cell", require_cell), ("_init_shards", init_shards),
                ("environment_notes", lambda floor, config, phase, dtype: (
                    job.calls.append(("environment_notes", floor, config, phase, dtype)),
                    ("environment",))[1]),
                ("load", record("load", 123)), ("existing_task", record("existing_task", 7)),
                ("reshard", record("reshard", self.record)),
                ("forward", record("forward", self.logits)),
                ("raise_user_errors", record("raise_user_errors")),
                ("judge", record("judge", self.verdict)),
                ("collect", record("collect", self.result)),
                ("dist", SimpleNamespace(all_gather_object=all_gather_object))]:
            monkeypatch.setattr(T, name, value)

    def what(self) -> list[str]:
        return [c[0] for c in self.calls]

    def call(self, what: str) -> tuple:
        (found,) = [c for c in self.calls if c[0] == what]
        return found

    def records(self) -> list[object]:
        return [self.record if r == self.rank else {"rank": r} for r in range(self.world)]


def _plan(src: str, dst: str, dp: int = 1):
    return plan_for(sync_layout(CONFIG, src, dp=dp), sync_layout(CONFIG, dst))


def _reshard_kw(plan, *, fn=execute_plan, bucket=DEFAULT_BUCKET, seed=0, forward=True,
                bandwidth=True, device="cpu"):
    return dict(key="torchrun", plan=plan, fn=fn, bucket_bytes=bucket, seed=seed,
                forward=forward, bandwidth=bandwidth, device=device)


# ---- run_torchrun: rank 0 ------------------------------------------------------------------


def test_rank_0_with_the_defaults_plans_loads_reshards_gathers_runs_the_forward_and_judges(
        monkeypatch):
    job = Job(monkeypatch, rank=0, world=2)
    assert T.run_torchrun(CONFIG, "megatron:2", "vllm:1") is job.result
    plan = _plan("megatron:2", "vllm:1")
    assert job.what() == ["env", "device_for", "ranks", "floor_for", "require_cell",
                          "init_shards", "load", "reshard", "all_gather", "forward",
                          "raise_user_errors", "environment_notes", "judge", "collect", "leave"]
    assert job.call("env") == ("env", "sync")
    assert job.call("device_for") == ("device_for", "gloo", 5)
    assert job.call("ranks") == ("ranks", "gloo", 300.0, "sync", None)
    assert job.call("floor_for") == ("floor_for", CONFIG, "1b")
    assert job.call("require_cell") == ("require_cell", job.floor, CONFIG, plan.dst.at)
    tokens = make_tokens(CONFIG, TOKEN_SEED_OFFSET)
    init = job.call("init_shards")
    assert init[1:6] == (0, 2, "group2", job.tracer, plan.src) and init[6] == 0
    assert torch.equal(init[7], tokens) and init[8] == 0.25 and len(init) == 9
    assert job.call("load") == ("load", (0, "torchrun", plan.src, 0, job.init, "cpu"), {})
    assert job.call("reshard") == ("reshard", (0, 2, "group2", job.tracer), _reshard_kw(plan))
    assert job.call("all_gather") == ("all_gather", [None, None], job.record, "group2")
    what, args, kw = job.call("forward")
    assert args == (0, RankContext(0, 1, "group1", job.tracer))
    assert kw.pop("tokens").equal(tokens)
    assert kw == dict(key="torchrun", plan=plan, guard=job.guard)
    records = job.records()
    assert job.call("raise_user_errors") == ("raise_user_errors", (records, NAME, plan), {})
    assert job.call("environment_notes") == ("environment_notes", job.floor, CONFIG, "1b",
                                             "fp32")
    assert job.call("judge") == ("judge", (plan, job.logits, job.reference, 0.25, records,
                                           ("environment",)), {})
    assert job.call("collect") == ("collect", (plan, NAME, records, job.verdict,
                                               ("environment", LAUNCHED.format(2, "gloo"))),
                                   {"into": "fresh"})
    assert job.tracer.marks == ["sync: load", "sync: reshard", "sync: forward"]


def test_rank_0_into_existing_storage_over_dp_replicas_passes_every_option_on(monkeypatch):
    job = Job(monkeypatch, rank=0, world=4, local_rank=0)
    options = {"--seed": "3"}
    got = T.run_torchrun(CONFIG, "megatron:2", "vllm:1", dp=2, seed=3, bucket_bytes=65536,
                         calibrate=False, deadline=12.5, into="existing", options=options)
    assert got is job.result
    plan = _plan("megatron:2", "vllm:1", dp=2)
    assert plan.world == 4 and plan.src.dp == 2
    assert job.what() == ["env", "device_for", "ranks", "floor_for", "require_cell",
                          "init_shards", "load", "existing_task", "reshard", "all_gather",
                          "forward", "raise_user_errors", "environment_notes", "judge",
                          "collect", "leave"]
    assert job.call("ranks") == ("ranks", "gloo", 12.5, "sync", options)
    tokens = make_tokens(CONFIG, TOKEN_SEED_OFFSET + 3)
    assert not torch.equal(tokens, make_tokens(CONFIG, TOKEN_SEED_OFFSET - 3))
    init = job.call("init_shards")
    assert init[1:7] == (0, 4, "group4", job.tracer, plan.src, 3)
    assert torch.equal(init[7], tokens)
    assert job.call("load") == ("load", (0, "torchrun", plan.src, 3, job.init, "cpu"), {})
    assert job.call("existing_task") == ("existing_task", (RankContext(0, 4, "group4",
                                                                       job.tracer),),
                                         dict(key="torchrun", plan=plan, seed=3))
    kw = _reshard_kw(plan, fn=InPlace(execute_plan, "torchrun"), bucket=65536, seed=3,
                     bandwidth=False)
    assert job.call("reshard") == ("reshard", (0, 4, "group4", job.tracer), kw)
    assert job.call("all_gather")[1] == [None] * 4
    assert job.call("forward")[2]["tokens"].equal(tokens)
    assert job.call("collect") == ("collect", (plan, NAME, job.records(), job.verdict,
                                               ("environment", LAUNCHED.format(4, "gloo"))),
                                   {"into": "existing"})
    assert 65536 in plan._messages  # prepared before the reshard, at the bucket asked


def test_a_world_of_one_calibrates_no_bandwidth_and_two_ranks_do(monkeypatch):
    job = Job(monkeypatch, rank=0, world=1)
    T.run_torchrun(CONFIG, "megatron:1", "vllm:1")
    assert job.call("reshard")[2]["bandwidth"] is False
    assert job.call("collect")[1][4][-1] == LAUNCHED.format(1, "gloo")
    # the twin: two ranks, calibrate left on (the first test: True), off here
    job = Job(monkeypatch, rank=0, world=2)
    T.run_torchrun(CONFIG, "megatron:2", "vllm:1", calibrate=False)
    assert job.call("reshard")[2]["bandwidth"] is False


def test_without_the_forward_check_no_floor_no_init_and_no_forward_run(monkeypatch):
    job = Job(monkeypatch, rank=0, world=2)
    assert T.run_torchrun(CONFIG, "megatron:2", "vllm:1", forward_check=False) is job.result
    plan = _plan("megatron:2", "vllm:1")
    assert plan.dst.runs_forward  # the destination runs one: the check was turned off
    assert job.what() == ["env", "device_for", "ranks", "load", "reshard", "all_gather",
                          "raise_user_errors", "collect", "leave"]
    assert job.call("load") == ("load", (0, "torchrun", plan.src, 0, None, "cpu"), {})
    assert job.call("reshard")[2] == _reshard_kw(plan, forward=False)
    assert job.call("collect") == ("collect", (plan, NAME, job.records(), None,
                                               (LAUNCHED.format(2, "gloo"),)),
                                   {"into": "fresh"})
    assert job.tracer.marks == ["sync: load", "sync: reshard"]


def test_a_destination_that_runs_no_forward_is_checked_by_element_with_the_note(monkeypatch):
    job = Job(monkeypatch, rank=0, world=2)
    T.run_torchrun(CONFIG, "megatron:2", "fsdp:2")
    plan = _plan("megatron:2", "fsdp:2")
    assert not plan.dst.runs_forward
    assert "floor_for" not in job.what() and "forward" not in job.what()
    assert job.call("reshard")[2]["forward"] is False
    assert job.call("collect")[1][3:] == (None, (no_forward(plan.dst),
                                                 LAUNCHED.format(2, "gloo")))


def test_over_nccl_the_tensors_live_on_the_local_cuda_device_and_no_forward_runs(monkeypatch):
    job = Job(monkeypatch, rank=0, world=2, local_rank=5)
    T.run_torchrun(CONFIG, "megatron:2", "vllm:1", backend="nccl")
    plan = _plan("megatron:2", "vllm:1")
    assert job.what() == ["env", "device_for", "ranks", "load", "reshard", "all_gather",
                          "raise_user_errors", "collect", "leave"]
    assert job.call("device_for") == ("device_for", "nccl", 5)
    assert job.call("ranks") == ("ranks", "nccl", 300.0, "sync", None)
    assert job.call("load") == ("load", (0, "torchrun", plan.src, 0, None, "cuda:5"), {})
    assert job.call("reshard")[2] == _reshard_kw(plan, forward=False, device="cuda:5")
    note = "no forward over nccl: the phase 1b floor was measured on CPU fp32"
    assert job.call("collect")[1][3:] == (None, (note, LAUNCHED.format(2, "nccl")))


def test_a_floor_without_the_destinations_cell_runs_no_forward_and_says_why(monkeypatch):
    job = Job(monkeypatch, rank=0, world=2)
    job.cell_error = FloorNotMeasured("no cell for vllm:1")
    T.run_torchrun(CONFIG, "megatron:2", "vllm:1")
    assert job.what() == ["env", "device_for", "ranks", "floor_for", "require_cell", "load",
                          "reshard", "all_gather", "raise_user_errors", "collect", "leave"]
    assert job.call("load")[1][4] is None
    assert job.call("reshard")[2]["forward"] is False
    assert job.call("collect")[1][3:] == (None, ("no forward: no cell for vllm:1",
                                                 LAUNCHED.format(2, "gloo")))


def test_rank_0_judges_nothing_without_the_logits_or_the_reference(monkeypatch):
    job = Job(monkeypatch, rank=0, world=2)
    job.reference = None
    with pytest.raises(AssertionError):
        T.run_torchrun(CONFIG, "megatron:2", "vllm:1")
    assert "judge" not in job.what() and job.what()[-1] == "leave"
    job = Job(monkeypatch, rank=0, world=2)
    job.logits = None
    monkeypatch.setattr(T, "forward", lambda *a, **kw: None)
    with pytest.raises(AssertionError):
        T.run_torchrun(CONFIG, "megatron:2", "vllm:1")
    assert "judge" not in job.what() and job.what()[-1] == "leave"


# ---- run_torchrun: the other ranks -----------------------------------------------------------


def test_a_destination_rank_runs_the_forward_in_its_group_and_returns_none(monkeypatch):
    job = Job(monkeypatch, rank=1, world=2, local_rank=1)
    assert T.run_torchrun(CONFIG, "megatron:2", "vllm:2", seed=4) is None
    plan = _plan("megatron:2", "vllm:2")
    assert job.what() == ["env", "device_for", "ranks", "floor_for", "require_cell",
                          "init_shards", "load", "reshard", "all_gather", "forward", "leave"]
    assert job.call("init_shards")[1:7] == (1, 2, "group2", job.tracer, plan.src, 4)
    assert job.call("load") == ("load", (1, "torchrun", plan.src, 4, job.init, "cpu"), {})
    assert job.call("reshard") == ("reshard", (1, 2, "group2", job.tracer),
                                   _reshard_kw(plan, seed=4))
    assert job.call("all_gather")[2] is job.record
    what, args, kw = job.call("forward")
    assert args == (1, RankContext(1, 2, "group2", job.tracer)) and kw["guard"] is job.guard
    assert job.tracer.marks == ["sync: load", "sync: reshard", "sync: forward"]


def test_a_rank_past_the_destinations_degree_runs_no_forward(monkeypatch):
    job = Job(monkeypatch, rank=1, world=2, local_rank=1)
    assert T.run_torchrun(CONFIG, "megatron:2", "vllm:1") is None
    assert "forward" not in job.what() and job.what()[-1] == "leave"
    assert job.tracer.marks == ["sync: load", "sync: reshard", "sync: forward"]


# ---- run_torchrun: refusals ------------------------------------------------------------------


def test_an_unknown_into_is_refused_before_torchrun_is_read(monkeypatch):
    job = Job(monkeypatch, rank=0, world=2)
    with pytest.raises(ValueError) as e:
        T.run_torchrun(CONFIG, "megatron:2", "vllm:1", into="elsewhere")
    assert str(e.value) == ("run_torchrun: into='elsewhere', expected one of "
                            "('fresh', 'existing')")
    assert job.calls == []


def test_into_existing_off_cpu_is_refused_before_the_job_is_joined(monkeypatch):
    job = Job(monkeypatch, rank=0, world=2, local_rank=3)
    with pytest.raises(UnsupportedLauncher) as e:
        T.run_torchrun(CONFIG, "megatron:2", "vllm:1", backend="nccl", into="existing")
    assert str(e.value) == ("--into existing runs on CPU (gloo): its stale destination "
                            "tensors are not made on cuda:3")
    assert job.what() == ["env", "device_for"]


def test_a_world_other_than_the_plans_is_refused_naming_both_and_the_job_is_left(
        monkeypatch):
    job = Job(monkeypatch, rank=0, world=3)
    with pytest.raises(UnsupportedLauncher) as e:
        T.run_torchrun(CONFIG, "megatron:2", "vllm:1")
    assert str(e.value) == ("megatron:2 -> vllm:1 runs on 2 ranks; torchrun started 3 "
                            "(--nproc-per-node 2)")
    assert job.what() == ["env", "device_for", "ranks", "leave"]


# ---- _init_shards --------------------------------------------------------------------------


class P2P:
    """``CountingP2P``'s stand-in: its construction and every exchange, recorded."""

    calls: list[tuple] = []

    def __init__(self, group, rank, tracer):
        P2P.calls.append(("p2p", group, rank, tracer))

    def exchange(self, sends, recvs, *, tag):
        P2P.calls.append(("exchange", sends, recvs, tag))


@pytest.fixture
def p2p(monkeypatch):
    P2P.calls = []
    broadcasts: list[tuple] = []
    me = SimpleNamespace(rank=0)

    def broadcast_object_list(held, src=0, group=None):
        broadcasts.append((list(held), src, group))
        if me.rank != src:
            held[0] = "rank 0's guard"

    monkeypatch.setattr(T, "CountingP2P", P2P)
    monkeypatch.setattr(T, "dist", SimpleNamespace(broadcast_object_list=broadcast_object_list))
    return SimpleNamespace(calls=P2P.calls, broadcasts=broadcasts, me=me)


def test_init_shards_on_rank_0_builds_the_reference_and_sends_each_rank_its_shards(p2p):
    src = sync_layout(CONFIG, "megatron:2", dp=2)  # 4 source ranks
    tokens, tracer = make_tokens(CONFIG, 11), Tracer()
    reference, mine, guard = T._init_shards(0, 4, "G", tracer, src, 5, tokens, 0.5)
    full = init_params(CONFIG, 5)
    assert not torch.equal(full["lm_head.weight"], init_params(CONFIG, 0)["lm_head.weight"])
    with torch.no_grad():
        assert torch.equal(reference, ReferenceModel(CONFIG, full)(tokens))
    shards = materialize(list(src.pieces), full)
    assert list(mine) == list(shards[0])
    assert all(torch.equal(mine[n], x) for n, x in shards[0].items())
    assert guard is None and p2p.broadcasts == []  # dense: no routing guard
    assert p2p.calls[0] == ("p2p", "G", 0, tracer)
    (what, sends, recvs, tag), = p2p.calls[1:]
    assert (what, recvs, tag) == ("exchange", [], "init shards")
    want = [(r, x) for r in (1, 2, 3) for x in shards[r].values()]
    assert [r for r, _ in sends] == [r for r, _ in want]
    assert all(torch.equal(x, y) and x.is_contiguous() for (_, x), (_, y) in zip(sends, want))


def test_init_shards_on_a_source_rank_receives_its_shards_from_rank_0(p2p):
    src = sync_layout(CONFIG, "megatron:2")
    tracer = Tracer()
    p2p.me.rank = 1
    reference, mine, guard = T._init_shards(1, 2, "G", tracer, src, 5, make_tokens(CONFIG, 1),
                                            0.5)
    assert reference is None and guard is None
    shapes = CONFIG.param_shapes()
    assert list(mine) == list(src.pieces[1])
    assert {n: tuple(x.shape) for n, x in mine.items()} == {
        n: tuple(p.local_shape(shapes[p.source])) for n, p in src.pieces[1].items()}
    (what, sends, recvs, tag), = p2p.calls[1:]
    assert p2p.calls[0] == ("p2p", "G", 1, tracer)
    assert (what, sends, tag) == ("exchange", [], "init shards")
    assert [r for r, _ in recvs] == [0] * len(mine)
    assert all(x is y for (_, x), y in zip(recvs, mine.values()))


def test_init_shards_on_a_rank_past_the_source_world_holds_nothing(p2p):
    src = sync_layout(CONFIG, "megatron:1")
    p2p.me.rank = 1
    assert T._init_shards(1, 2, "G", Tracer(), src, 5, make_tokens(CONFIG, 1), 0.5) == (
        None, {}, None)
    assert [c[0] for c in p2p.calls] == ["p2p"]


def test_init_shards_of_an_moe_model_broadcasts_rank_0s_routing_guard(p2p):
    src = sync_layout(MOE_FEW, "megatron:2")
    tokens = make_tokens(MOE_FEW, 2)
    reference, mine, guard = T._init_shards(0, 2, "G", Tracer(), src, 5, tokens, 0.75)
    model = ReferenceModel(MOE_FEW, init_params(MOE_FEW, 5))
    with torch.no_grad():
        assert torch.equal(reference, model(tokens))
    assert guard.bound == 0.75 and set(guard.routings) == set(model.routings)
    assert all(torch.equal(guard.routings[i].experts, model.routings[i].experts)
               for i in model.routings)
    assert p2p.broadcasts == [([guard], 0, "G")]
    # another rank: what rank 0 broadcast
    p2p.me.rank = 1
    reference, mine, guard = T._init_shards(1, 2, "G", Tracer(), src, 5, tokens, 0.75)
    assert reference is None and guard == "rank 0's guard"
    assert p2p.broadcasts[1] == ([None], 0, "G")
