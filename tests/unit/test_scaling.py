"""The scaling estimate (hvtrain.tools.scaling, `hvtrain plan --network`): hand-computed cases of the ring
formula, Horovod's overlap, cycle and fusion, the pipeline bubble, the CLI, and the validation against
Horovod's published scaling (the guide's table, docs/parallelism.md)."""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvtrain.cli import cli
from hvtrain.config.load import load_config
from hvtrain.model.spec import build_spec
from hvtrain.tools.scaling import (
    PAPER,
    PAPER_NETWORK,
    PHASES,
    Network,
    Pipeline,
    Tensor,
    estimate,
    estimate_for_config,
    horovod_knobs,
    paper_estimate,
    spec_gradients,
)
from tests.unit import test_cli

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples/digits_mlp.yaml"
PIPELINE = ROOT / "examples/digits_pipeline.yaml"
MB = 10_000_000
BW = 10 * 1e9 / 8 / 1e3  # 10 Gbit/s in bytes per ms


def at_end(nbytes: int) -> list[Tensor]:
    """One gradient, ready when the backward pass ends."""
    return [Tensor(nbytes, 1.0)]


def test_ring_allreduce_by_hand():
    # 4 ranks on 4 hosts, no overlap (backward_fraction 0), no cycle wait (cycle 0):
    # 2(N-1)/N * B / bw + 2(N-1) hops * 10 us, after a negotiation of 2 * log2(4) latencies.
    e = estimate(at_end(MB), 100.0, 4, Network(10.0, latency_us=10.0), samples=32, backward_fraction=0.0,
                 cycle_ms=0.0)
    message = 1.5 * MB / BW + 6 * 0.010
    negotiation = 4 * 0.010
    assert e.allreduce_ms == pytest.approx(message + negotiation, rel=1e-12)
    assert e.step_ms == pytest.approx(100.0 + message + negotiation, rel=1e-12)
    assert e.exposed_comm_ms == pytest.approx(message + negotiation, rel=1e-12)
    assert e.efficiency == pytest.approx(100.0 / e.step_ms, rel=1e-12)
    assert e.samples_per_sec == pytest.approx(4 * 32 / e.step_ms * 1e3, rel=1e-12)
    assert e.wire_bytes_per_rank == 15_000_000 and e.grad_bytes == MB and e.messages == 1


def test_one_rank_reduces_nothing():
    e = estimate(at_end(MB), 40.0, 1, 10.0, samples=8)
    assert (e.step_ms, e.efficiency, e.wire_bytes_per_rank, e.allreduce_ms) == (40.0, 1.0, 0, 0.0)
    assert e.samples_per_sec == pytest.approx(200.0)


def test_hops_inside_a_host_and_a_job_on_one_host():
    net = Network(10.0, latency_us=10.0, ranks_per_host=4, local_gbit=80.0, local_latency_us=1.0)
    # 8 ranks on 2 hosts: 2(H-1) = 2 network hops, 2(N-H) = 12 local ones; the network sets the pace
    # (the ring crosses each card once per direction: not divided among the host's 4 ranks).
    e = estimate(at_end(MB), 100.0, 8, net, backward_fraction=0.0, cycle_ms=0.0)
    assert e.allreduce_ms == pytest.approx(1.75 * MB / BW + 2 * 0.010 + 12 * 0.001 + 6 * 0.010, rel=1e-12)
    # 4 ranks on one host: the local bandwidth and latency only.
    e = estimate(at_end(MB), 100.0, 4, net, backward_fraction=0.0, cycle_ms=0.0)
    assert e.allreduce_ms == pytest.approx(1.5 * MB / (8 * BW) + 6 * 0.001 + 4 * 0.001, rel=1e-12)


