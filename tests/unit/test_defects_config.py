"""Issue 21, config values, CLI errors and HPC edges (items 12-18 and parts of 23): each a test
that failed on 8dc4038. Bad input is one located line, exit 2, before any framework is imported."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvtrain.cli import cli
from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError
from hvtrain.launch.scheduler import detect
from tests.support.configs import write_config, write_weights

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples/digits_mlp.yaml"

# The CLI in a fresh process; prints the frameworks it imported (the error must come before them).
FRESH = """
import sys
from hvtrain.cli import main
sys.argv = ["hvtrain"] + sys.argv[1:]
try:
    main()
finally:
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "tensorflow", "horovod", "keras"))
    print("imported:", ",".join(heavy), file=sys.stderr)
"""


def fresh(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str], str]:
    """(exit code, stderr lines but the imports line, the imported frameworks) of `hvtrain ARGS`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMIX_", "PMI_", "OMPI_", "HOROVOD_"))}
    base.pop("HVTRAIN_OUTPUT_DIR", None)
    proc = subprocess.run([sys.executable, "-c", FRESH, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})})
    lines = proc.stderr.splitlines()
    imported = next((line for line in lines if line.startswith("imported:")), "imported: ?")
    return proc.returncode, [line for line in lines if line != imported], imported.partition(": ")[2]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


BASE = "name: t\ndata: {dataset: sklearn:digits}\nmodel: {input_shape: [64], layers: [{type: dense, units: 10}]}\n"


# ----------------------------------------------------------------------------- 12: optimizer values


@pytest.mark.parametrize("optimizer,where,message", [
    ("{name: sgd, nesterov: true}", "optimizer.nesterov", "Nesterov momentum needs optimizer.momentum > 0"),
    ("{name: adam, betas: [0.9, 1.0]}", r"optimizer.betas\[1\]", r"expected a number in \[0, 1\), got 1.0"),
    ("{name: adamw, betas: [-0.1, 0.999]}", r"optimizer.betas\[0\]", r"expected a number in \[0, 1\), got -0.1"),
    ("{name: sgd, weight_decay: -0.01}", "optimizer.weight_decay", "expected a finite number >= 0, got -0.01"),
    ("{name: rmsprop, weight_decay: -1e-4}", "optimizer.weight_decay", "expected a finite number >= 0, got -0.0001"),
    ("{name: sgd, momentum: 1.0}", "optimizer.momentum", r"expected a number in \[0, 1\), got 1.0"),
    ("{name: adam, eps: 0}", "optimizer.eps", "expected a finite number > 0, got 0.0"),
    ("{name: rmsprop, rho: 1.5}", "optimizer.rho", r"expected a number in \[0, 1\), got 1.5"),
    ("{name: sgd, warmup_epochs: .nan}", "optimizer.warmup_epochs", "expected a finite number >= 0, got nan"),
])
def test_defect_12_optimizer_values_are_refused_in_the_config_for_both_backends(tmp_path, optimizer, where, message):
    """Defect: torch raised ValueError after Horovod had started (nesterov without momentum, betas
    outside [0, 1), a negative weight decay); TensorFlow trained on them (plain SGD for Nesterov
    without momentum) or diverged. One rule now, in the config, whatever the backend."""
    p = write(tmp_path, BASE + f"optimizer: {optimizer}\n")
    for backend in ("torch", "tensorflow"):
        with pytest.raises(ConfigError, match=rf"^{p}:4: {where}: {message}"):
            load_config(p, [f"backend={backend}"])
    r = invoke("train", str(p), "--backend", "tensorflow")
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1 and r.output.startswith(f"hvtrain: error: {p}:4: ")
    good = write(tmp_path, BASE + "optimizer: {name: sgd, momentum: 0.9, nesterov: true, weight_decay: 0}\n", "ok.yaml")
    assert load_config(good).optimizer.nesterov


