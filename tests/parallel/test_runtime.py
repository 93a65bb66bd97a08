"""The Horovod runtime's collectives on real ranks (they are the identity on one rank, which proves
nothing): sums, objects, and the byte gather/scatter that carries checkpoint shares."""

import json
import sys

import pytest

from tests.conftest import run, tool
from tests.support.launch import BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives_on_three_ranks(tmp_path, backend):
    run([tool("mpirun"), "-np", "3", "--oversubscribe", "--bind-to", "none", sys.executable, "-m",
         "tests.fixtures.runtime_probe", backend, str(tmp_path)], timeout=240)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r, g in enumerate(got):
        assert g["rank"] == r and g["size"] == 3
        assert g["allreduce"] == [0.5 + 1.5 + 2.5, 10.0 + 20.0 + 30.0]
        assert g["broadcast"] == {"from": 0}
        assert g["allgather"] == [0, 1, 4]
        assert g["scattered"] == [7 * r] * (r + 2)  # only its own share
    assert got[0]["gathered"] == [[0], [], [2, 2, 2]]
    assert got[1]["gathered"] == got[2]["gathered"] == []  # the others receive nothing
