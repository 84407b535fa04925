"""ElasticSampler and the pass plan: exact partition of the remaining samples, no padding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptrain.torch.data import ElasticSampler, plan_pass


@pytest.fixture
def replicas(monkeypatch):
    def set_world(n: int, r: int) -> None:
        monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", str(n))
        monkeypatch.setenv("ADAPTRAIN_REPLICA_RANK", str(r))

    return set_world


@pytest.mark.parametrize("n_replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("index", [0, 1, 50, 98, 101])
def test_partition_from_index(replicas, n_replicas, index):
    data = list(range(101))
    seen, lengths = [], []
    for r in range(n_replicas):
        replicas(n_replicas, r)
        s = ElasticSampler(data, shuffle=True)
        s.set_epoch(3, index=index)
        local = list(s)
        assert len(local) == len(s)
        lengths.append(len(local))
        seen += local
        order = s.order()
    # every remaining sample exactly once (index 101 starts the epoch's next pass, as in AdaptDL)
    assert sorted(seen) == sorted(order[index % len(data) :])
    assert max(lengths) - min(lengths) <= 1


def test_shuffle_deterministic_per_epoch(replicas):
    replicas(1, 0)
    a, b = ElasticSampler(range(50)), ElasticSampler(range(50))
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    b.set_epoch(2)
    assert list(a) != list(b)
    c = ElasticSampler(range(50), shuffle=False)
    assert list(c) == list(range(50))


def test_bad_index(replicas):
    replicas(1, 0)
    s = ElasticSampler(range(10))
    with pytest.raises(ValueError, match="index=-1"):
        s.set_epoch(0, -1)


@settings(max_examples=300, deadline=None)
@given(
    end=st.integers(1, 300),
    start_frac=st.floats(0, 1, exclude_max=True),
    local_bsz=st.integers(1, 20),
    accum=st.integers(1, 4),
    n_replicas=st.integers(1, 5),
    max_steps=st.one_of(st.none(), st.integers(1, 5)),
)
def test_plan_covers_exactly_once(end, start_frac, local_bsz, accum, n_replicas, max_steps):
    start = int(start_frac * end)
    plan = plan_pass(start, end, local_bsz, accum, n_replicas, max_steps=max_steps)
    pos = start
    steps, in_step = 0, 0
    for mb in plan:
        assert mb.start == pos  # contiguous, no gap, no overlap
        pos += mb.size
        g = local_bsz * n_replicas
        assert 0 < mb.size <= g + n_replicas - 1
        if mb.size < n_replicas:  # only when the whole pass had fewer than R samples left
            assert end - start < n_replicas and len(plan) == 1
        assert mb.first == (in_step == 0)
        in_step += 1
        assert in_step <= accum
        if mb.optim:
            steps, in_step = steps + 1, 0
    assert in_step == 0  # the last micro-batch ends an optimizer step
    if max_steps is None or steps < max_steps:
        assert pos == end
    else:
        assert steps == max_steps


@settings(max_examples=300, deadline=None)
@given(
    end=st.integers(1, 300),
    local_bsz=st.integers(1, 20),
    accum=st.integers(1, 4),
    n_replicas=st.integers(1, 5),
)
def test_plan_with_drop_last_holds_only_full_micro_batches(end, local_bsz, accum, n_replicas):
    # drop_last promises fixed batch shapes: no remainder folded into the last full step.
    g = local_bsz * n_replicas
    plan = plan_pass(0, end, local_bsz, accum, n_replicas, drop_last=True)
    assert all(mb.size == g for mb in plan)
    assert len(plan) == (end // (g * accum)) * accum  # only the incomplete tail is dropped


def test_plan_drop_last_and_bad_args():
    plan = plan_pass(0, 103, 10, 1, 1, drop_last=True)
    assert sum(mb.size for mb in plan) == 100
    with pytest.raises(ValueError, match="local_bsz=0"):
        plan_pass(0, 10, 0, 1, 1)
