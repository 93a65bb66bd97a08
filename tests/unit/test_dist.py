"""Process facts without Horovod: GPU pinning choice, Horovod knobs and who wins over them."""

import os
import re

import pytest

from hvtrain.config.autotune import best_autotuned
from hvtrain.config.schema import HorovodConfig
from hvtrain.errors import HvtrainError, LaunchError
from hvtrain.launch.process import ProcessInfo, cpu_share, default_threads, local_gpu
from hvtrain.runtime.knobs import horovod_env, mpi_env

MB64 = str(64 * 1024 * 1024)


@pytest.fixture(autouse=True)
def no_user_horovod_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("HOROVOD_")]:
        monkeypatch.delenv(name)


# ----------------------------------------------------------------------------- GPU pinning


@pytest.mark.parametrize("local_size,gpus", [(1, 1), (2, 2), (2, 8), (4, 4)])
def test_each_local_rank_pins_its_own_gpu(local_size, gpus):
    pinned = [local_gpu(r, local_size, gpus) for r in range(local_size)]
    assert pinned == list(range(local_size))  # distinct devices, the local rank's index


@pytest.mark.parametrize("local_rank,local_size", [(0, 1), (1, 2), (3, 4)])
def test_no_gpu_means_cpu(local_rank, local_size):
    assert local_gpu(local_rank, local_size, 0) is None


def test_more_ranks_than_gpus_fails_on_every_rank_alike():
    # also ranks 0 and 1, which would have a GPU: one rank failing alone would hang the others
    for rank in range(4):
        with pytest.raises(LaunchError) as e:
            local_gpu(rank, 4, 2)
        assert str(e.value).startswith("4 ranks on this host but 2 GPU(s): start at most 2 rank(s) per host")
        assert isinstance(e.value, HvtrainError)  # a clean one-line CLI error, exit 2


@pytest.mark.parametrize("local_rank,local_size", [(-1, 2), (2, 2)])
def test_local_rank_outside_local_size_is_a_bug(local_rank, local_size):
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, 2\)"):
        local_gpu(local_rank, local_size, 2)


# ----------------------------------------------------------------------------- HOROVOD_* precedence


def test_config_knobs_become_horovod_variables():
    assert horovod_env(HorovodConfig(5.0, 64.0)) == {"HOROVOD_CYCLE_TIME": "5", "HOROVOD_FUSION_THRESHOLD": MB64}
    assert horovod_env(HorovodConfig(0.5, 1.5))["HOROVOD_CYCLE_TIME"] == "0.5"
    assert horovod_env(HorovodConfig(0.5, 1.5))["HOROVOD_FUSION_THRESHOLD"] == str(3 * 512 * 1024)


def test_a_variable_set_by_the_user_wins_over_the_config(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "1.5")
    env = horovod_env(HorovodConfig(5.0, 64.0))
    assert env == {"HOROVOD_FUSION_THRESHOLD": MB64}  # the config's cycle time is not offered at all
    for k, v in env.items():  # what the runtime does before hvd.init() (undone after the test)
        monkeypatch.setenv(k, v)
    assert os.environ["HOROVOD_CYCLE_TIME"] == "1.5"
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")  # 0 = no fusion: a meaningful user value
    assert horovod_env(HorovodConfig(5.0, 64.0)) == {}


def test_elastic_leaves_the_fusion_threshold_to_horovod():
    assert horovod_env(HorovodConfig(5.0, 64.0), elastic=True) == {"HOROVOD_CYCLE_TIME": "5"}


def test_tuning_knobs_become_horovod_variables(tmp_path):
    h = HorovodConfig(cache_capacity=0, autotune=True, timeline="tl.json")
    env = horovod_env(h, out_dir=tmp_path)
    assert env["HOROVOD_CACHE_CAPACITY"] == "0" and env["HOROVOD_AUTOTUNE"] == "1"
    assert env["HOROVOD_AUTOTUNE_LOG"] == str(tmp_path / "autotune.csv")
    assert env["HOROVOD_TIMELINE"] == str(tmp_path / "tl.json")
    assert "HOROVOD_TIMELINE" not in horovod_env(HorovodConfig())  # nothing unless asked for
    # Horovod fixes a knob whose variable is set: under autotune both are left to its search
    assert not {"HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD"} & set(env)


