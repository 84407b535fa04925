"""AdaptiveDataLoader: global batch size, exactly-once passes, restarts, eval without padding."""

from __future__ import annotations

import collections
import itertools
import os

import pytest
import torch
from torch.utils.data import TensorDataset

import adaptrain.torch as at
from adaptrain import checkpoint
from adaptrain.dist.spawn import spawn
from adaptrain.torch import data as data_mod


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for k in ("ADAPTRAIN_CHECKPOINT_PATH", "ADAPTRAIN_NUM_REPLICAS", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    checkpoint.reset()
    yield
    checkpoint.reset()


def _ids(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


# ----- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bsz", [0, -3, 2.5, True, None])
def test_bad_batch_size(bsz):
    with pytest.raises(ValueError, match="batch_size"):
        at.AdaptiveDataLoader(_ids(10), batch_size=bsz)


def test_custom_sampler_rejected():
    with pytest.raises(ValueError, match="sampler"):
        at.AdaptiveDataLoader(_ids(10), batch_size=2, sampler=range(10))
    with pytest.raises(ValueError, match="batch_sampler"):
        at.AdaptiveDataLoader(_ids(10), batch_sampler=[[0, 1]])


@pytest.mark.parametrize(
    "max_bsz, bounds, match",
    [
        (8, None, "max_batch_size=8"),  # below batch_size=16
        (32.0, None, "max_batch_size=32.0"),
        (64, (0, 8), "positive"),
        (64, (9, 8), "min > max"),
        (64, (100, 200), "exceeds max_batch_size"),
        (64, (4,), "pair"),
        (64, 7, "pair"),
    ],
)
def test_bad_autoscale_bounds(max_bsz, bounds, match):
    dl = at.AdaptiveDataLoader(_ids(10), batch_size=16)
    with pytest.raises(ValueError, match=match):
        dl.autoscale_batch_size(max_bsz, local_bsz_bounds=bounds)


# ----- single process ----------------------------------------------------------------------------
def test_one_pass_exactly_once_and_properties():
    dl = at.AdaptiveDataLoader(_ids(103), batch_size=10, shuffle=True)
    orders = []
    for _epoch in at.remaining_epochs_until(2):
        seen = []
        for (x,) in dl:
            assert dl.current_batch_size == 10 and dl.current_local_bsz == 10
            assert at.current_dataloader() is dl._elastic
            seen += x.tolist()
        assert sorted(seen) == list(range(103))
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled per epoch
    assert dl.current_batch_size is None and at.current_dataloader() is None
    assert len(dl) == 11 and dl.accumulation_steps == 1


def test_drop_last_drops_only_the_tail():
    dl = at.AdaptiveDataLoader(_ids(103), batch_size=10, drop_last=True)
    sizes = [len(x) for (x,) in dl]
    assert sizes == [10] * 10


def test_overlapping_loops_rejected():
    a, b = at.AdaptiveDataLoader(_ids(4), 2), at.AdaptiveDataLoader(_ids(4), 2)
    it = iter(a)
    next(it)
    with pytest.raises(RuntimeError, match="overlapping"):
        next(iter(b))
    it.close()


def test_gradient_accumulation_pattern():
    dl = at.AdaptiveDataLoader(_ids(70), batch_size=32)
    dl.autoscale_batch_size(64, local_bsz_bounds=(1, 8), gradient_accumulation=True)
    flags, sizes = [], []
    for (x,) in dl:
        helper = at.current_dataloader()
        flags.append(helper.is_accum_step())
        sizes.append(len(x))
        assert dl.current_batch_size == 32 and dl.current_local_bsz == 8
    assert dl.accumulation_steps == 4
    # 70 = 2 steps of 4×8, then 6 left: one micro-batch that ends its (short) step.
    assert sizes == [8] * 8 + [6]
    assert flags == [True, True, True, False] * 2 + [False]


def test_restart_mid_epoch_resumes_exactly(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    seen = collections.Counter()
    for _epoch in at.remaining_epochs_until(1):
        dl = at.AdaptiveDataLoader(_ids(50), batch_size=8, shuffle=True)
        for i, (x,) in enumerate(dl):
            if i == 3:
                # What graceful_exit does at a step boundary: steps 0-2 are done, step 3's
                # batch is not processed; checkpoint, then stop.
                checkpoint.save_all_states()
                break
            seen.update(x.tolist())
    checkpoint.reset()  # a new process
    for epoch in at.remaining_epochs_until(1):
        assert epoch == 0
        dl = at.AdaptiveDataLoader(_ids(50), batch_size=8, shuffle=True)
        for (x,) in dl:
            seen.update(x.tolist())
    assert seen == collections.Counter(range(50))


def test_finished_loop_is_skipped_after_restart(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    train, valid = at.AdaptiveDataLoader(_ids(12), 4), at.AdaptiveDataLoader(_ids(6), 4)
    for _epoch in at.remaining_epochs_until(1):
        list(train)
        for i, _ in enumerate(valid):
            if i == 1:
                checkpoint.save_all_states()
                break
    checkpoint.reset()
    train, valid = at.AdaptiveDataLoader(_ids(12), 4), at.AdaptiveDataLoader(_ids(6), 4)
    counts = []
    for _epoch in at.remaining_epochs_until(1):
        counts.append(len(list(train)))  # finished before the restart: skipped
        counts.append(sum(len(x) for (x,) in valid))  # resumed after its first batch
    assert counts == [0, 2]


def test_every_finished_loop_is_skipped_after_restart(monkeypatch, tmp_path):
    """Several loops finished in the epoch before the restart (two loaders, one of them looped
    twice): all are skipped, none is run again; the interrupted one resumes."""
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))

    def program(interrupt: bool) -> list[int]:
        train = at.AdaptiveDataLoader(_ids(12), 4)
        extra = at.AdaptiveDataLoader(_ids(8), 4)
        valid = at.AdaptiveDataLoader(_ids(6), 2)
        counts = []
        for _epoch in at.remaining_epochs_until(1):
            counts.append(sum(len(x) for (x,) in train))
            counts.append(sum(len(x) for (x,) in train))
            counts.append(sum(len(x) for (x,) in extra))
            counts.append(0)
            for i, (x,) in enumerate(valid):
                if interrupt and i == 1:
                    checkpoint.save_all_states()
                    return counts
                counts[-1] += len(x)
        return counts

    assert program(interrupt=True) == [12, 12, 8, 2]
    checkpoint.reset()
    assert program(interrupt=False) == [0, 0, 0, 4]


@pytest.mark.parametrize("stop_at", [0, 2, 4])
def test_same_loader_looped_twice_resumes_its_second_loop(monkeypatch, tmp_path, stop_at):
    """One loader looped twice in an epoch (train, then training-set accuracy): a restart during
    the second loop skips the first (finished) and resumes the second where it stopped, so each
    loop processes every sample exactly once."""
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))

    def program(interrupt: bool) -> list[list[int]]:
        dl = at.AdaptiveDataLoader(_ids(22), batch_size=4, shuffle=True)
        loops: list[list[int]] = [[], []]
        for _epoch in at.remaining_epochs_until(1):
            for (x,) in dl:
                loops[0] += x.tolist()
            with torch.no_grad():
                for i, (x,) in enumerate(dl):
                    if interrupt and i == stop_at:
                        checkpoint.save_all_states()  # as graceful_exit at a step boundary
                        return loops
                    loops[1] += x.tolist()
        return loops

    before = program(interrupt=True)
    assert len(before[1]) == 4 * stop_at
    checkpoint.reset()  # a new process
    after = program(interrupt=False)
    assert after[0] == []  # finished before the restart: skipped
    assert sorted(before[0]) == list(range(22))
    assert sorted(before[1] + after[1]) == list(range(22))


