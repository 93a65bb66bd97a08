"""Multi-host for real on one machine (issue 11): 2 hosts x 2 slots as network namespaces with
their own addresses, hostnames and sshd (tests/multihost.py). Every launcher, given a hostfile of
those addresses, must train to the weights of the single-host np=4 run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import hvtrain, load_weights, max_abs_diff, run, run_env, tool
from tests.multihost import NamespaceHosts, missing

CFG = "examples/digits_mlp.yaml"
ARGS = ["--quiet", "--set", "train.epochs=2"]


@pytest.fixture(scope="module")
def hosts():
    gone = missing()
    if gone:  # never a silent skip: CI runs as root with these installed by `make setup`
        pytest.fail(f"multi-host tests need: {', '.join(gone)}")
    with NamespaceHosts(2) as h:
        yield h


def env_for_hosts() -> dict[str, str]:
    env = run_env()
    # Each namespace host has lo and eth0: MPI must talk over eth0 (lo is 127.0.0.1 on every host).
    env.update({"OMPI_MCA_btl_tcp_if_include": "eth0", "OMPI_MCA_oob_tcp_if_include": "eth0"})
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single-host")
    run([tool("mpirun"), "-np", "4", "--oversubscribe", "--bind-to", "none",
         *hvtrain("train", CFG, *ARGS, "--output-dir", str(out))], timeout=400)
    return load_weights(out / "final.safetensors")


def check(out, reference, hosts) -> None:
    m = json.loads((out / "manifest.json").read_text())
    assert sorted(m["rank_hosts"]) == sorted(hosts.names * 2), m["rank_hosts"]  # 2 ranks on each host
    gap = max_abs_diff(reference, load_weights(out / "final.safetensors"))
    assert gap <= 1e-6, f"2 hosts x 2 slots differ from one host np=4 by {gap}"


def test_mpirun_hostfile_across_two_hosts(hosts, reference, tmp_path):
    argv = [tool("mpirun"), "-np", "4", "--hostfile", str(hosts.hostfile(2)), "--bind-to", "none",
            "--allow-run-as-root", "-x", "PATH", *hvtrain("train", CFG, *ARGS, "--output-dir", str(tmp_path))]
    hosts.launch(argv, env=env_for_hosts(), timeout=400)
    check(tmp_path, reference, hosts)


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_horovodrun_hostfile_across_two_hosts(hosts, reference, tmp_path, controller):
    argv = [tool("horovodrun"), "-np", "4", "--hostfile", str(hosts.hostfile(2)), "--network-interface", "eth0",
            f"--{controller}", *hvtrain("train", CFG, *ARGS, "--output-dir", str(tmp_path))]
    hosts.launch(argv, env=env_for_hosts(), timeout=400)
    check(tmp_path, reference, hosts)


def test_hvtrain_launch_hostfile_across_two_hosts(hosts, reference, tmp_path):
    argv = hvtrain("launch", "--hostfile", str(hosts.hostfile(2)), "--", "train", CFG, *ARGS,
                   "--output-dir", str(tmp_path))
    proc = hosts.launch(argv, env=env_for_hosts(), timeout=400)
    assert "-np 4" in proc.stderr  # every slot of the hostfile by default
    check(tmp_path, reference, hosts)


def test_traffic_stays_inside_the_fixture(hosts):
    """The root namespace has none of the fixture's addresses; each host namespace has loopback and
    its own /24 on eth0 only, and no default route: nothing outside the fixture is reachable."""
    import subprocess

    mine = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    assert all(a not in mine for a in hosts.addresses), mine
    for ns, addr in zip(hosts.names, hosts.addresses, strict=True):
        routes = subprocess.run(["ip", "-n", ns, "-4", "route"], capture_output=True, text=True, check=True).stdout
        assert routes.split() == [f"{hosts.net}.0/24", "dev", "eth0", "proto", "kernel", "scope", "link", "src", addr]
        addrs = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr"], capture_output=True, text=True).stdout
        assert sorted(ln.split()[3] for ln in addrs.splitlines()) == sorted(["127.0.0.1/8", f"{addr}/24"])
