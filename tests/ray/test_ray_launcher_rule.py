"""The replica-count rule and the placement of ``adaptrain ray submit`` (no cluster needed)."""

from __future__ import annotations

import pytest

from adaptrain.ray._launch_policy import ScalingRule, plan_placement, replica_capacity


def hints(net: float, var: float, profiled: int = 1) -> dict:
    """Rank 0's hints with a goodput model: ``net`` scales the synchronisation costs, ``var``
    the gradient noise (large noise: large batches keep their statistical efficiency)."""
    return {
        "initBatchSize": 32,
        "maxBatchSize": 4096,
        "localBszBounds": [16, 256],
        "maxProfiledReplicas": profiled,
        "gradientAccumulation": False,
        "perfParams": {
            "alpha_c": 0.01,
            "beta_c": 0.001,
            "alpha_n": net,
            "beta_n": net / 10,
            "alpha_r": net / 2,
            "beta_r": net / 20,
            "gamma": 1.5,
        },
        "gradParams": {"norm": 1.0, "var": var},
    }


SCALES = hints(0.001, 100.0, profiled=4)  # s(r) ~ 0.99 r
SLOW_NETWORK = hints(0.5, 100.0, profiled=8)  # one node: s = 1, 1.43, 1.88, 2.24, 2.55, 2.79
SATURATES = hints(0.001, 0.01, profiled=8)  # s = 1, 1.61, 1.61, ...: nothing past 2
MODERATE = hints(0.05, 10.0, profiled=8)  # s = 1, 1.36, 1.70, 1.93, 2.09 (one per node)


def test_without_a_model_it_explores_by_doubling_up_to_the_maximum():
    rule = ScalingRule(max_replicas=6)
    assert rule.target(None, current=0) == 2
    assert rule.target(None, current=2) == 4
    assert rule.target({"initBatchSize": 32, "maxProfiledReplicas": 4}, current=2) == 6
    assert ScalingRule(max_replicas=1).target(None, current=0) == 1
    # no evidence: grow when offered, never shrink
    assert rule.worth(None, current=2, candidate=4)
    assert not rule.worth(None, current=4, candidate=2)


def test_a_job_that_scales_grows_but_no_further_than_twice_what_it_measured():
    rule = ScalingRule(max_replicas=16)
    assert rule.target(SCALES, current=4) == 8
    assert rule.target(hints(0.001, 100.0, profiled=1), current=1) == 2
    assert rule.worth(SCALES, current=4, candidate=8)


def test_every_replica_must_bring_half_a_replica_of_speedup():
    rule = ScalingRule(max_replicas=8)
    # across nodes (one replica per node) the slow network makes 2 replicas slower than 1
    assert rule.target(SLOW_NETWORK, current=1, per_node=1) == 1
    # within one 8-slot node: s(5)/5 = 0.51 passes, s(6)/6 = 0.47 does not
    assert rule.target(SLOW_NETWORK, current=1, per_node=8) == 5
    assert ScalingRule(8, min_efficiency=0.6).target(SLOW_NETWORK, 1, per_node=8) == 3


def test_no_replica_is_added_for_no_gain():
    rule = ScalingRule(max_replicas=8)
    assert rule.target(SATURATES, current=1) == 2


def test_the_margin_keeps_it_from_flapping():
    rule = ScalingRule(max_replicas=8)  # margin 10%, min_efficiency 0.5
    assert rule.target(MODERATE, current=2) == 3  # s(3)/3 = 0.57; s(4)/4 = 0.48
    assert rule.worth(MODERATE, current=2, candidate=3)  # 1.70 >= 1.1 * 1.36
    # at 4 (efficiency 0.48, inside the margin below 0.5), going back to 3 is not worth it
    assert not rule.worth(MODERATE, current=4, candidate=3)
    # at 5 (0.42 < 0.45) it is
    assert rule.worth(MODERATE, current=5, candidate=3)
    # a gain under the margin is no reason to restart
    assert not ScalingRule(8, margin=0.3).worth(MODERATE, current=2, candidate=3)


def test_rule_arguments_are_checked():
    with pytest.raises(ValueError):
        ScalingRule(0)
    with pytest.raises(ValueError):
        ScalingRule(4, min_efficiency=1.5)
    with pytest.raises(ValueError):
        ScalingRule(4, margin=1.0)


def test_capacity_counts_whole_replicas_of_each_resource():
    assert replica_capacity({"CPU": 8.0, "GPU": 2.0}, cpus=2, gpus=1) == 2
    assert replica_capacity({"CPU": 8.0}, cpus=2, gpus=1) == 0
    assert replica_capacity({"CPU": 3.0}, cpus=1.5, gpus=0) == 2
    assert replica_capacity({"CPU": 0.0}, cpus=1, gpus=0) == 0
    with pytest.raises(ValueError):
        replica_capacity({"CPU": 4.0}, cpus=0, gpus=0)


def test_placement_packs_nodes_keyed_by_id_preferring_those_in_use():
    capacity = {"node-b": 2, "node-a": 4, "node-c": 4}
    # the roomiest first (ties by ID)
    assert plan_placement(capacity, 6) == {"node-a": 4, "node-c": 2}
    assert plan_placement(capacity, 3) == {"node-a": 3}
    # the nodes it ran on come first; rank 0 on the node with most replicas
    assert plan_placement(capacity, 6, prefer={"node-c": 2, "node-b": 2}) == {
        "node-c": 4,
        "node-b": 2,
    }
    assert plan_placement(capacity, 20) == {"node-a": 4, "node-c": 4, "node-b": 2}
    assert plan_placement({"x": 0}, 2) == {}