# ----------------------------------------------------------------------------- 13: --output-dir a file


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "taken"
    f.write_text("not a directory\n")
    return f


@pytest.mark.parametrize("command", ["train", "evaluate"])
@pytest.mark.parametrize("under", [False, True])
def test_defect_13_output_dir_that_is_a_file_is_one_line_before_any_framework(tmp_path, a_file, command, under):
    """Defect: FileExistsError / NotADirectoryError tracebacks from mkdir once the framework and
    Horovod had started (train and evaluate)."""
    out = a_file / "run" if under else a_file
    args = [command, str(MLP), "--output-dir", str(out), "--set", "train.epochs=1"]
    if command == "evaluate":
        args += ["--weights", str(write_weights(tmp_path, MLP))]
    code, lines, imported = fresh(*args)
    got = f"a path under the file {a_file}" if under else "an existing file"
    assert (code, lines) == (2, [f"hvtrain: error: --output-dir {out}: expected a directory for the run's outputs, "
                                 f"got {got}"]), lines
    assert imported == ""
    assert a_file.read_text() == "not a directory\n"  # nothing lost


def test_defect_13_output_dir_from_the_config_the_environment_or_the_default_is_located(tmp_path, a_file,
                                                                                        monkeypatch):
    from hvtrain.runtime.experiment import check_output_dir, load_experiment

    monkeypatch.delenv("HVTRAIN_OUTPUT_DIR", raising=False)
    p = write(tmp_path, BASE + f"output_dir: {a_file}\n")
    with pytest.raises(ConfigError, match=rf"^{p}:4: output_dir: {a_file}: expected a directory for the run's "
                                          "outputs, got an existing file$"):
        check_output_dir(load_experiment(str(p)))
    monkeypatch.setenv("HVTRAIN_OUTPUT_DIR", str(a_file / "x"))
    with pytest.raises(ConfigError, match=rf"^HVTRAIN_OUTPUT_DIR={a_file / 'x'}: expected a directory"):
        check_output_dir(load_experiment(str(p)))
    monkeypatch.delenv("HVTRAIN_OUTPUT_DIR")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # the default runs/<name> lies under a file
    p = write(tmp_path, BASE)
    with pytest.raises(ConfigError, match=rf"^{p}:1: name: the default output directory runs/t: expected a "
                                          rf"directory .*under the file runs; set output_dir or --output-dir$"):
        check_output_dir(load_experiment(str(p)))
    (tmp_path / "runs").unlink()
    check_output_dir(load_experiment(str(p)))  # a new directory where one can be made: fine


def test_predict_export_and_report_outputs_under_a_file_stay_one_line(tmp_path, a_file):
    """The same check for the other commands that write (already one line: kept so)."""
    cfg = write_config(tmp_path)
    weights = write_weights(tmp_path, cfg)
    rows = tmp_path / "rows.npy"
    import numpy as np

    np.save(rows, np.zeros((3, 64), np.float32))
    runs = {"predict": ["predict", str(cfg), "--weights", str(weights), "--input", str(rows), "--output",
                        str(a_file / "p.npy")],
            "export": ["export", str(cfg), "--weights", str(weights), "--format", "torchscript", "-o",
                       str(a_file / "m.pt")],
            "report": ["report", str(tmp_path), "-o", str(a_file)]}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train_loss": 1.0}) + "\n")
    for name, args in runs.items():
        code, lines, imported = fresh(*args)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("hvtrain: error: ") and str(a_file) in lines[0], \
            (name, lines)
        assert imported == "", name


# ----------------------------------------------------------------------------- 14: plan --network + autotune


