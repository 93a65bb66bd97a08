"""The launch lines multi-process tests run: the real launchers, every rank this Python's hvtrain."""

from __future__ import annotations

from hvtrain.backends.registry import BACKENDS as _REGISTERED
from tests.conftest import hvtrain, tool

BACKENDS = sorted(_REGISTERED)  # every registered backend (tests parametrize over these, never a list of names)


def mpirun(np_: int, *args: str, module: bool = True) -> list[str]:
    """`mpirun -np N` of `hvtrain ARGS` (module=False: ARGS is the whole command)."""
    command = hvtrain(*args) if module else list(args)
    return [tool("mpirun"), "-np", str(np_), "--oversubscribe", "--bind-to", "none", *command]


def mpirun_command(np_: int, *command: str) -> list[str]:
    """`mpirun -np N COMMAND` of a whole command line (a script, `python -c`, an env wrapper)."""
    return mpirun(np_, *command, module=False)


def horovodrun(np_: int, *args: str, gloo: bool = False) -> list[str]:
    """Horovod's own launcher, as users type it: `horovodrun -np N -H localhost:N [--gloo] hvtrain ARGS`."""
    return [tool("horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo" if gloo else "--mpi",
            *hvtrain(*args)]


def launch(np_: int, *args: str) -> list[str]:
    """`hvtrain ARGS` alone on one rank, under horovodrun on several."""
    return hvtrain(*args) if np_ == 1 else horovodrun(np_, *args)
