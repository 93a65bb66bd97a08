"""`horovodrun` as `hvtrain launch` runs it: Horovod's own launcher (horovod.runner.launch,
unchanged), with its build check answered from a cache.

Before it starts any rank, horovodrun asks whether Horovod was built with MPI (or Gloo) by
importing Horovod's first framework extension in a forked process: `horovod.tensorflow`, so
TensorFlow's import (~3-4 s on a 2-core node, and its log lines in the job's output) on every
launch, a torch job's too. The answer depends only on the installed extension libraries, so it is
kept per library set (their paths, sizes and modification times, and Horovod's version) in
`$XDG_CACHE_HOME/hvtrain` (default ~/.cache/hvtrain). The first launch, or the first after Horovod
is rebuilt or reinstalled, still asks Horovod, and only a yes is kept (a build without MPI is
told so by Horovod on every launch); a cache that cannot be read or written is ignored.

Run as `python -m hvtrain.launch.horovodrun ARGS` (the arguments of horovodrun).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

MODULE = "hvtrain.launch.horovodrun"  # how manifests recognise this launcher in a rank's parents

# The PATCH of scripts/runner_patch.py this hvtrain expects in the installed Horovod (installed there
# as horovod/runner/hvtrain_patch.py by scripts/build_horovod.sh; tests/unit/test_signals_review.py
# holds the two equal). Without it, docs/hpc.md's plain-horovodrun and --gloo pre-emption rows are false.
RUNNER_PATCH = 2
# The PATCH of scripts/horovod_keras3.py (installed as horovod/tensorflow/hvtrain_keras3.py by make
# setup): Horovod's TensorFlow binding under Keras 3. Without it, TensorFlow training refuses to start.
KERAS3_PATCH = 3


def runner_patch() -> str:
    """What the installed Horovod carries of hvtrain's launcher patch, read from its file (Horovod is
    not imported): `present (N)`, `outdated (N, expected M)`, `absent` (a site or pip Horovod), or
    `no horovod`."""
    return _patch("runner/hvtrain_patch.py", RUNNER_PATCH, unnumbered=1)


def keras3_patch() -> str:
    """The same for hvtrain's Keras 3 patch of Horovod's TensorFlow binding; `absent (...)` also when
    its module is there but Horovod's files are not edited (a pip reinstall over a patched Horovod
    keeps the module, which is in no wheel's record, and restores the files)."""
    return _patch("tensorflow/hvtrain_keras3.py", KERAS3_PATCH,
                  probe=("_keras/__init__.py", "hvtrain's patch (Keras 3)"))


def _patch(rel: str, expected: int, unnumbered: int | None = None, probe: tuple[str, str] | None = None) -> str:
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "no horovod"
    root = Path(list(spec.submodule_search_locations)[0])
    try:
        found = re.search(r"^PATCH = (\d+)$", (root / rel).read_text(), re.MULTILINE)
    except OSError:
        return "absent"
    have = int(found.group(1)) if found else unnumbered  # the first launcher patch had no number
    if probe is not None:
        try:
            edited = probe[1] in (root / probe[0]).read_text()
        except OSError:
            edited = False
        if not edited:
            return f"absent (its module is there, Horovod's {probe[0]} is not edited)"
    return f"present ({have})" if have == expected else f"outdated ({have}, expected {expected})"


def cache_file(horovod_dir: Path, version: str) -> Path | None:
    """The cache entry of this Horovod build (its extension libraries, as installed); None when
    there is no cache directory (no HOME, as for an arbitrary container user)."""
    try:
        h = hashlib.sha256(version.encode())
        for lib in sorted(horovod_dir.glob("*/mpi_lib*.so")):
            st = lib.stat()
            h.update(f"{lib}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (OSError, RuntimeError):  # RuntimeError: Path.home() without HOME or a passwd entry
        return None
    return base / "hvtrain" / f"horovod-build-{h.hexdigest()[:16]}.json"


def cached(name: str, check: Callable[..., bool | None], path: Path) -> Callable[..., bool | None]:
    """`check` (horovod.common.util.mpi_built / gloo_built), its answer kept in `path` under `name`."""

    def answer(verbose: bool = False) -> bool | None:
        try:
            known = json.loads(path.read_text())
            if known.get(name) is True:
                return True
        except (OSError, ValueError, AttributeError):
            known = {}
        result = check(verbose=verbose)
        # only a yes is kept: a no (or None: no extension loaded) is asked again, in Horovod's words
        if result is True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}")
                tmp.write_text(json.dumps({**known, name: result}))
                os.replace(tmp, path)
            except OSError:
                pass
        return result

    return answer


def main() -> int:
    import horovod
    from horovod.common import util
    from horovod.runner import launch

    path = cache_file(Path(horovod.__file__).parent, horovod.__version__)
    if path is not None:  # launch.py calls them by its module globals (its only caller in the runner)
        launch.mpi_built = cached("mpi", util.mpi_built, path)
        launch.gloo_built = cached("gloo", util.gloo_built, path)
    sys.argv[0] = "horovodrun"
    return launch.run_commandline()


if __name__ == "__main__":
    sys.exit(main())
