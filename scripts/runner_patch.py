"""hvtrain's patch to Horovod's launcher, installed as horovod/runner/hvtrain_patch.py by
scripts/build_horovod.sh (edits 4 to 8; the wheel's cache key hashes this file too). It runs
inside Horovod's launcher, where hvtrain may not be installed: it imports nothing of hvtrain.

Unpatched, `horovodrun` (MPI) exec'd `/bin/sh -c "mpirun ..."` over itself. Slurm's pre-emption
sends SIGTERM to every process of the job at once: sh died of it (exit 143: no requeue), and
mpirun, on SIGTERM, killed the ranks (SIGTERM 1 s later, SIGKILL 1 s after that) and exited 1,
often before they had checkpointed. `horovodrun --gloo` raised a RuntimeError (exit 1, a
traceback) for any rank's non-zero exit, 75 (pre-empted cleanly) included.
"""

import shlex
import signal
import subprocess
import sys

# What `hvtrain doctor` and manifest.json report of the installed Horovod (hvtrain.launch.horovodrun
# RUNNER_PATCH must equal it: tests/unit/test_signals_review.py); raise both with any change here.
PATCH = 2
POLL_S = 0.1


def run_mpirun(mpirun_command, env):
    """Run mpirun as this process's child and return its exit code (128+N if killed by signal N).

    mpirun starts with SIGTERM blocked (OpenMPI unblocks it in the ranks it starts), so a SIGTERM
    sent to the whole job reaches the ranks, which stop at a common step and checkpoint, while
    mpirun waits for them and exits with their code. A SIGTERM or SIGUSR1 sent to horovodrun goes
    to mpirun as SIGUSR1, which OpenMPI passes on to every rank, once mpirun has its handler for it
    (/proc SigCgt; before that SIGUSR1 would kill mpirun). Ctrl-C reaches mpirun itself."""
    notices = []

    def record(signum, frame):
        notices.append(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, record)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        proc = subprocess.Popen(['/bin/sh', '-c', 'exec ' + mpirun_command], env=env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            code = proc.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if notices and _catches(proc.pid, signal.SIGUSR1) is not False:
            del notices[:]
            proc.send_signal(signal.SIGUSR1)
    return 128 - code if code < 0 else code


def _catches(pid, sig):
    """Whether `pid` has a handler for `sig` (Linux /proc SigCgt); None: cannot tell. The same as
    hvtrain.launch.notice.catches (compared by tests/unit/test_signals_review.py), copied: this
    file must work without hvtrain; where it cannot tell, both callers signal at once."""
    try:
        with open(f'/proc/{pid}/status') as fh:
            for line in fh:
                if line.startswith('SigCgt:'):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return None


def exit_as(name, exit_code):
    """horovodrun --gloo: the first process that exited non-zero decides the exit code (a
    middleman killed by signal N reports -N: the shell's 128+N)."""
    code = 128 - exit_code if exit_code < 0 else exit_code
    print(f'horovodrun: process {name} exited first, with status {code}; exiting with it',
          file=sys.stderr, flush=True)
    sys.exit(code)


def wait_unreaped(process, timeout):
    """Wait up to `timeout` s for `process` (a psutil.Process, the middleman's shell) to end without
    reaping it: the middleman's main thread reaps it (subprocess's wait) and needs its exit status;
    psutil's wait took it first (Popen.wait then returned 0). Raises psutil.TimeoutExpired."""
    import time

    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise psutil.TimeoutExpired(timeout, process.pid)


# Run by the command below: SIGTERM back to its default (and unblocked), then the command itself.
_DEFAULT_SIGTERM = ("import os, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_DFL); "
                    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}); "
                    "os.execvp(sys.argv[1], sys.argv[1:])")


def with_default_sigterm(command):
    """horovodrun --gloo's command for a rank on this host, started with SIGTERM at its default
    disposition (edit 8). The middleman and its shell ignore SIGTERM (edit 6), and an ignored
    signal is inherited through fork and exec: every rank ignored it, so a rank without its own
    handler (an elastic rank, predict, a user's script) could not be ended by SIGTERM, and
    Horovod's teardown waited 5 s, then SIGKILLed it. The shell still ignores it; the rank's
    command (`env VARS... CMD`, as gloo_run builds it) takes it as any process does. A remote
    rank's command (ssh) is left as it is: ssh keeps ignoring it, the remote side starts afresh."""
    if not command.startswith('env '):
        return command
    code = shlex.quote(_DEFAULT_SIGTERM)
    return f'{shlex.quote(sys.executable)} -I -S -c {code} {command}'