def test_autotune_with_a_fixed_cycle_or_fusion_is_a_located_config_error(tmp_path):
    from hvtrain.config.load import load_config
    from hvtrain.errors import ConfigError

    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: t\ndata: {dataset: 'sklearn:digits'}\nmodel: {input_shape: [64], layers: [{type: dense, units: 10}]}\n"
                   "horovod:\n  autotune: true\n  cycle_time_ms: 5\n")
    with pytest.raises(ConfigError, match=r"c.yaml:6: horovod.cycle_time_ms: autotune: true searches it.*got 5\)"):
        load_config(str(cfg))
    cfg.write_text(cfg.read_text().replace("cycle_time_ms: 5", "cycle_time_ms: 1"))  # the default: fine
    assert load_config(str(cfg)).horovod.autotune


# Written by Horovod 0.28.1's ParameterManager (note the ", " after torus_allreduce in its rows).
AUTOTUNE_LOG = """hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,tensor_fusion_threshold,score
0,0,0, 1,5,64,1.2e+09
0,0,0, 0,2.5,32,1.9e+09
0,0,0, 1,10,8,1.5e+09
"""


def test_a_previous_autotune_logs_best_sample_is_used(tmp_path):
    log = tmp_path / "autotune.csv"
    log.write_text(AUTOTUNE_LOG)
    assert best_autotuned(str(log))["cycle_time_ms"] == 2.5
    env = horovod_env(HorovodConfig(autotune_from=str(log)))
    assert env["HOROVOD_CYCLE_TIME"] == "2.5" and env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HOROVOD_CACHE_CAPACITY"] == "0" and env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "0"


@pytest.mark.parametrize("text, where", [("a,b\n", ":1: not a Horovod autotune log"),
                                         (AUTOTUNE_LOG.splitlines()[0] + "\n1,2\n", ":2: expected 7 numbers"),
                                         (AUTOTUNE_LOG.splitlines()[0] + "\n", "has no samples yet")])
def test_a_bad_autotune_log_is_a_located_config_error(tmp_path, text, where):
    from hvtrain.config.load import load_config
    from hvtrain.errors import ConfigError

    log = tmp_path / "autotune.csv"
    log.write_text(text)
    with pytest.raises(ConfigError, match="horovod.autotune_from: .*" + re.escape(where)):
        load_config({"name": "t", "data": {"dataset": "sklearn:digits"},
                     "model": {"layers": [{"type": "dense", "units": 10}]},
                     "horovod": {"autotune_from": str(log)}})


# ----------------------------------------------------------------------------- CPU binding, MPI yield


def test_ranks_left_unbound_split_the_hosts_cpus_contiguously():
    host = (0, 1, 2, 3)
    assert [cpu_share(r, 2, host, 4) for r in range(2)] == [(0, 1), (2, 3)]
    six = tuple(range(6))  # the remainder goes one each to the first ranks: no CPU left idle
    assert [cpu_share(r, 4, six, 6) for r in range(4)] == [(0,), (1, 2), (3,), (4, 5)]


def test_a_share_is_whole_cores_of_one_socket_in_topology_order():
    # 2 sockets x 2 cores x 2 hyperthreads, Linux numbering: siblings are cpu and cpu + 4
    def key(cpu):
        core = cpu % 4
        return core // 2, core, cpu
    host = tuple(range(8))
    assert [cpu_share(r, 2, host, 8, key) for r in range(2)] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert [cpu_share(r, 4, host, 8, key) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize("local_rank,local_size,mask,host_cpus", [
    (0, 1, (0, 1), 2),                 # one rank on the host: nothing to share
    (1, 2, (1,), 2),                   # the launcher bound the rank already (--bind-to core, srun)
    (0, 2, (0, 1, 2, 3), 8),           # bound to a socket, or a wrapper/container with a cpuset: not ours
    (0, 4, (0, 1), 2),                 # fewer CPUs than ranks: binding would stack ranks anyway
])
def test_binding_is_left_alone_when_it_is_not_ours_to_do(local_rank, local_size, mask, host_cpus):
    assert cpu_share(local_rank, local_size, mask, host_cpus) == ()


def test_bound_ranks_use_their_own_cores_as_threads():
    assert default_threads(ProcessInfo(0, 2, 0, 2, "mpi", cpus=(4, 5, 6))) == 3
    unbound = default_threads(ProcessInfo(0, 2, 0, 2, "mpi"))
    assert unbound == max(1, len(os.sched_getaffinity(0)) // 2)


def test_mpi_yield_is_set_before_mpi_starts_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    assert mpi_env(HorovodConfig()) == {"OMPI_MCA_mpi_yield_when_idle": "1"}
    assert mpi_env(HorovodConfig(mpi_yield=False)) == {}
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "0")
    assert mpi_env(HorovodConfig()) == {}

