"""Scheduler allocations as hosts (issue 11): Slurm node lists and task counts, PBS, LSF."""

from __future__ import annotations

import stat

import pytest

from hvtrain.errors import HostfileError
from hvtrain.launch.scheduler import detect, expand_counts, expand_nodelist, render, require

# Real-world Slurm node lists and what `scontrol show hostnames` prints for them (order kept).
NODELISTS = [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[001-003],cpu7", ["gpu001", "gpu002", "gpu003", "cpu7"]),
    ("n[1-2],m[3-4]", ["n1", "n2", "m3", "m4"]),
    ("a[1-2]-ib[3-4]", ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("x[9-11]", ["x9", "x10", "x11"]),
    ("c[0-1]n[08-09]", ["c0n08", "c0n09", "c1n08", "c1n09"]),
    ("tux[098-101]", ["tux098", "tux099", "tux100", "tux101"]),
    ("login1,compute[3,5-6]", ["login1", "compute3", "compute5", "compute6"]),
    ("nid0[0010-0012]", ["nid00010", "nid00011", "nid00012"]),
]


@pytest.mark.parametrize("text, hosts", NODELISTS)
def test_nodelist_forms_expand_like_scontrol(text, hosts):
    assert expand_nodelist(text) == hosts


def test_scontrol_is_preferred_when_present(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 3\necho from-scontrol-1\n"
                    "echo from-scontrol-2\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert expand_nodelist("whatever[1-2]", str(fake)) == ["from-scontrol-1", "from-scontrol-2"]
    alloc = detect({"SLURM_JOB_NODELIST": "whatever[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}, scontrol=str(fake))
    assert [(h.host, h.slots) for h in alloc.hosts] == [("from-scontrol-1", 2), ("from-scontrol-2", 2)]
    assert "scontrol" in alloc.notes[0]


@pytest.mark.parametrize("text, counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]),
                                          ("36(x2)", [36, 36])])
def test_task_counts(text, counts):
    assert expand_counts(text) == counts


def test_slurm_allocation_hosts_and_what_was_read():
    env = {"SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_ID": "42"}
    alloc = detect(env, scontrol="")
    assert alloc.scheduler == "slurm" and alloc.slots == 7
    assert [(h.host, h.slots) for h in alloc.hosts] == [("node01", 2), ("node02", 2), ("node03", 2), ("node07", 1)]
    assert alloc.variables == env
    assert render(alloc.hosts, "openmpi") == "node01 slots=2\nnode02 slots=2\nnode03 slots=2\nnode07 slots=1\n"
    assert render(alloc.hosts, "horovod") == "node01:2,node02:2,node03:2,node07:1\n"
    assert render(alloc.hosts, "mpich") == "node01:2\nnode02:2\nnode03:2\nnode07:1\n"


@pytest.mark.parametrize("env, match", [
    ({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"}, "gives 2 node.* lists 3"),
    ({"SLURM_JOB_NODELIST": "n[1-3", "SLURM_TASKS_PER_NODE": "1"}, "not a Slurm node list"),
    ({"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "two"}, "expected counts like"),
    ({"SLURM_JOB_NODELIST": "n1;rm -rf /", "SLURM_TASKS_PER_NODE": "1"}, "invalid host name"),
    ({"LSB_MCPU_HOSTS": "a 2 b"}, "expected 'host N host N"),
])
def test_malformed_allocations_name_the_variable(env, match):
    with pytest.raises(HostfileError, match=match):
        detect(env, scontrol="")


def test_pbs_nodefile_one_line_per_slot(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn1.cluster\ncn1.cluster\ncn2.cluster\ncn1.cluster\ncn2.cluster\n")
    alloc = detect({"PBS_NODEFILE": str(nodefile), "PBS_JOBID": "7.pbs"})
    assert alloc.scheduler == "pbs"
    assert [(h.host, h.slots) for h in alloc.hosts] == [("cn1.cluster", 3), ("cn2.cluster", 2)]
    assert alloc.variables == {"PBS_NODEFILE": str(nodefile), "PBS_JOBID": "7.pbs"}


def test_lsf_drops_the_launch_node_on_csm_systems_only(tmp_path):
    csm = detect({"LSB_MCPU_HOSTS": "batch1 1 c01 1 c02 1", "LSB_JOBID": "9", "CSM_ALLOCATION_ID": "5"})
    assert [(h.host, h.slots) for h in csm.hosts] == [("c01", 1), ("c02", 1)]
    assert "dropped the launch node batch1" in csm.notes[0]
    ordinary = detect({"LSB_MCPU_HOSTS": "hA 1 hB 2"})  # -n 3: the first host is a compute host too
    assert [(h.host, h.slots) for h in ordinary.hosts] == [("hA", 1), ("hB", 2)] and not ordinary.notes
    hostfile = tmp_path / "djob"
    hostfile.write_text("batch1\n" + "c01\n" * 3 + "c02\n" * 3)
    per_slot = detect({"LSB_DJOB_HOSTFILE": str(hostfile), "LSB_MCPU_HOSTS": "ignored 1", "CSM_ALLOCATION_ID": "5"})
    assert [(h.host, h.slots) for h in per_slot.hosts] == [("c01", 3), ("c02", 3)]


def test_slurm_job_step_uses_the_steps_list_and_counts_together():
    """Defect: inside `srun --pty bash` srun rewrites SLURM_TASKS_PER_NODE for the step (1 task)
    while SLURM_JOB_NODELIST still lists the job's 2 nodes: 'gives 1 node(s) but lists 2'."""
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "n1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_ID": "0"}
    alloc = detect(env, scontrol="")
    assert [(h.host, h.slots) for h in alloc.hosts] == [("n1", 1)]
    cpus = detect({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "64(x2)", "SLURM_CPUS_PER_TASK": "16"},
                  scontrol="")
    assert [h.slots for h in cpus.hosts] == [4, 4]
    with pytest.raises(HostfileError, match="heterogeneous"):
        detect({"SLURM_JOB_NODELIST": "n1", "SLURM_HET_SIZE": "2"}, scontrol="")


def test_outside_an_allocation():
    assert detect({}) is None
    with pytest.raises(HostfileError, match="no scheduler allocation found"):
        require({})