def test_gradients_ready_early_overlap_the_backward_pass():
    # The last layer's big gradient is ready as the backward pass starts (50 ms before the end of a
    # 100 ms step); only the first layer's tiny one is left when it ends.
    grads = [Tensor(1000, 1.0), Tensor(MB, 0.0)]
    kwargs = dict(backward_fraction=0.5, cycle_ms=0.0)
    overlapped = estimate(grads, 100.0, 4, Network(10.0), **kwargs)
    tail = 1.5 * 1000 / BW + 6 * 0.010 + 4 * 0.010
    assert overlapped.exposed_comm_ms == pytest.approx(tail, rel=1e-12)
    # One group (our TensorFlow backend's default, and Horovod's num_groups=1): submitted at the end.
    grouped = estimate(grads, 100.0, 4, Network(10.0), groups=1, **kwargs)
    assert grouped.exposed_comm_ms == pytest.approx(1.5 * (MB + 1000) / BW + 6 * 0.010 + 4 * 0.010, rel=1e-12)
    # Too much to hide: the ring is still busy with the big gradient when the backward pass ends.
    slow = estimate(grads, 100.0, 4, Network(1.0), **kwargs)
    big, small = (1.5 * n / (BW / 10) + 6 * 0.010 + 4 * 0.010 for n in (MB, 1000))
    assert slow.step_ms == pytest.approx(50 + big + small, rel=1e-12)  # starts at 50 ms, then the tail


def test_cycle_time_adds_the_expected_wait():
    # A gradient ready at the end of the step waits for the background thread's next cycle:
    # averaged over PHASES evenly spaced phases, (PHASES-1)/2/PHASES of a cycle (~ cycle / 2).
    no_wait = estimate(at_end(1000), 100.0, 2, Network(10.0), backward_fraction=0.0, cycle_ms=0.0)
    waited = estimate(at_end(1000), 100.0, 2, Network(10.0), backward_fraction=0.0, cycle_ms=5.0)
    wait = waited.step_ms - no_wait.step_ms
    assert wait == pytest.approx(5.0 * (PHASES - 1) / 2 / PHASES, rel=1e-12)
    assert abs(wait - 2.5) <= 5.0 / PHASES


def test_fusion_packs_ready_gradients_up_to_the_threshold():
    ten = [Tensor(MB, 1.0)] * 10
    kwargs = dict(backward_fraction=0.0, cycle_ms=0.0)
    fused = estimate(ten, 100.0, 2, Network(10.0, latency_us=0.0), fusion_bytes=25_000_000, **kwargs)
    assert fused.messages == 5  # 2 x 10 MB per 25 MB buffer
    unfused = estimate(ten, 100.0, 2, Network(10.0, latency_us=0.0), fusion_bytes=0, **kwargs)
    assert unfused.messages == 10
    # A gradient larger than the threshold goes alone, unsplit; the small ones after it fuse.
    big = estimate([Tensor(3 * MB, 1.0), Tensor(10, 1.0), Tensor(10, 1.0)], 100.0, 2, Network(10.0),
                   fusion_bytes=MB, **kwargs)
    assert big.messages == 2
    # Fewer messages, fewer latencies: with 100 us hops fusion saves 8 x 2 hops.
    slow = [estimate(ten, 100.0, 2, Network(10.0, latency_us=100.0), fusion_bytes=f, **kwargs) for f in (0, 64 * MB)]
    assert slow[0].allreduce_ms - slow[1].allreduce_ms == pytest.approx(9 * 2 * 0.1, rel=1e-9)