def test_batch_size_switch_keeps_exactly_once(monkeypatch):
    """The loader applies a suggestion only at segment boundaries; coverage stays exact."""
    from adaptrain.torch import _metrics

    calls = []

    def suggest(num_nodes, num_replicas, atomic, accum, min_improvement=0.05):
        calls.append((atomic, accum))
        return (atomic * 2, 1) if atomic < 16 else None

    monkeypatch.setattr(_metrics, "suggest_batch_size", suggest)
    dl = at.AdaptiveDataLoader(_ids(200), batch_size=4, shuffle=True)
    dl.autoscale_batch_size(64, local_bsz_bounds=(1, 32), reoptimize_every=3)
    sizes, seen = [], []
    for (x,) in dl:
        sizes.append(len(x))
        seen += x.tolist()
    assert sorted(seen) == list(range(200))
    assert sizes[:9] == [8] * 3 + [16] * 3 + [16] * 3
    assert calls[:3] == [(4, 1), (8, 1), (16, 1)]


def test_decisions_come_soon_after_a_change_then_at_doubling_intervals(monkeypatch):
    """Segments: MIN_SAMPLES + 1 steps after each change, then doubling up to reoptimize_every."""
    from adaptrain.torch import _metrics

    steps_at_call = []
    seen = {"steps": 0}

    def suggest(num_nodes, num_replicas, atomic, accum, min_improvement=0.05):
        steps_at_call.append(seen["steps"])
        # one change, at the second decision (after the first segment), then stay
        return (8, 1) if len(steps_at_call) == 2 else None

    monkeypatch.setattr(_metrics, "suggest_batch_size", suggest)
    dl = at.AdaptiveDataLoader(_ids(8 * 400), batch_size=4)
    dl.autoscale_batch_size(64, local_bsz_bounds=(1, 32))
    first = _metrics.MIN_SAMPLES + 1
    for (_x,) in dl:
        seen["steps"] += 1
    gaps = [b - a for a, b in zip(steps_at_call, steps_at_call[1:])]
    assert steps_at_call[0] == 0
    assert gaps[:6] == [first, first, 2 * first, 4 * first, 50, 50]


