import pytest

from hvtrain.errors import LaunchError
from hvtrain.launch.builders import LaunchRequest, build_horovodrun, build_mpirun
from hvtrain.launch.hostfile import HostSlots
from hvtrain.launch.mpi import parse_version_output

HOSTS = (HostSlots("n1", 2), HostSlots("n2", 2))
CMD = ("/venv/bin/python", "-m", "hvtrain", "train", "exp.yaml")
ENV = {"PATH": "/venv/bin:/usr/bin", "HVTRAIN_BACKEND": "torch", "HOROVOD_CYCLE_TIME": "5", "SECRET": "x"}


def test_horovodrun_argv():
    argv, env = build_horovodrun(LaunchRequest(4, CMD, HOSTS, launcher_path="/venv/bin/horovodrun"), ENV)
    assert argv == ["/venv/bin/horovodrun", "-np", "4", "-H", "n1:2,n2:2", "--mpi", *CMD]
    assert {k: v for k, v in env.items() if "keepalive" not in k} == ENV
    argv, env = build_horovodrun(LaunchRequest(2, CMD, HOSTS, gloo=True), ENV)
    assert argv == ["horovodrun", "-np", "2", "-H", "n1:2,n2:2", "--gloo", *CMD]
    assert env == ENV  # Gloo: no mpirun daemons to keep alive


def test_mpirun_daemons_get_tcp_keepalive_so_a_lost_host_ends_the_job():
    """Defect: with a host's link cut, mpirun waited on its daemon there for good (measured: still
    running after 150 s); OOB keepalive ends it naming the node. A value the user set wins."""
    for env in (build_mpirun(LaunchRequest(2, CMD, HOSTS), "openmpi", {})[1],
                build_horovodrun(LaunchRequest(2, CMD, HOSTS), {})[1]):
        assert env["OMPI_MCA_oob_tcp_keepalive_time"] == "10" and env["PRTE_MCA_oob_tcp_keepalive_probes"] == "3"
    _, env = build_mpirun(LaunchRequest(2, CMD, HOSTS), "openmpi", {"OMPI_MCA_oob_tcp_keepalive_time": "7"})
    assert env["OMPI_MCA_oob_tcp_keepalive_time"] == "7"
    _, env = build_mpirun(LaunchRequest(2, CMD, HOSTS, hostfile="/tmp/h"), "mpich", {})
    assert not any("keepalive" in k for k in env)


def test_openmpi_argv_with_hostfile_and_forwarding():
    req = LaunchRequest(3, CMD, HOSTS, hostfile="/tmp/h", launcher_path="/usr/bin/mpirun", as_root=True)
    argv, _ = build_mpirun(req, "openmpi", ENV)
    assert argv == ["/usr/bin/mpirun", "-np", "3", "--hostfile", "/tmp/h", "--bind-to", "none", "--map-by", "slot",
                    "--allow-run-as-root", "-x", "HOROVOD_CYCLE_TIME", "-x", "HVTRAIN_BACKEND", "-x", "PATH", *CMD]


def test_openmpi_inline_hosts():
    argv, _ = build_mpirun(LaunchRequest(1, CMD, HOSTS), "openmpi", {})
    assert argv == ["mpirun", "-np", "1", "-H", "n1:2,n2:2", "--bind-to", "none", "--map-by", "slot", *CMD]


def test_mpich_argv():
    argv, _ = build_mpirun(LaunchRequest(2, CMD, HOSTS, hostfile="/tmp/h"), "mpich", {"HVTRAIN_BACKEND": "torch"})
    assert argv == ["mpirun", "-n", "2", "-f", "/tmp/h", "-genv", "HVTRAIN_BACKEND", "torch", *CMD]


def test_too_many_ranks_and_bad_combinations():
    with pytest.raises(LaunchError, match=r"-np 5 asks for more ranks than the 4 slot\(s\) available \(n1:2, n2:2\)"):
        build_horovodrun(LaunchRequest(5, CMD, HOSTS), ENV)
    with pytest.raises(LaunchError, match="--gloo is a horovodrun option"):
        build_mpirun(LaunchRequest(2, CMD, HOSTS, gloo=True), "openmpi", ENV)
    with pytest.raises(LaunchError, match="unsupported MPI flavour 'unknown'"):
        build_mpirun(LaunchRequest(2, CMD, HOSTS), "unknown", ENV)


def test_host_values_stay_single_argv_elements():
    # Whatever a command argument contains, it is one argv element, never shell-split.
    cmd = ("python", "-m", "hvtrain", "train", "a b; rm -rf /")
    argv, _ = build_horovodrun(LaunchRequest(1, cmd, HOSTS), {})
    assert argv[-1] == "a b; rm -rf /"


@pytest.mark.parametrize("text,expected", [
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/", ("openmpi", "4.1.4")),
    ("mpirun (Open MPI) 5.0.7\n", ("openmpi", "5.0.7")),
    ("HYDRA build details:\n    Version:                                 4.1.2\n", ("mpich", "4.1.2")),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619", ("intel", "2021.10")),
    ("something else", ("unknown", "?")),
])
def test_mpi_flavour_detection(text, expected):
    assert parse_version_output(text) == expected