def test_pipeline_bubble_and_stage_allreduce():
    p = Pipeline(4, (0.5, 0.5), ((Tensor(MB, 1.0),), (Tensor(MB // 2, 1.0),)), (0,))
    alone = estimate(0, 100.0, 2, Network(10.0, latency_us=0.0), samples=32, pipeline=p)
    # (M + S - 1) slots of half the compute / M: 5 * 12.5 ms; efficiency 1 - bubble = 4/5.
    assert alone.step_ms == pytest.approx(62.5) and alone.efficiency == pytest.approx(0.8) and alone.bubble == 0.2
    # 2 replicas: then the bigger stage's gradients are allreduced, nothing hidden (cycle 0 here).
    two = estimate(0, 100.0, 4, Network(10.0, latency_us=0.0), samples=32, cycle_ms=0.0, pipeline=p)
    assert two.step_ms == pytest.approx(62.5 + 1.0 * MB / BW)
    assert two.grad_bytes == MB and two.wire_bytes_per_rank == MB
    assert two.samples_per_sec == pytest.approx(2 * 32 / two.step_ms * 1e3)
    with pytest.raises(ValueError, match="np 3 is not a multiple of the 2 stages"):
        estimate(0, 100.0, 3, 10.0, pipeline=p)


def test_pipeline_config_uses_the_plans_bubble():
    cfg = load_config(PIPELINE)
    e = estimate_for_config(cfg, build_spec(cfg), 2, Network(1e6, latency_us=0.0), 100.0)
    assert e.bubble == pytest.approx(1 / 5)  # S=2, M=4
    assert e.efficiency < 0.8  # the stages are not balanced, and boundaries cost a little


def test_spec_gradients_last_layer_first():
    cfg = load_config(MLP)
    spec = build_spec(cfg)
    grads = spec_gradients(spec)
    assert sum(t.nbytes for t in grads) == spec.param_count * 4
    assert [t.ready for t in grads][:2] == [1.0, 1.0]  # the first layer's kernel and bias: at the end
    assert grads[-1].ready < grads[0].ready  # the output layer's: early
    # fp16 compression halves what travels; our TensorFlow backend hides nothing behind the backward.
    half = load_config(MLP, ["train.compression=fp16"])
    assert estimate_for_config(half, spec, 2, 10.0, 5.0).grad_bytes == spec.param_count * 2
    torch_, tf = (estimate_for_config(load_config(MLP, [f"backend={b}"]), spec, 4, 0.1, 5.0)
                  for b in ("torch", "tensorflow"))
    assert tf.exposed_comm_ms > torch_.exposed_comm_ms


def test_knobs_are_what_horovod_would_get(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    cfg = load_config(MLP, ["horovod.cycle_time_ms=2", "horovod.fusion_threshold_mb=1"])
    assert horovod_knobs(cfg) == (2.0, 1024 * 1024)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "0.5")  # set by the user: wins, as in a run
    assert horovod_knobs(cfg) == (0.5, 1024 * 1024)


@pytest.mark.parametrize("kwargs,message", [
    (dict(network=0.0), "gbit: expected a finite number > 0"),
    (dict(network=math.nan), "gbit: expected a finite number > 0"),
    (dict(network=Network(10.0, latency_us=-1.0)), "latency_us: expected a finite number >= 0"),
    (dict(network=10.0, np=0), "np: expected a finite number > 0"),
    (dict(network=10.0, compute_ms=math.inf), "compute_ms: expected a finite number > 0"),
])
def test_estimate_rejects_bad_numbers(kwargs, message):
    args = {"compute_ms": 10.0, "np": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        estimate(MB, **args)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("model", PAPER, ids=lambda m: m.model)
def test_estimate_reproduces_horovods_published_scaling(model):
    """Horovod's README: 512 Pascal GPUs, 4 per server, 25 Gbit/s RoCE: ResNet-101 and Inception V3
    90%, VGG-16 68%. The estimate from parameter counts and one-GPU speeds lands within 8 points
    (tight enough that a model with free communication, 100%, fails the 90% rows)."""
    e = paper_estimate(model)
    assert abs(e.efficiency - model.efficiency) <= 0.08, (model.model, e.efficiency)


def test_the_guides_table_is_what_the_estimate_computes():
    text = (ROOT / "docs" / "parallelism.md").read_text()
    section = text[text.index("## Scaling estimate"):]
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\| (ResNet-101|Inception V3|VGG-16) \| ([\d.]+)M \| ([\d.]+) \| ([\d.]+) \| (\d+)% \| ([\d.]+)% \|",
        section, re.M)}
    assert len(rows) == len(PAPER)
    for model in PAPER:
        params, speed, step, published, ours = rows[model.model]
        e = paper_estimate(model)
        assert params == f"{model.params / 1e6:.1f}" and speed == f"{model.images_per_sec:.0f}"
        assert step == f"{e.compute_ms:.0f}" and int(published) == round(model.efficiency * 100)
        assert ours == f"{e.efficiency * 100:.1f}"
    assert f"{PAPER_NETWORK.latency_us:g} us" in section


# ----------------------------------------------------------------------------- CLI

LIGHT = test_cli.LIGHT  # the CLI in a fresh process; fails if a framework was imported


def test_plan_network_with_step_ms_imports_no_framework():
    proc = subprocess.run([sys.executable, "-c", LIGHT, "plan", str(MLP), "-np", "2", "--network", "64",
                           "--step-ms", "3.5", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert set(got) >= {"np", "step_ms", "samples_per_sec", "efficiency", "grad_bytes", "wire_bytes_per_rank",
                        "allreduce_ms", "exposed_comm_ms", "compute_ms", "compute_source"}
    assert (got["np"], got["compute_ms"], got["compute_source"]) == (2, 3.5, "given")
    cfg = load_config(MLP)
    expected = estimate_for_config(cfg, build_spec(cfg), 2, Network(64.0), 3.5)
    assert got["step_ms"] == pytest.approx(expected.step_ms) and got["grad_bytes"] == expected.grad_bytes


def test_plan_network_table():
    r = CliRunner().invoke(cli, ["plan", str(MLP), "-np", "8", "--network", "10", "--step-ms", "2.5"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = [line.split() for line in r.output.splitlines() if re.match(r"^\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["1", "2", "4", "8"]
    assert rows[0][1:4] == ["2.500", "12,800", "100.0%"]
    assert "compute: 2.500 ms per step on one rank (given)" in r.output
    # A pipeline: only world sizes that are multiples of the stages.
    r = CliRunner().invoke(cli, ["plan", str(PIPELINE), "-np", "8", "--network", "10", "--step-ms", "2.5"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert [line.split()[0] for line in r.output.splitlines() if re.match(r"^\s+\d+\s", line)] == ["2", "4", "8"]
    assert "2 pipeline stages, 4 micro-batches, bubble 0.200" in r.output
    r = CliRunner().invoke(cli, ["plan", str(PIPELINE), "-np", "3", "--network", "10"])  # before measuring
    assert r.exit_code == 2 and "must be a multiple of the 2 stages" in r.output and "measured" not in r.output


@pytest.mark.parametrize("args,message", [
    (["-np", "0", "--network", "10", "--step-ms", "1"], "Invalid value for '-np'"),
    (["-np", "2", "--network", "0", "--step-ms", "1"], "expected a finite number > 0, got '0'"),
    (["-np", "2", "--network", "-5", "--step-ms", "1"], "expected a finite number > 0, got '-5'"),
    (["-np", "2", "--network", "nan", "--step-ms", "1"], "expected a finite number > 0, got 'nan'"),
    (["-np", "2", "--network", "10", "--step-ms", "inf"], "expected a finite number > 0, got 'inf'"),
    (["-np", "2", "--step-ms", "1"], "--step-ms: only with --network GBIT"),
    # were silently ignored without --network (their defaults hid that they were given)
    (["-np", "2", "--latency-us", "50", "--ranks-per-host", "4"], "--latency-us, --ranks-per-host: only with --network"),
    (["-np", "2", "--ranks-per-host", "1"], "--ranks-per-host: only with --network GBIT"),
])
def test_plan_network_bad_input_is_a_clean_error(args, message):
    r = CliRunner().invoke(cli, ["plan", str(MLP), *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output


NO_TORCH = """
import sys
class NoTorch:  # this process cannot import torch, as on a login node without it
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTorch())
from hvtrain.cli import main
sys.argv = ["hvtrain"] + sys.argv[1:]
main()
"""


def test_plan_network_without_the_framework_asks_for_step_ms():
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, "plan", str(MLP), "-np", "2", "--network", "10"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "hvtrain: error: measuring a step here needs the config's backend: backend 'torch' cannot be used" \
        in proc.stderr and "or give --step-ms MS" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, "plan", str(MLP), "-np", "2", "--network", "10",
                           "--step-ms", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "100.0%" in proc.stdout, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("horovod") is None,
                    reason="measuring needs the torch backend")
def test_plan_network_measures_here_without_step_ms(tmp_path):
    config = tmp_path / "mlp.yaml"
    config.write_text(MLP.read_text())  # its output_dir is relative: it would appear here
    proc = subprocess.run([sys.executable, "-m", "hvtrain", "plan", str(config), "-np", "2", "--network", "64",
                           "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"compute measured on this host: [\d.]+ ms/step \(10 steps, torch, one process with one of 1 rank", proc.stderr)
    got = json.loads(proc.stdout)
    assert got["compute_source"] == "measured" and got["compute_ms"] > 0 and got["np"] == 2
    assert list(tmp_path.iterdir()) == [config]  # no output directory, checkpoint or log
