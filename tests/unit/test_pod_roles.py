"""P/D roles in deployments, the pure parts: how `pagekv up` and `pagekv ray-up` turn role
counts into pods (ids, roles, the argv or engine options each pod starts with)."""

from __future__ import annotations

import argparse

import pytest

from pagekv.deploy import local_cluster, pod_roles
from pagekv.deploy.pod_roles import mixed_pod_count, ray_pod_specs
from pagekv.kvnode.engine.config import EngineArgs


def up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    local_cluster.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_role_counts_replace_the_default_two_mixed_pods() -> None:
    cluster = local_cluster.cluster_from(up_args("--prefill-nodes", "1", "--decode-nodes", "2"))
    assert [(s.pod_id, s.role) for s in cluster.pod_plan()] == [
        ("prefill-a", "prefill"), ("decode-a", "decode"), ("decode-b", "decode")]
    # Mixed pods keep the ids they always had, first; --nodes still counts them.
    plain = local_cluster.cluster_from(up_args())
    assert [s.pod_id for s in plain.pod_plan()] == ["node-a", "node-b"]
    both = local_cluster.cluster_from(up_args("--nodes", "1", "--decode-nodes", "1"))
    assert [(s.pod_id, s.role) for s in both.pod_plan()] == [("node-a", "mixed"),
                                                             ("decode-a", "decode")]
    assert pod_roles.describe_roles(both.pod_plan()) == "1 mixed + 1 decode"
    assert pod_roles.local_pod_id("prefill", 26) == "prefill-26"


def test_router_args_reach_the_router() -> None:
    cluster = local_cluster.cluster_from(up_args("--router-arg=--pd-threshold-tokens=64"))
    assert cluster.router_args == ["--pd-threshold-tokens=64"]


@pytest.mark.parametrize("argv, message", [
    (["--decode-nodes", "-1"], r"--decode-nodes must be >= 0, got -1"),
    (["--nodes", "-2"], r"--nodes must be >= 0"),
])
def test_negative_counts_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        local_cluster.cluster_from(up_args(*argv))


def test_a_role_among_every_pods_flags_is_refused_before_anything_starts(tmp_path) -> None:
    for flags in (["--role=decode"], ["--role", "prefill"]):
        cluster = local_cluster.LocalCluster(nodes=1, run_dir=tmp_path, node_args=flags)
        with pytest.raises(ValueError, match=r"--prefill-nodes N and --decode-nodes M"):
            cluster.start()
        assert cluster.children == [] and cluster.redis is None


def test_role_flags_are_what_pagekv_node_parses() -> None:
    from pagekv.kvnode.pod.engine_flags import add_engine_arguments, engine_args_from

    for role in ("prefill", "decode", "mixed"):
        parser = argparse.ArgumentParser()
        add_engine_arguments(parser)
        parsed = engine_args_from(parser.parse_args(pod_roles.role_flags(role)))
        assert parsed.role == role
    assert pod_roles.role_flags("mixed") == []  # a mixed pod's argv is what it always was


def test_only_prefill_pods_is_warned_about() -> None:
    assert pod_roles.plan_warning(pod_roles.pod_plan(0, 2, 0)) is not None
    assert pod_roles.plan_warning(pod_roles.pod_plan(0, 1, 1)) is None
    assert pod_roles.plan_warning(pod_roles.pod_plan(2)) is None
    assert "splits nothing" in pod_roles.split_note(pod_roles.pod_plan(1, 0, 1))
    assert "prefill pod" in pod_roles.split_note(pod_roles.pod_plan(0, 1, 1))


def test_ray_specs_carry_each_pods_role_into_its_engine_options() -> None:
    base = {"model": "pagekv-tiny", "disk_offload_dir": "/ssd", "role": "mixed"}
    specs = ray_pod_specs(1, 1, 2, base)
    assert [(s.pod_id, s.role) for s in specs] == [
        ("ray-pod-0", "mixed"), ("ray-prefill-0", "prefill"), ("ray-decode-0", "decode"),
        ("ray-decode-1", "decode")]
    for spec in specs:
        assert EngineArgs(**spec.engine_kwargs).role == spec.role  # what the actor builds
        assert spec.engine_kwargs["disk_offload_dir"] == f"/ssd/{spec.pod_id}"
    assert base["role"] == "mixed" and base["disk_offload_dir"] == "/ssd"  # not mutated


def test_ray_engine_role_names_every_pod_or_is_refused_beside_counts() -> None:
    specs = ray_pod_specs(2, 0, 0, {"model": "pagekv-tiny", "role": "decode"})
    assert [(s.pod_id, s.role) for s in specs] == [("ray-decode-0", "decode"),
                                                  ("ray-decode-1", "decode")]
    with pytest.raises(ValueError, match=r"--role prefill gives every pod one role"):
        ray_pod_specs(0, 1, 1, {"model": "pagekv-tiny", "role": "prefill"})
    with pytest.raises(ValueError, match="no pods to deploy"):
        ray_pod_specs(0, 0, 0, {"model": "pagekv-tiny"})


def test_ray_mixed_count_defaults() -> None:
    assert mixed_pod_count(None, 0, 0, gpus=0) == 2
    assert mixed_pod_count(None, 0, 0, gpus=4) == 4
    assert mixed_pod_count(None, 1, 1, gpus=4) == 0
    assert mixed_pod_count(3, 1, 1, gpus=0) == 3
