"""Review of issue 21's signal fixes (no framework): the CLI records a notice before it imports
click, the launcher's rank is read one way, hvtrain's launcher patch to Horovod is one that
hvtrain can see (doctor, manifest), and it reads /proc and sets up a rank's SIGTERM as hvtrain
expects."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hvtrain.errors import PREEMPTED_EXIT
from hvtrain.launch import horovodrun, notice
from hvtrain.launch.process import LAUNCH_VARS, launch_rank, launcher_rank
from tests.conftest import ROOT, run_env

PATCH_FILE = ROOT / "scripts" / "runner_patch.py"


def runner_patch_module():
    """scripts/runner_patch.py as Horovod holds it (horovod/runner/hvtrain_patch.py), without Horovod."""
    spec = importlib.util.spec_from_file_location("hvtrain_patch_under_test", PATCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- one reader of the rank

@pytest.mark.parametrize("env, rank", [
    ({}, None),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, 3),
    # srun --mpi=pmix: PMIX_RANK without a size, srun's own pair speaks for the task
    ({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, 1),
    # horovodrun --gloo started from a process of a singleton mpirun: the inner launcher's rank
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}, 1),
    # what every process of an sbatch script inherits: no launcher's rank
    ({"SLURM_PROCID": "3"}, None),
])
def test_defect_12_one_reader_of_the_launchers_rank(monkeypatch, env, rank):
    """Defect: `launcher_rank` (rank-0 decisions: the output-dir check, manifest facts, predict's
    file) read RANK_VARS in another order than `launch_rank` (the `rank r of N:` of every
    message), and a bare SLURM_PROCID: both readers must say the same."""
    for name in (name for pair in LAUNCH_VARS for name in pair):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    where = launch_rank()
    assert launcher_rank() == rank == (where[0] if where else None)


# ----------------------------------------------------------------------------- the /proc SigCgt readers

def test_defect_12_the_runner_patch_reads_sigcgt_as_hvtrain_does():
    """Defect: runner_patch.py's copy of the SigCgt reader said True where it cannot tell, hvtrain's
    None. The copy stays (it runs inside Horovod's launcher, without hvtrain), with the same answers."""
    copy = runner_patch_module()._catches
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGUSR1, "
                              "lambda *a: None); print(flush=True); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # its handler is in
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            assert copy(child.pid, sig) is notice.catches(child.pid, sig) is (sig == signal.SIGUSR1)
    finally:
        child.kill()
        child.wait()
    assert copy(child.pid, signal.SIGUSR1) is notice.catches(child.pid, signal.SIGUSR1) is None  # gone


# ----------------------------------------------------------------------------- is the patch installed

def fake_horovod(tmp_path: Path, patch: str | None) -> Path:
    package = tmp_path / "horovod"
    (package / "runner").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('runner_patch() must not import Horovod')\n")
    if patch is not None:
        (package / "runner" / "hvtrain_patch.py").write_text(patch)
    return tmp_path


@pytest.mark.parametrize("patch, says", [
    (None, "absent"),
    ("def run_mpirun(command, env):\n    pass\n", "outdated (1, expected {})"),
    ("PATCH = 1\n", "outdated (1, expected {})"),
    ("PATCH = {}\n", "present ({})"),
])
def test_defect_09_runner_patch_says_what_the_installed_horovod_carries(tmp_path, monkeypatch, patch, says):
    """Defect: nothing looked whether Horovod carried hvtrain's launcher patch: with a site Horovod
    (`module load horovod`) docs/hpc.md's horovodrun pre-emption rows were silently false. It is read
    from Horovod's files, without importing Horovod."""
    want = horovodrun.RUNNER_PATCH
    monkeypatch.syspath_prepend(str(fake_horovod(tmp_path, None if patch is None else patch.format(want))))
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    assert horovodrun.runner_patch() == says.format(want)


def test_defect_09_the_patch_number_is_the_one_hvtrain_expects():
    """scripts/runner_patch.py's PATCH is what hvtrain looks for: a change to the patch raises both."""
    assert runner_patch_module().PATCH == horovodrun.RUNNER_PATCH


def test_defect_09_this_venvs_horovod_carries_this_checkouts_patch():
    """The Horovod `make setup` installed holds scripts/runner_patch.py as it is now (a changed patch
    not yet rebuilt fails here, not as a mysterious signal test)."""
    spec = importlib.util.find_spec("horovod")
    assert spec is not None, "Horovod is not installed: run `make setup`"
    installed = Path(list(spec.submodule_search_locations)[0]) / "runner" / "hvtrain_patch.py"
    if installed.read_text() != PATCH_FILE.read_text():
        pytest.fail(f"{installed} is not {PATCH_FILE}: run `make setup` (it rebuilds Horovod)")
    assert horovodrun.runner_patch() == f"present ({horovodrun.RUNNER_PATCH})"


def test_defect_09_doctor_warns_without_failing_and_the_manifest_records_it(monkeypatch):
    """Without the patch, `hvtrain doctor` passes (training works) with a warning naming what does
    not hold, and manifest.json says what the run's Horovod carried."""
    from click.testing import CliRunner

    from hvtrain.cli import cli
    from hvtrain.config.load import load_config
    from hvtrain.runtime import manifest
    from hvtrain.tools import doctor

    monkeypatch.setattr(doctor, "_horovod_build", lambda module: ("mpi=yes, gloo=yes", []))
    monkeypatch.setattr(doctor, "gpu_facts", lambda frameworks: {"gpus": "0"})
    monkeypatch.setattr(doctor, "_version", lambda *names: "1.0")
    monkeypatch.setattr(doctor, "runner_patch", lambda: "absent")
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "launcher patch         absent" in result.output
    assert "warning: Horovod's launcher lacks hvtrain's patch (absent" in result.output
    assert "may exit 143 or 1 without a checkpoint, not 75" in result.output
    monkeypatch.setattr(doctor, "runner_patch", lambda: "present (2)")
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0 and "warning" not in result.output, result.output

    monkeypatch.setattr(manifest, "runner_patch", lambda: "absent")
    cfg = load_config(str(ROOT / "examples" / "digits_mlp.yaml"), [])
    assert manifest.build(cfg, ["h0"], 1)["horovod_runner_patch"] == "absent"


# ----------------------------------------------------------------------------- a rank's SIGTERM (edit 8)

def test_defect_11_a_gloo_ranks_command_takes_sigterm_as_any_process_does():
    """Defect: Horovod's middlemen and their shells ignore SIGTERM (edit 6), and an ignored signal
    is inherited: every horovodrun --gloo rank ignored it. The rank's command, as gloo_run builds it
    (`env VARS... CMD`), run by a shell that ignores SIGTERM with it blocked too, starts with the
    default disposition, unblocked; the shell keeps ignoring it. (The whole launcher:
    tests/parallel/test_signals_review_ranks.py.)"""
    command = runner_patch_module().with_default_sigterm(
        f"env HVTRAIN_PROBE=1 {sys.executable} -c 'import os, signal; print(os.environ[\"HVTRAIN_PROBE\"], "
        "signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.SIGTERM in signal.pthread_sigmask("
        "signal.SIG_BLOCK, []))'")
    middleman = textwrap.dedent(f"""
        import signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
        sys.exit(subprocess.call({command!r}, shell=True))
    """)
    proc = subprocess.run([sys.executable, "-c", middleman], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "True", "False"], proc.stdout
    assert runner_patch_module().with_default_sigterm("ssh host 'cd x ; env A=1 cmd'") == "ssh host 'cd x ; env A=1 cmd'"


# ----------------------------------------------------------------------------- before the handlers

def test_defect_06_a_sigterm_before_click_is_imported_is_recorded_and_ends_train_in_75(tmp_path):
    """Defect: `hvtrain train` installed its handlers only in the train command, after click, every
    command module and the backend registry were imported (~0.15 s into the process; measured 136-224
    ms on 2 busy cores): a SIGTERM then killed the rank (143). Now hvtrain.cli records it before it
    imports click: a real SIGTERM at click's import ends the run at its first check, 75, before the
    config is read (nothing written)."""
    code = textwrap.dedent("""
        import importlib.abc, os, runpy, signal, sys

        class AtClick(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "click":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGTERM)  # Slurm's pre-emption, now
                return None

        sys.meta_path.insert(0, AtClick())
        sys.argv = ["hvtrain", *sys.argv[1:]]
        runpy.run_module("hvtrain", run_name="__main__")
    """)
    out_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", code, "train", "examples/digits_mlp.yaml", "--output-dir",
                           str(out_dir)], cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, (proc.returncode, proc.stdout, proc.stderr)
    assert ("preempted before training started: nothing trained, nothing to lose (SIGTERM during start-up, "
            "before the config)") in proc.stdout, proc.stdout
    assert not out_dir.exists() and "Traceback" not in proc.stderr, proc.stderr


