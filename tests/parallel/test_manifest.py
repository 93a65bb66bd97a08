"""manifest.json (issue 11): what a cluster user needs to reproduce a run."""

from __future__ import annotations

import json
import subprocess

from hvtrain.config.load import load_config
from hvtrain.io.checkpoints import list_checkpoints, load
from hvtrain.runtime.manifest import config_hash
from tests.conftest import ROOT, hvtrain, run, tool


def test_manifest_names_versions_launcher_hosts_knobs_config_and_commit(tmp_path):
    argv = [tool("mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none",
            *hvtrain("train", "examples/digits_mlp.yaml", "--quiet", "--set", "train.epochs=1",
                     "--set", "train.checkpoint_every=1", "--output-dir", str(tmp_path))]
    run(argv, timeout=300)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["hvtrain"] == "0.1.0" and m["horovod"] == "0.28.1" and m["backend"] == "torch"
    assert m["framework_version"].startswith("2.") and m["mpi"]["flavour"] == "openmpi" and m["mpi"]["version"][0] in "45"
    assert m["launcher"]["kind"] == "mpirun" and m["launcher"]["name"] == "mpirun"
    assert m["launcher"]["argv"][1:3] == ["-np", "2"], m["launcher"]
    assert m["world_size"] == 2 and sum(h["slots"] for h in m["hosts"]) == 2 and len(m["rank_hosts"]) == 2
    # on CPUs the gradients go by the direct reduction: Horovod's cycle idles at horovod.direct_cycle_ms
    assert m["horovod_env"]["HOROVOD_CYCLE_TIME"] == "200" and m["mpi_env"]["OMPI_MCA_mpi_yield_when_idle"] == "1"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert m["git"]["commit"] == head
    # the config hash identifies the experiment the checkpoints were made with
    assert config_hash(load_config(load(list_checkpoints(tmp_path)[0]).meta["config"])) == m["config_hash"]