def test_defect_14_plan_network_with_autotune_estimates_at_the_configs_knobs(monkeypatch):
    """Defect: KeyError 'HOROVOD_CYCLE_TIME' (autotune exports neither knob)."""
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    args = ["plan", str(MLP), "-np", "4", "--network", "10", "--step-ms", "2.5", "--set", "horovod.autotune=true"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert "Horovod: cycle 1 ms, fusion threshold 64.0 MiB (autotune: searched while training, estimated at these)" \
        in r.output
    plain = invoke(*args[:-2])
    table = [line for line in r.output.splitlines() if line.strip()[:1].isdigit()]
    assert table == [line for line in plain.output.splitlines() if line.strip()[:1].isdigit()]  # the same knobs
    got = json.loads(invoke(*args, "--json").output)
    assert got["autotune"] is True and got["np"] == 4


# ----------------------------------------------------------------------------- 15: launcher options


def test_defect_15_launcher_options_before_the_dashes_go_to_the_launcher():
    """Defect: `hvtrain launch --oversubscribe -- train ...` ran `python -m hvtrain --oversubscribe
    train ...` on every rank; now the launcher gets it, before the worker command."""
    hostfile = str(ROOT / "hostfiles/localhost")
    r = invoke("launch", "-np", "2", "--launcher", "mpirun", "--hostfile", hostfile, "--oversubscribe",
               "--mca", "btl", "tcp,self", "--dry-run", "--", "train", "x.yaml", "--set", "train.epochs=1")
    assert r.exit_code == 0, r.output
    argv = shlex.split(r.output.splitlines()[0])
    worker = argv.index(sys.executable)
    assert argv[worker - 4:worker] == ["--oversubscribe", "--mca", "btl", "tcp,self"] and argv[1:3] == ["-np", "2"]
    assert argv[worker:] == [sys.executable, "-m", "hvtrain", "train", "x.yaml", "--set", "train.epochs=1"]
    r = invoke("launch", "-np", "2", "--verbose", "--dry-run", "--", "train", "x.yaml")
    argv = shlex.split(r.output.splitlines()[0])
    assert argv[3:] == ["-np", "2", "-H", "localhost:2", "--mpi", "--verbose", sys.executable, "-m", "hvtrain",
                        "train", "x.yaml"]


def test_defect_15_launcher_options_without_the_dashes_are_one_line():
    # without `--`, whether the words after an unknown option are its values or the command cannot be told
    r = invoke("launch", "-np", "2", "--oversubscribe", "train", "x.yaml", "--dry-run")
    assert r.exit_code == 2 and r.output.splitlines() == [
        "hvtrain: error: --oversubscribe: not an hvtrain launch option; a launcher's own options go before `--`: "
        "hvtrain launch [OPTIONS] --oversubscribe ... -- train CONFIG"]
    assert invoke("launch", "-np", "2", "--dry-run", "train", "x.yaml", "--backend", "torch").exit_code == 0
    r = invoke("launch", "-np", "2", "--dry-run", "--")
    assert r.exit_code == 2 and "expected the hvtrain command to run on every rank" in r.output


# 16 needs a framework: tests/backends/test_defects_config_frameworks.py
# ----------------------------------------------------------------------------- 17, 18, 23: schedulers


@pytest.mark.parametrize("var", ["SLURM_NODELIST", "SLURM_STEP_NODELIST"])
def test_defect_17_a_malformed_node_list_names_the_variable_read(var):
    """Defect: a bad SLURM_NODELIST or SLURM_STEP_NODELIST was reported as SLURM_JOB_NODELIST."""
    from hvtrain.errors import HostfileError

    with pytest.raises(HostfileError, match=rf"^{var}='n\[1-3': not a Slurm node list"):
        detect({var: "n[1-3", "SLURM_TASKS_PER_NODE": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}, scontrol="")


def _cli_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "LSB_"))}, **extra}