def test_defect_06_other_commands_keep_the_default_sigterm():
    """Only `hvtrain train` (not --elastic) records signals: predict, evaluate or an elastic rank
    ended by SIGTERM die of it as before."""
    probe = ("import signal, sys; sys.argv = ['hvtrain', *sys.argv[1:]]; import hvtrain.cli; "
             "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")
    for argv, default in ((["predict", "x"], True), (["train", "x", "--elastic"], True), (["train", "x"], False)):
        proc = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT, env=run_env(), capture_output=True,
                              text=True, timeout=60)
        assert proc.stdout.split() == [str(default)], (argv, proc.stdout, proc.stderr)


def test_defect_09_hvtrain_launch_warns_when_it_starts_horovodrun_without_the_patch(monkeypatch, capfd):
    """The door users come through: `hvtrain launch` (horovodrun, its default launcher) says so
    in one line when Horovod lacks the patch, and starts the launcher all the same."""
    from hvtrain.launch import execute

    plan = execute.Plan([sys.executable, "-m", horovodrun.MODULE, "--version"], run_env(), None)
    for patch, warned in (("absent", True), (f"present ({horovodrun.RUNNER_PATCH})", False)):
        monkeypatch.setattr(horovodrun, "runner_patch", lambda patch=patch: patch)
        assert execute.run(plan) == 0
        err = capfd.readouterr().err
        assert ("hvtrain launch: warning: Horovod's launcher lacks hvtrain's patch (absent)" in err) is warned, err


def test_review_the_start_up_recorder_is_taken_over_not_restored():
    """Cold review: StopSignals saved the handler it replaced, which under `hvtrain train` is the
    start-up recorder, and put it back after training: from then on SIGTERM/SIGUSR1 were swallowed
    through MPI's teardown (mpirun's SIGTERM waited for its SIGKILL: 137, not 143). After the block
    the default disposition is back, and the recorder's record is consumed."""
    import signal

    from hvtrain.training import preempt

    saved = {s: signal.getsignal(s) for s in preempt.SIGNALS}
    try:
        preempt.record_from_start()
        with preempt.StopSignals():
            pass
        assert all(signal.getsignal(s) is signal.SIG_DFL for s in preempt.SIGNALS)
        assert preempt._FROM_START == []
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        preempt._FROM_START.clear()