def test_reoptimize_every_caps_the_gap_between_decisions(monkeypatch):
    """autoscale_batch_size(reoptimize_every=N): the doubling gaps stop at N, not at 50."""
    from adaptrain.torch import _metrics

    steps_at_call = []
    seen = {"steps": 0}

    def suggest(num_nodes, num_replicas, atomic, accum, min_improvement=0.05):
        steps_at_call.append(seen["steps"])
        return None  # never change: the gaps only double

    monkeypatch.setattr(_metrics, "suggest_batch_size", suggest)
    dl = at.AdaptiveDataLoader(_ids(4 * 200), batch_size=4)
    cap = 2 * (_metrics.MIN_SAMPLES + 1) + 1
    dl.autoscale_batch_size(64, local_bsz_bounds=(1, 32), reoptimize_every=cap)
    assert dl._elastic.reoptimize_every == cap
    for (_x,) in dl:
        seen["steps"] += 1
    gaps = [b - a for a, b in zip(steps_at_call, steps_at_call[1:])]
    first = _metrics.MIN_SAMPLES + 1
    assert gaps[:5] == [first, 2 * first, cap, cap, cap]
    dl.autoscale_batch_size(64)  # None keeps the value set before
    assert dl._elastic.reoptimize_every == cap


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_reoptimize_every_rejects_what_is_not_a_positive_int(bad):
    dl = at.AdaptiveDataLoader(_ids(16), batch_size=4)
    with pytest.raises(ValueError, match="reoptimize_every="):
        dl.autoscale_batch_size(64, reoptimize_every=bad)


def test_a_segment_goes_on_across_passes(monkeypatch):
    """Passes shorter than a segment (a small dataset at a large batch) do not each trigger a
    decision: the rest of the segment carries into the next pass, so decisions keep the same
    step gaps as in one long pass; a loop left early decides afresh at the next pass."""
    from adaptrain.torch import _metrics

    steps_at_call = []
    seen = {"steps": 0}

    def suggest(num_nodes, num_replicas, atomic, accum, min_improvement=0.05):
        steps_at_call.append(seen["steps"])
        return None

    monkeypatch.setattr(_metrics, "suggest_batch_size", suggest)
    dl = at.AdaptiveDataLoader(_ids(4 * 7), batch_size=4)  # 7 optimizer steps per pass
    dl.autoscale_batch_size(64, local_bsz_bounds=(1, 32))
    first = _metrics.MIN_SAMPLES + 1
    for _epoch in at.remaining_epochs_until(30):
        for (_x,) in dl:
            seen["steps"] += 1
    gaps = [b - a for a, b in zip(steps_at_call, steps_at_call[1:])]
    assert steps_at_call[0] == 0
    assert gaps[:5] == [first, 2 * first, 4 * first, 50, 50]
    assert seen["steps"] == 30 * 7
    # The last full pass left 17 steps of its segment (decided at step 177, 50 steps long):
    # the next loop takes them without deciding. Leaving that loop early drops the rest, so
    # the loop after it decides at its start.
    calls = len(steps_at_call)
    for (_x,) in dl:
        break
    assert len(steps_at_call) == calls
    for (_x,) in dl:
        pass
    assert len(steps_at_call) == calls + 1


