"""Process facts without Horovod: GPU pinning choice, Horovod knobs and who wins over them."""

import os

import pytest

from hvtrain.dist import horovod_env, local_gpu
from hvtrain.errors import HvtrainError, LaunchError

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
    assert horovod_env(5.0, 64.0) == {"HOROVOD_CYCLE_TIME": "5", "HOROVOD_FUSION_THRESHOLD": MB64}
    assert horovod_env(0.5, 1.5)["HOROVOD_CYCLE_TIME"] == "0.5"
    assert horovod_env(0.5, 1.5)["HOROVOD_FUSION_THRESHOLD"] == str(3 * 512 * 1024)


def test_a_variable_set_by_the_user_wins_over_the_config(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "1.5")
    env = horovod_env(5.0, 64.0)
    assert env == {"HOROVOD_FUSION_THRESHOLD": MB64}  # the config's cycle time is not offered at all
    for k, v in env.items():  # what the runtime does before hvd.init() (undone after the test)
        monkeypatch.setenv(k, v)
    assert os.environ["HOROVOD_CYCLE_TIME"] == "1.5"
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")  # 0 = no fusion: a meaningful user value
    assert horovod_env(5.0, 64.0) == {}


def test_elastic_leaves_the_fusion_threshold_to_horovod():
    assert horovod_env(5.0, 64.0, elastic=True) == {"HOROVOD_CYCLE_TIME": "5"}