@pytest.mark.parametrize("hosts", [["-H", "node01:2"], ["--hostfile", "hostfiles/localhost"]])
def test_defect_18_srun_with_a_host_list_says_what_is_wrong(hosts, monkeypatch):
    """Defect: inside an allocation, `--launcher srun -H ...` said no Slurm allocation was found."""
    for k, v in {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(k, v)
    r = invoke("launch", "--launcher", "srun", *hosts, "--dry-run", "--", "train", "x.yaml")
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1, r.output
    assert f"hvtrain: error: {' '.join(hosts)}: --launcher srun starts the tasks on the Slurm allocation's nodes " \
           "itself and takes no host list" in r.output
    assert "none found" not in r.output


def test_defect_23_salloc_interactive_step_launches_on_the_whole_allocation():
    """Defect: in salloc's interactive step (use_interactive_step: a shell on the first node,
    SLURM_STEP_ID 4294967290) the step's one node and one task were taken for the allocation:
    `hvtrain launch` started 1 rank instead of 8. (srun's --preserve-env keeps the job's counts.)"""
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)",
           "SLURM_STEP_ID": "4294967290", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1",
           "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "5"}
    alloc = detect(env, scontrol="")
    assert [(h.host, h.slots) for h in alloc.hosts] == [("n1", 4), ("n2", 4)]
    assert "interactive step" in alloc.notes[-1]
    # an ordinary step (`srun --pty bash`, step 0) keeps its own node and task, as before
    step = detect({**env, "SLURM_STEP_ID": "0"}, scontrol="")
    assert [(h.host, h.slots) for h in step.hosts] == [("n1", 1)]
    proc = subprocess.run([sys.executable, "-m", "hvtrain", "launch", "--launcher", "mpirun", "--dry-run", "--",
                           "train", "x.yaml"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=_cli_env(**env))
    assert proc.returncode == 0 and "-np 8 --hostfile" in proc.stdout and "n2 slots=4" in proc.stdout, proc.stderr


def test_defect_23_srun_pmix_tasks_say_their_rank_before_horovod(tmp_path):
    """Defect: a task of `srun --mpi=pmix` (PMIX_RANK set, no PMIX_SIZE; SLURM_PROCID and
    SLURM_STEP_NUM_TASKS set) reported a bad config without `rank r of N:`."""
    bad = write(tmp_path, BASE + "train: {epochs: 0}\n")
    srun_task = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
                 "PMIX_RANK": "1", "SLURM_JOB_ID": "5"}
    code, lines, _ = fresh("train", str(bad), env=srun_task)
    assert (code, lines) == (2, [f"hvtrain: error: rank 1 of 2: {bad}:4: train.epochs: expected an integer >= 1, "
                                 "got 0"]), lines
    # a plain process of an sbatch script inherits the script's SLURM_PROCID 0 and the job's NTASKS: alone
    sbatch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"}
    code, lines, _ = fresh("train", str(bad), env=sbatch)
    assert (code, lines) == (2, [f"hvtrain: error: {bad}:4: train.epochs: expected an integer >= 1, got 0"])


def test_defect_23_lsf_repeated_host_names_are_merged(tmp_path):
    """Defect: `LSB_MCPU_HOSTS='hA 2 hB 2 hA 2'` became three hosts (`-H hA:2,hB:2,hA:2`); the
    launchers do not add a repeated host's slots up."""
    alloc = detect({"LSB_MCPU_HOSTS": "hA 2 hB 2 hA 2", "LSB_JOBID": "3"})
    assert [(h.host, h.slots) for h in alloc.hosts] == [("hA", 4), ("hB", 2)]
    csm = detect({"LSB_MCPU_HOSTS": "batch1 1 c01 2 c02 2 c01 2", "CSM_ALLOCATION_ID": "9"})
    assert [(h.host, h.slots) for h in csm.hosts] == [("c01", 4), ("c02", 2)]
    proc = subprocess.run([sys.executable, "-m", "hvtrain", "launch", "--dry-run", "--", "train", "x.yaml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=_cli_env(LSB_MCPU_HOSTS="hA 2 hB 2 hA 2"))
    assert proc.returncode == 0 and "-np 6 -H hA:4,hB:2 " in proc.stdout, proc.stderr

