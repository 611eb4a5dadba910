"""`pagekv up`'s node args (deploy/pod_args.py, pure functions): placeholders, and one SSD
directory per pod whatever the user wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekv.deploy.pod_args import check_placeholders, expand, one_ssd_dir_per_pod


def test_placeholders_become_the_pods_id_and_the_run_dir() -> None:
    args = ["--disk-offload-dir={run_dir}/{pod_id}-ssd", "--kv-events-topic", "kv-{pod_id}"]
    assert expand(args, "node-b", Path("/r")) == ["--disk-offload-dir=/r/node-b-ssd",
                                                   "--kv-events-topic", "kv-node-b"]


def test_braces_that_are_no_placeholder_pass_untouched() -> None:
    args = ['--served-model-name={"a": 1}', "{0}"]
    check_placeholders(args)
    assert expand(args, "node-a", Path("/r")) == args


def test_a_misspelt_placeholder_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"unknown placeholder \{podid\}.*\{pod_id\}, \{run_dir\}"):
        check_placeholders(["--num-gpu-blocks=64", "--disk-offload-dir=/d/{podid}"])


@pytest.mark.parametrize(("given", "wanted"), [
    (["--disk-offload-dir=/d"], ["--disk-offload-dir=/d/{pod_id}"]),
    (["--disk-offload-dir", "/d/", "--x"], ["--disk-offload-dir", "/d/{pod_id}", "--x"]),
    (["--disk-offload-dir={run_dir}/ssd"], ["--disk-offload-dir={run_dir}/ssd/{pod_id}"]),
    # argparse keeps the last one: that is the one made per pod
    (["--disk-offload-dir=/a", "--disk-offload-dir=/b"],
     ["--disk-offload-dir=/a", "--disk-offload-dir=/b/{pod_id}"]),
])
def test_one_directory_for_every_pod_becomes_one_sub_directory_each(given: list[str],
                                                                     wanted: list[str]) -> None:
    got, note = one_ssd_dir_per_pod(given)
    assert got == wanted
    assert note is not None and "its own sub-directory" in note and "<pod id>" in note


def test_bytes_without_a_directory_get_one_in_the_run_dir() -> None:
    got, note = one_ssd_dir_per_pod(["--disk-offload-bytes=8MiB"])
    assert got == ["--disk-offload-bytes=8MiB", "--disk-offload-dir", "{run_dir}/{pod_id}-ssd"]
    assert note is not None and "{run_dir}/<pod id>-ssd" in note


@pytest.mark.parametrize("given", [
    [], ["--num-gpu-blocks=64"], ["--disk-offload-dir=/d/{pod_id}"],
    ["--disk-offload-dir", "{run_dir}/{pod_id}-ssd", "--disk-offload-bytes", "1GiB"],
    ["--disk-offload-dir="],  # empty: left for the pod to refuse, never "/<pod id>"
])
def test_args_that_already_give_each_pod_its_own_are_left_alone(given: list[str]) -> None:
    assert one_ssd_dir_per_pod(given) == (given, None)
