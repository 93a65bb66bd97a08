"""hvtrain's patch to Horovod's launcher, installed as horovod/runner/hvtrain_patch.py by
scripts/build_horovod.sh (edits 4 to 7; the wheel's cache key hashes this file too).

Unpatched, `horovodrun` (MPI) exec'd `/bin/sh -c "mpirun ..."` over itself. Slurm's pre-emption
sends SIGTERM to every process of the job at once: sh died of it (exit 143: no requeue), and
mpirun, on SIGTERM, killed the ranks (SIGTERM 1 s later, SIGKILL 1 s after that) and exited 1,
often before they had checkpointed. `horovodrun --gloo` raised a RuntimeError (exit 1, a
traceback) for any rank's non-zero exit, 75 (pre-empted cleanly) included.
"""

import signal
import subprocess
import sys

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
        if notices and _catches(proc.pid, signal.SIGUSR1):
            del notices[:]
            proc.send_signal(signal.SIGUSR1)
    return 128 - code if code < 0 else code


def _catches(pid, sig):
    """Whether `pid` has a handler for `sig` (True where /proc cannot tell)."""
    try:
        with open(f'/proc/{pid}/status') as fh:
            for line in fh:
                if line.startswith('SigCgt:'):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


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