def test_a_segment_goes_on_across_passes_with_drop_last(monkeypatch):
    """With drop_last=True the dropped tail of a pass does not end the segment either: the
    decisions keep the cadence they have without drop_last, not one per pass."""
    from adaptrain.torch import _metrics

    def decision_gaps(drop_last: bool) -> list[int]:
        checkpoint.reset()
        steps_at_call, seen = [], {"steps": 0}
        monkeypatch.setattr(
            _metrics, "suggest_batch_size", lambda *a, **k: steps_at_call.append(seen["steps"])
        )
        # 7 full optimizer steps per pass, then a tail of 2 (dropped with drop_last)
        dl = at.AdaptiveDataLoader(_ids(4 * 7 + 2), batch_size=4, drop_last=drop_last)
        dl.autoscale_batch_size(64, local_bsz_bounds=(1, 32))
        for _epoch in at.remaining_epochs_until(20):
            for (_x,) in dl:
                seen["steps"] += 1
        assert seen["steps"] == 20 * (7 if drop_last else 8)
        return [b - a for a, b in zip(steps_at_call, steps_at_call[1:])]

    first = _metrics.MIN_SAMPLES + 1
    expected = [first, 2 * first, 4 * first, 50]
    assert decision_gaps(drop_last=False) == expected
    assert decision_gaps(drop_last=True) == expected


