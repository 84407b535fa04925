"""ElasticSampler as AdaptDL's: ``set_epoch`` sets only the epoch and the index, and an index
past the dataset's end continues into a later pass of the epoch (AdaptDL's multi-pass loader
rounds its index up to the next multiple of the dataset's length after each pass)."""

from __future__ import annotations

import pytest

from adaptrain.torch import ElasticSampler


@pytest.fixture
def world(monkeypatch):
    monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", "1")
    monkeypatch.setenv("ADAPTRAIN_REPLICA_RANK", "0")


def test_set_epoch_keeps_the_callers_replicas_and_rank(world):
    s = ElasticSampler(range(20), shuffle=False)
    s.num_replicas, s.rank = 4, 3  # e.g. one sampler per simulated replica
    s.set_epoch(2, index=5)
    assert (s.num_replicas, s.rank, s.epoch, s.index) == (4, 3, 2, 5)
    assert list(s) == [8, 12, 16] and len(s) == 3


@pytest.mark.parametrize("shuffle", [False, True])
def test_index_past_the_end_continues_into_later_passes(world, shuffle):
    n = 10
    s = ElasticSampler(range(n), shuffle=shuffle)
    passes = []
    for k in range(3):
        s.set_epoch(1, index=k * n)
        passes.append(list(s))
        assert len(s) == n and sorted(passes[-1]) == list(range(n))
    if shuffle:  # each pass its own deterministic order; the first is the epoch's order
        assert len({tuple(p) for p in passes}) == 3
        s.set_epoch(1)
        assert list(s) == passes[0] == s.order()
    else:
        assert passes == [list(range(n))] * 3
    # a position inside a later pass: that pass's order from there on
    s.set_epoch(1, index=2 * n + 7)
    assert list(s) == passes[2][7:] and len(s) == 3
    again = ElasticSampler(range(n), shuffle=shuffle)
    again.set_epoch(1, index=2 * n + 7)
    assert list(again) == list(s)  # the same on every replica and after a restart


def test_later_pass_partitions_over_replicas(monkeypatch):
    n, replicas, index = 11, 3, 2 * 11 + 4
    seen = []
    for r in range(replicas):
        monkeypatch.setenv("ADAPTRAIN_NUM_REPLICAS", str(replicas))
        monkeypatch.setenv("ADAPTRAIN_REPLICA_RANK", str(r))
        s = ElasticSampler(range(n))
        s.set_epoch(0, index=index)
        seen += list(s)
    assert sorted(seen) == sorted(s.order()[index % n :])  # the rest of pass 2, exactly once


def test_adaptdl_multi_pass_loader_resumes(world):
    """AdaptDL's loader idiom: advance the index by the samples served, round it up to the next
    multiple of the dataset's length at the end of a pass; a restart resumes from the index."""
    n = 8

    def run(start: int, stop: int) -> list[int]:
        s = ElasticSampler(range(n))
        index, out = start, []
        while index < stop:
            s.set_epoch(0, index=index)
            for i in s:
                out.append(i)
                index += 1
                if index == stop:
                    return out
            index -= index % -n  # next pass
        return out

    whole = run(0, 3 * n)
    assert whole == run(0, 13) + run(13, 3 * n)  # interrupted mid-way through the 2nd pass
    for k in range(3):
        assert sorted(whole[k * n : (k + 1) * n]) == list(range(n))


def test_negative_index_is_refused(world):
    s = ElasticSampler(range(10))
    with pytest.raises(ValueError, match="index=-1"):
        s.set_epoch(0, -1)