# ----- three replicas ----------------------------------------------------------------------------
def _three(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(100, 5)
    y = (x[:, 0] > 0).long()
    ids = torch.arange(100)
    model = torch.nn.Linear(5, 2)
    out: dict = {"train": [], "eval": [], "steps": 0}
    train = at.AdaptiveDataLoader(TensorDataset(x, y, ids), batch_size=16, shuffle=True)
    test = at.AdaptiveDataLoader(TensorDataset(x, y, ids), batch_size=64)
    tiny_eval = at.AdaptiveDataLoader(TensorDataset(ids[:2]), batch_size=4)
    tiny_train = at.AdaptiveDataLoader(TensorDataset(ids[:2]), batch_size=4)
    stats = at.Accumulator()
    for _epoch in at.remaining_epochs_until(1):
        for _xb, _yb, ib in train:
            out["train"] += ib.tolist()
            out["steps"] += 1
        with torch.no_grad():
            for xb, yb, ib in test:
                out["eval"] += ib.tolist()
                stats["correct"] += (model(xb).argmax(1) == yb).sum().item()
                stats["n"] += len(yb)
            out["tiny_eval"] = [i for (b,) in tiny_eval for i in b.tolist()]
        out["tiny_train"] = [i for (b,) in tiny_train for i in b.tolist()]
        with stats.synchronized():
            out["acc"] = (stats["correct"], stats["n"])
    with torch.no_grad():
        out["truth"] = (model(x).argmax(1) == y).sum().item()
    return out


def test_three_replicas_train_and_exact_eval():
    res = spawn(_three, 3, timeout=180)
    train = collections.Counter(i for r in res for i in r["train"])
    assert train == collections.Counter(range(100))
    assert len({r["steps"] for r in res}) == 1  # same number of steps everywhere
    evals = collections.Counter(i for r in res for i in r["eval"])
    assert evals == collections.Counter(range(100))  # no padding: 100 is not divisible by 3
    assert all(r["acc"] == (res[0]["truth"], 100) for r in res)  # exact accuracy
    # Fewer samples than replicas: evaluation never pads, training pads (DDP needs a batch).
    assert sorted(i for r in res for i in r["tiny_eval"]) == [0, 1]
    assert [len(r["tiny_eval"]) for r in res] == [1, 1, 0]
    assert [len(r["tiny_train"]) for r in res] == [1, 1, 1]


def test_plan_module_exports():
    assert set(data_mod.__all__) >= {"AdaptiveDataLoader", "ElasticSampler", "current_dataloader"}
    assert os.environ.get("ADAPTRAIN_NUM_REPLICAS") is None


def test_profiling_calls_follow_accumulation(monkeypatch):
    from adaptrain.torch import _metrics

    calls = []
    monkeypatch.setattr(_metrics, "profile_step_start", lambda b: calls.append(("start", b)))
    monkeypatch.setattr(_metrics, "profile_step_commit", lambda a: calls.append(("commit", a)))
    dl = at.AdaptiveDataLoader(_ids(40), batch_size=16)
    dl.autoscale_batch_size(64, local_bsz_bounds=(1, 8), gradient_accumulation=True)
    list(dl)
    # local 8 × 2 micro-batches per step: 40 = 2 steps of 2×8, then a short step of 8.
    starts = [c for c in calls if c[0] == "start"]
    commits = [c[1] for c in calls if c[0] == "commit"]
    assert starts == [("start", 8)] * 5
    # commit(accumulation_step): the loop's first micro-batch (iterator warm-up) is not
    # committed; then optim, accum, optim, optim (the short last step).
    assert commits == [False, True, False, False]
    # An untrained (evaluation) loader does not profile.
    calls.clear()
    list(at.AdaptiveDataLoader(_ids(10), batch_size=4))
    assert calls == []


def test_restart_on_other_replica_count_keeps_global_batch():
    dl = at.AdaptiveDataLoader(_ids(64), batch_size=8)
    dl.autoscale_batch_size(256, local_bsz_bounds=(1, 64))
    st = dl._elastic._state
    st.local_bsz, st.accum_steps, st.num_replicas = 16, 1, 2  # decided on 2 replicas: 32
    sizes = [len(x) for (x,) in dl]
    assert sizes == [32, 32] and dl.accumulation_steps == 1


def test_restart_on_the_same_replica_count_keeps_the_decision():
    """A restart on the replica count the checkpointed decision was made for resumes that
    decision (local batch and accumulation), rather than re-splitting its global batch."""
    dl = at.AdaptiveDataLoader(_ids(64), batch_size=8)
    dl.autoscale_batch_size(256, local_bsz_bounds=(1, 64), gradient_accumulation=True)
    st = dl._elastic._state
    st.local_bsz, st.accum_steps, st.num_replicas = 12, 2, 1  # decided on this one replica
    assert (len(dl), dl.accumulation_steps) == (6, 2)  # before the first iteration, too
    assert [len(x) for (x,) in dl] == [12] * 5 + [4] and dl.accumulation_steps == 2


def _rank0_decides(rank: int, world_size: int) -> list[int]:
    from adaptrain.torch import _metrics

    _metrics.suggest_batch_size = lambda *a, **k: (4 + rank, 1)  # replicas disagree
    dl = at.AdaptiveDataLoader(_ids(60), batch_size=6)
    dl.autoscale_batch_size(60)
    return [len(x) for (x,) in dl]


def test_batch_size_decision_is_rank0s():
    res = spawn(_rank0_decides, 2, timeout=120)
    assert res == [[4] * 7 + [2], [4] * 7 + [2]]  # 60 = 7 × (4×2) + 4


class _ListLoader(at.AdaptiveDataLoaderMixin):
    """A custom elastic loader built from the public pieces (reads current_local_bsz)."""

    def __init__(self, data, batch_size):
        super().__init__(batch_size)
        self.data = data
        self.sampler = at.ElasticSampler(data, shuffle=False)

    def __iter__(self):
        with self._elastic.context():
            if self._elastic.skipdone():
                return
            self.sampler.set_epoch(at.current_epoch(), self._elastic.current_index)
            local = [self.data[i] for i in self.sampler]
            bsz = self._elastic.current_local_bsz
            for i in range(0, len(local), bsz):
                with self._elastic.profile(commit=False):
                    yield local[i : i + bsz]
                    self._elastic.current_index += bsz * self.sampler.num_replicas


def test_mixin_custom_loader_resumes(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTRAIN_CHECKPOINT_PATH", str(tmp_path))
    got = []
    for _epoch in at.remaining_epochs_until(1):
        loader = _ListLoader(list("abcdefghij"), 3)
        for i, batch in enumerate(loader):
            assert at.current_dataloader() is loader._elastic
            assert loader.current_batch_size == 3 and loader.current_local_bsz == 3
            if i == 2:
                checkpoint.save_all_states()
                break
            got += batch
    checkpoint.reset()
    for _epoch in at.remaining_epochs_until(1):
        got += [x for batch in _ListLoader(list("abcdefghij"), 3) for x in batch]
    assert got == list("abcdefghij")


def _fresh_interpreter(code: str) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# Fresh interpreters: the test session has imported scipy.optimize long ago.
_SOLVER_SETUP = (
    "import sys, torch\n"
    "from adaptrain.torch import AdaptiveDataLoader, _metrics\n"
    "assert 'scipy.optimize' not in sys.modules, 'imported too early'\n"
    "ds = torch.utils.data.TensorDataset(torch.zeros(8, 1))\n"
)


def test_autoscale_loads_the_fit_solver_in_the_background():
    """Switching autoscale on starts importing scipy.optimize at once, off the training loop's
    critical path."""
    _fresh_interpreter(
        _SOLVER_SETUP + "AdaptiveDataLoader(ds, batch_size=4)\n"
        "assert _metrics._prefetch_thread is None, 'a fixed batch size needs no solver'\n"
        "AdaptiveDataLoader(ds, batch_size=4).autoscale_batch_size(16)\n"
        "_metrics._prefetch_thread.join(60)\n"
        "assert 'scipy.optimize' in sys.modules\n"
        "assert _metrics.prefetch_fit_solver() is None, 'once per process'\n"
        "print('ok')\n"
    )


def test_loader_workers_fork_only_after_the_solver_import():
    """A fork during the background import would leave its module locks held in the worker."""
    _fresh_interpreter(
        _SOLVER_SETUP + "loader = AdaptiveDataLoader(ds, batch_size=4, num_workers=1)\n"
        "loader.autoscale_batch_size(16)\n"
        "assert _metrics._prefetch_thread.is_alive()\n"
        "next(iter(loader))\n"
        "assert not _metrics._prefetch_thread.is_alive()\n"
        "print('ok')\n"
    )


class _Pids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 240

    def __getitem__(self, i: int) -> int:
        return os.getpid()


@pytest.mark.parametrize("persistent", [None, False])
def test_workers_are_kept_across_batch_size_segments(persistent):
    """Autoscaling re-decides every 11-50 steps, each time with a new DataLoader iterator; by
    default the same worker processes serve all of them (explicit False forks anew)."""
    kwargs = {} if persistent is None else {"persistent_workers": persistent}
    dl = at.AdaptiveDataLoader(_Pids(), batch_size=2, num_workers=2, **kwargs)
    dl.autoscale_batch_size(4, local_bsz_bounds=(1, 2))
    pids = {int(p) for batch in dl for p in batch}
    if persistent is None:
        assert len(pids) == 2, pids
    else:
        assert len(pids) > 2, pids


def test_kept_workers_yield_what_no_workers_yield_after_a_break():
    """Batches the kept workers prefetched before a ``break`` are dropped, not yielded later."""

    def sequence(num_workers: int) -> list:
        dl = at.AdaptiveDataLoader(_ids(200), batch_size=2, num_workers=num_workers)
        dl.autoscale_batch_size(4, local_bsz_bounds=(1, 2))
        out: list = []
        for i, (b,) in enumerate(dl):
            out.append(b.tolist())
            if i == 15:  # mid-segment: the workers have batches of this iterator in flight
                break
        out.append("break")
        for _ in range(2):
            out += [b.tolist() for (b,) in dl] + ["pass"]
        return out

    assert sequence(2) == sequence(0)


class _WorkerInfo(torch.utils.data.Dataset):
    """Sample ``i`` -> (i, the worker's torch seed, what ``_mark_worker`` left in the worker)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return i, torch.initial_seed(), _WORKER_MARK


_WORKER_MARK = -1


def _mark_worker(worker_id: int) -> None:
    global _WORKER_MARK
    _WORKER_MARK = 100 + worker_id


def test_workers_of_a_spawn_context():
    """Workers started by spawn (or forkserver) get the loader's worker_init_fn pickled: it must
    be a picklable object, not a closure. They still get distinct seeds, and the user's
    worker_init_fn runs in each of them."""
    dl = at.AdaptiveDataLoader(
        _WorkerInfo(),
        batch_size=3,
        num_workers=2,
        multiprocessing_context="spawn",
        worker_init_fn=_mark_worker,
    )
    rows = [tuple(int(v) for v in row) for batch in dl for row in zip(*batch)]
    assert sorted(i for i, _, _ in rows) == list(range(12))
    assert {mark for _, _, mark in rows} == {100, 101}
    seeds = {mark: seed for _, seed, mark in rows}
    assert len(set(seeds.values())) == 2 and dl.worker_init_fn.worker_init_fn is _mark_worker


def _sizes_across_a_restart(rank: int, world_size: int, interrupt: bool) -> dict:
    from adaptrain.torch import _metrics

    if interrupt:  # the first run's goodput model settles on 24 (global) at once
        _metrics.suggest_batch_size = lambda *a, **k: (24 // world_size, 1)
    auto = at.AdaptiveDataLoader(_ids(64), batch_size=16)
    auto.autoscale_batch_size(64)
    plain = at.AdaptiveDataLoader(_ids(64), batch_size=16)
    custom = _ListLoader(list(range(64)), batch_size=16)
    out: dict = {}
    for _epoch in at.remaining_epochs_until(1):
        # Before any iteration of this run (the first two loops are skipped after the restart).
        # (The mixin's current_local_bsz/current_batch_size are None outside loops.)
        a, p = auto._elastic, plain._elastic
        out["auto"] = (
            len(auto),
            a.current_local_bsz,
            auto.accumulation_steps,
            a.current_batch_size,
        )
        out["plain"] = (len(plain), p.current_local_bsz, p.current_batch_size)
        out["auto_sizes"] = [len(x) for (x,) in auto]
        out["plain_sizes"] = [len(x) for (x,) in plain]
        out["custom"] = []
        for i, batch in enumerate(custom):
            if interrupt and i == 1:
                checkpoint.save_all_states()  # what graceful_exit does at a step boundary
                return out
            out["custom"].append((len(batch), custom.current_local_bsz, custom.current_batch_size))
    return out


def test_sizes_follow_the_replica_count_right_after_a_restart(tmp_path):
    """After a restart on another replica count, len() and the batch-size properties describe
    the new count before the first iteration (not the decision checkpointed for the old count);
    an autoscaled loader keeps the checkpointed global batch; a custom loader reading
    current_local_bsz keeps the global batch size."""
    env = {"ADAPTRAIN_CHECKPOINT_PATH": str(tmp_path)}
    [first] = spawn(_sizes_across_a_restart, 1, args=(True,), env=env, timeout=120)
    assert first["auto_sizes"] == [24, 24, 16] and first["plain_sizes"] == [16] * 4
    assert first["custom"] == [(16, 16, 16)]
    res = spawn(_sizes_across_a_restart, 2, args=(False,), env=env, timeout=120)
    for out in res:
        # 24 = 2 × 12; a pass of 64 on 2 replicas: micro-batches of 24, 24, 16 (12, 12, 8 each).
        assert out["auto"] == (3, 12, 1, 24)
        assert out["plain"] == (4, 8, 16)  # 4 × (2 × 8)
        assert out["auto_sizes"] == [] and out["plain_sizes"] == []  # finished before
        assert out["custom"] == [(8, 8, 16)] * 3  # the 48 samples left, 16 per step


def test_min_local_bsz_above_max_batch_size_on_many_replicas_is_logged(monkeypatch, caplog):
    """min_local_bsz × replicas > max_batch_size cannot be honoured: logged with the values."""
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "2")
    dl = at.AdaptiveDataLoader(_ids(64), batch_size=8)
    with caplog.at_level("WARNING", logger="adaptrain.torch.data"):
        dl.autoscale_batch_size(16, local_bsz_bounds=(8, 16))  # 8 × 2 = 16: fine
    assert not caplog.records
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "4")
    dl = at.AdaptiveDataLoader(_ids(64), batch_size=8)
    with caplog.at_level("WARNING", logger="adaptrain.torch.data"):
        dl.autoscale_batch_size(16, local_bsz_bounds=(8, 16))
    [record] = caplog.records
    msg = record.getMessage()
    assert "min_local_bsz=8 on 4 replicas" in msg and "at least 32" in msg, msg
    assert "max_batch_size=16" in msg and dl._elastic.current_batch_size == 32


def test_initial_batch_size_stays_within_max_batch_size(monkeypatch):
    """The first (and restart) batch size within the bounds never exceeds max_batch_size on any
    replica count, unless min_local_bsz × replicas alone does (that case is logged)."""
    bounds = [None, 1, 2, 3, 4, 5]
    checked = 0
    for replicas in (1, 2, 3, 4):
        monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", str(replicas))
        for bsz, max_bsz, lo, hi, accum in itertools.product(
            (1, 3, 4, 6, 7, 9, 10), (10, 11, 12, 16), bounds, bounds, (False, True)
        ):
            if lo is not None and (lo > max_bsz or (hi is not None and lo > hi)):
                continue
            helper = data_mod.AdaptiveDataLoaderHelper(bsz)
            helper.autoscale_batch_size(max_bsz, (lo, hi), gradient_accumulation=accum)
            local, steps = helper.current_local_bsz, helper.accumulation_steps
            case = dict(
                replicas=replicas, bsz=bsz, max=max_bsz, lo=lo, hi=hi, local=local, steps=steps
            )
            assert (lo or 1) <= local <= (hi or local) and steps >= 1, case
            assert accum or steps == 1, case
            if (lo or 1) * replicas <= max_bsz:
                assert local * steps * replicas <= max_bsz, case
                checked += 1
    assert checked > 1000


def test_autoscaled_steps_stay_within_max_batch_size():
    """Samples per optimizer step in an actual pass (one replica; 2 replicas of (4, 4) are the
    same arithmetic): 10 at most, not 3 micro-batches of 4."""
    dl = at.AdaptiveDataLoader(_ids(60), batch_size=10)
    dl.autoscale_batch_size(10, local_bsz_bounds=(None, 4), gradient_accumulation=True)
    per_step, cur = [], 0
    for (x,) in dl:
        cur += len(x)
        if at.current_dataloader().is_optim_step():
            per_step.append(cur)
            cur = 0
    assert sum(per_step) == 60 and max(per_step) <= 10, per_step


def _training_loader_each_epoch(rank: int, world_size: int) -> list[tuple[bool, int, int]]:
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = at.AdaptiveDataParallel(net, opt)
    ds = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    out = []
    for _epoch in at.remaining_epochs_until(2):
        loader = at.AdaptiveDataLoader(ds, batch_size=8)  # a new training loader each epoch
        loader.autoscale_batch_size(32, local_bsz_bounds=(1, 4), gradient_accumulation=True)
        updates = 0
        for x, y in loader:
            before = net.weight.detach().clone()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            updates += int(not torch.equal(before, net.weight))
        out.append((loader.training, loader.accumulation_steps, updates))
    return out


def test_a_training_loader_created_each_epoch_accumulates():
    """autoscale_batch_size makes its loader the training loader, also when an earlier one was:
    the second epoch's loader accumulates 2 micro-batches per optimizer update like the first."""
    [res] = spawn(_training_loader_each_epoch, 1, timeout=120)
    assert res == [(True, 2, 2), (True, 2, 2)]


def test_autoscale_takes_over_the_training_loader_only_outside_its_loop():
    first = at.AdaptiveDataLoader(_ids(8), batch_size=4)
    first.autoscale_batch_size(8)
    second = at.AdaptiveDataLoader(_ids(8), batch_size=4)
    assert first.training and not second.training
    for _ in first:
        with pytest.raises(RuntimeError, match="training loader is being iterated"):
            second.autoscale_batch_size(8)
    assert first.training and not second.training
    second.autoscale_batch_size(8)
    assert second.training and not first.training
    second._elastic.train()  # what AdaptiveDataParallel calls: does not take it back
    first._elastic.train()
    assert second.training and not first.training


def test_len_with_fewer_samples_than_replicas(monkeypatch):
    """len() counts the micro-batches the loop yields on this replica, padded (training) or not
    (evaluation), also when the dataset has fewer samples than replicas."""
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "3")
    monkeypatch.setenv("ADAPTRAIN_REPLICA_RANK", "2")
    dl = at.AdaptiveDataLoader(_ids(2), batch_size=4)
    assert len(dl) == len(list(dl)) == 1  # training: replica 2 repeats a sample
    with torch.no_grad():
        assert len(dl) == len(list(dl)) == 0  # evaluation: no padding
