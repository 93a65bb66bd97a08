"""Scaling estimate: step time, efficiency and bytes per step of N Horovod ranks.

From one rank's measured (or given) step time and the model's gradients, `estimate` computes what
N data-parallel ranks (or D replicas x S pipeline stages) would take per step. Pure arithmetic:
no framework and no Horovod import, so `hvtrain plan --network --step-ms` runs on a login node.

The model, and the assumptions it makes:

1. Weak scaling: every rank computes its own `data.batch_size` samples as fast as one rank alone
   (`compute_ms`, forward + backward + update of one optimizer step). Efficiency is Horovod's
   paper's: throughput(N) / (N x throughput(1)) = replicas x compute_ms / (N x step_ms).
2. Gradients become ready during the backward pass of a step's last batch, last layers first. The
   backward pass is the last `backward_fraction` (2/3: it computes gradients for both inputs and
   weights, twice the forward's work) of that batch's compute. A `Tensor.ready` says how far into
   it a gradient is ready; `spec_gradients` splits the pass over layers by a multiply-accumulate
   estimate, `uniform_gradients` at an even pace.
3. Submission: torch's DistributedOptimizer hands each gradient to Horovod when its hook fires
   (`groups=0`), or each of `groups` contiguous groups (Horovod's num_groups) once its last member is
   ready; our TensorFlow backend submits grouped_allreduce groups (one group by default: nothing
   overlaps the backward pass). Pipeline stages reduce after their schedule: nothing overlaps.
4. Horovod's background thread (its synchronous RunLoopOnce): a cycle starts `cycle_ms` after the
   previous one started, or when its collectives end if later. It negotiates what every rank has
   ready (2 ceil(log2 N) latencies: a gather and a broadcast) and allreduces it in ready order,
   fused into buffers of at most the fusion threshold (a larger tensor goes alone, unsplit). The
   thread's phase against the step is unknown: the estimate is the mean over 16 evenly spaced
   phases, which is where the expected ~cycle/2 wait for the first cycle comes from.
5. Ring allreduce of B bytes over N ranks on H hosts: 2(N-1)/N x B / bandwidth (every link carries
   that; the slowest, the network's once H > 1, sets the pace) plus the latency of its 2(N-1) hops,
   2(H-1) of which cross hosts, the others at the local latency: NCCL's own ring model
   (src/graph/tuning.cc: (nsteps - nInterSteps) x intraLat + nInterSteps x interLat). The ring
   carries one fused message at a time.
6. Hosts: launchers place ranks host by host, so a flat ring crosses each host's network card once
   per direction: the card is *not* divided among a host's ranks. A job within one host
   (N <= ranks_per_host) runs at the local bandwidth. Concurrent pipeline-stage rings do share a card.
7. Pipelines (S stages, M micro-batches): a micro-batch slot takes the slowest stage's share of the
   compute / M plus its boundary transfers (activations forward, gradients back; local bandwidth when
   a replica's stages fit on one host); a schedule takes (M + S - 1) slots, i.e. the bubble
   (S-1)/(M+S-1); then every stage allreduces its gradients over the D replicas.
Not modelled: compute slowed by concurrent communication (memory bandwidth, NCCL kernels),
stragglers, a network's goodput below line rate, the response cache, hierarchical allreduce; the
optimizer update, which follows the last allreduce, is counted in the backward pass (compute_ms).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hvtrain.errors import ConfigError
from hvtrain.runtime.knobs import horovod_env

if TYPE_CHECKING:
    from hvtrain.config.schema import Config
    from hvtrain.model.spec import LayerSpec, ModelSpec

MIB = 1024 * 1024
PHASES = 16  # cycle phases averaged over
BACKWARD_FRACTION = 2 / 3
# Our backends that hand Horovod each gradient as the backward pass produces it (DistributedOptimizer
# hooks, backends/torch/backend.py); the others submit grouped_allreduce groups after the tape.
PER_GRADIENT_BACKENDS = ("torch",)


@dataclass(frozen=True)
class Tensor:
    """One gradient: its size on the wire and how far into the backward pass it is ready (0..1)."""

    nbytes: int
    ready: float


@dataclass(frozen=True)
class Network:
    """The links: bandwidth per host and direction (Gbit/s), latency per ring hop (us), and the same
    within one host (None: as between hosts)."""

    gbit: float
    latency_us: float = 10.0  # ~2-5 us RDMA, ~20-50 us TCP; NCCL assumes 9.6-14 us per network hop
    ranks_per_host: int = 1
    local_gbit: float | None = None
    local_latency_us: float | None = None

    def check(self) -> None:
        """Raises ValueError for a non-positive bandwidth or rank count or a negative latency."""
        for name, value, positive in [("gbit", self.gbit, True), ("local_gbit", self.local_gbit, True),
                                      ("ranks_per_host", self.ranks_per_host, True),
                                      ("latency_us", self.latency_us, False),
                                      ("local_latency_us", self.local_latency_us, False)]:
            if value is not None and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
                raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'}, got {value}")


@dataclass(frozen=True)
class Pipeline:
    """The pipeline layout the estimate needs (hvtrain.pipeline.plan holds the whole plan)."""

    micro_batches: int
    compute_shares: tuple[float, ...]  # each stage's share of the model's compute (sum 1)
    gradients: tuple[tuple[Tensor, ...], ...]  # each stage's gradients
    boundary_bytes: tuple[int, ...]  # bytes per sample crossing boundary s -> s+1 (the gradient comes back)

    @property
    def stages(self) -> int:
        return len(self.compute_shares)

    @property
    def bubble(self) -> float:
        return (self.stages - 1) / (self.micro_batches + self.stages - 1)


@dataclass(frozen=True)
class Estimate:
    np: int
    step_ms: float
    compute_ms: float
    samples_per_sec: float
    efficiency: float  # throughput(np) / (np x throughput(1))
    grad_bytes: int  # allreduced per step by one rank (its stage's, for pipelines)
    wire_bytes_per_rank: int  # sent by one rank per step: 2(N-1)/N x grad_bytes
    allreduce_ms: float  # time the ring is busy per step (negotiation included)
    exposed_comm_ms: float  # what communication adds to the step (data parallel: step_ms - compute_ms)
    messages: float  # fused allreduces per step (mean over cycle phases)
    bubble: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Ring:
    """One ring over `ranks` ranks placed host by host; `share` rings cross each host's card at once."""

    def __init__(self, ranks: int, net: Network, share: int = 1, per_host: int | None = None) -> None:
        hosts = math.ceil(ranks / (per_host or net.ranks_per_host))
        local_us = net.latency_us if net.local_latency_us is None else net.local_latency_us
        gbit = net.gbit / share if hosts > 1 else (net.local_gbit or net.gbit)
        self.n, self.bytes_per_ms = ranks, gbit * 1e9 / 8 / 1e3
        self.alpha = (net.latency_us if hosts > 1 else local_us) / 1e3  # the first / last hop: p2p, negotiation
        self.hops_ms = (2 * (hosts - 1) * net.latency_us + 2 * (ranks - hosts) * local_us) / 1e3

    def message_ms(self, nbytes: int) -> float:
        n = self.n
        return 2 * (n - 1) / n * nbytes / self.bytes_per_ms + self.hops_ms

    def negotiation_ms(self) -> float:
        return 2 * math.ceil(math.log2(self.n)) * self.alpha


def _fuse(sizes: list[int], fusion_bytes: int) -> list[int]:
    """Horovod's fusion: consecutive tensors packed while the buffer stays within the threshold."""
    out: list[int] = []
    for size in sizes:
        if out and fusion_bytes and out[-1] + size <= fusion_bytes:
            out[-1] += size
        else:
            out.append(size)
    return out


def _units(tensors: Sequence[Tensor], groups: int) -> list[tuple[float, list[int]]]:
    """(ready fraction, sizes) of what is submitted together, in submission order."""
    if not tensors:
        return []
    if groups <= 0:
        units = [(t.ready, [t.nbytes]) for t in reversed(tensors)]
    else:
        size, extra = divmod(len(tensors), min(groups, len(tensors)))
        units, start = [], 0
        for i in range(min(groups, len(tensors))):
            part = tensors[start: start + size + (1 if i < extra else 0)]
            start += len(part)
            units.append((max(t.ready for t in part), [t.nbytes for t in part]))
    return sorted(units, key=lambda u: u[0])  # stable: ties keep backward order


def _reduce(units: list[tuple[float, list[int]]], start_ms: float, window_ms: float, ring: _Ring,
            cycle_ms: float, fusion_bytes: int, phase_ms: float) -> tuple[float, float, int]:
    """Horovod's cycles over one step: (time the last allreduce ends, ring busy ms, messages)."""
    t, i, end, busy, messages = phase_ms, 0, 0.0, 0.0, 0
    while i < len(units):
        ready = start_ms + units[i][0] * window_ms
        if ready > t:  # idle cycles until the next gradient is ready
            t = t + math.ceil((ready - t) / cycle_ms - 1e-9) * cycle_ms if cycle_ms > 0 else ready
        sizes: list[int] = []
        while i < len(units) and start_ms + units[i][0] * window_ms <= t + 1e-9:
            sizes += units[i][1]
            i += 1
        work = ring.negotiation_ms()
        for message in _fuse(sizes, fusion_bytes):
            work += ring.message_ms(message)
            messages += 1
        busy += work
        end = t + work
        t = max(t + cycle_ms, end)
    return end, busy, messages


def _allreduce(tensors: Sequence[Tensor], start_ms: float, window_ms: float, ring: _Ring, cycle_ms: float,
               fusion_bytes: int, groups: int) -> tuple[float, float, float]:
    """Mean over cycle phases of (end, busy, messages)."""
    units = _units(tensors, groups)
    phases = [cycle_ms * k / PHASES for k in range(PHASES)] if cycle_ms > 0 else [0.0]
    runs = [_reduce(units, start_ms, window_ms, ring, cycle_ms, fusion_bytes, p) for p in phases]
    return tuple(sum(r[j] for r in runs) / len(runs) for j in range(3))  # type: ignore[return-value]


def estimate(gradients: int | Sequence[Tensor], compute_ms: float, np: int, network: Network | float, *,
             samples: int = 1, accumulation: int = 1, backward_fraction: float = BACKWARD_FRACTION,
             cycle_ms: float = 5.0, fusion_bytes: int = 64 * MIB, groups: int = 0,
             pipeline: Pipeline | None = None) -> Estimate:
    """Step time, efficiency and traffic of `np` ranks (the model: this module's docstring).

    Args:
        gradients: the gradient tensors in model (forward) order, or a total byte count (taken as
            64 equal tensors ready at an even pace). Ignored for pipelines (`pipeline.gradients`).
        compute_ms: one rank's optimizer step alone (`accumulation` batches, `samples` samples in all).
        np: ranks (for pipelines: replicas x stages).
        network: the links, or just the network's Gbit/s (every rank on its own host).
        samples: samples one replica processes per optimizer step.
        groups: 0 = each gradient submitted when ready; G = G contiguous groups (module docs, point 3).

    Raises:
        ValueError: a non-positive or non-finite time, bandwidth or count; np not a multiple of the stages.
    """
    net = network if isinstance(network, Network) else Network(float(network))
    net.check()
    for name, value in [("compute_ms", compute_ms), ("samples", samples), ("accumulation", accumulation), ("np", np)]:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a finite number > 0, got {value}")
    if not 0 <= backward_fraction <= 1 or not (math.isfinite(cycle_ms) and cycle_ms >= 0) or fusion_bytes < 0:
        raise ValueError(f"expected 0 <= backward_fraction <= 1, cycle_ms >= 0, fusion_bytes >= 0; got "
                         f"{backward_fraction}, {cycle_ms}, {fusion_bytes}")
    if isinstance(gradients, int):
        gradients = uniform_gradients(gradients, 64)
    if pipeline is not None:
        return _pipelined(pipeline, compute_ms, np, net, samples, accumulation, cycle_ms, fusion_bytes)
    grad_bytes = sum(t.nbytes for t in gradients)
    if np == 1:  # Horovod with one rank reduces nothing
        return Estimate(1, compute_ms, compute_ms, samples / compute_ms * 1e3, 1.0, grad_bytes, 0, 0.0, 0.0, 0.0)
    window = backward_fraction * compute_ms / accumulation  # the last batch's backward pass
    end, busy, messages = _allreduce(gradients, compute_ms - window, window, _Ring(np, net), cycle_ms,
                                     fusion_bytes, groups)
    step = max(compute_ms, end)
    return Estimate(np, step, compute_ms, np * samples / step * 1e3, compute_ms / step, grad_bytes,
                    round(2 * (np - 1) / np * grad_bytes), busy, step - compute_ms, messages)


def _pipelined(p: Pipeline, compute_ms: float, np: int, net: Network, samples: int, accumulation: int,
               cycle_ms: float, fusion_bytes: int) -> Estimate:
    S, M = p.stages, p.micro_batches
    if np % S:
        raise ValueError(f"np {np} is not a multiple of the {S} stages")
    D = np // S
    batch_ms = compute_ms / accumulation
    micro = samples / accumulation / M
    hop = _Ring(2, net, per_host=1 if S > net.ranks_per_host else 2)  # a replica's stages share a host?

    def transfer(s: int) -> float:  # per micro-batch: receive activations from s-1 and gradients from s+1
        sides = [p.boundary_bytes[s - 1]] if s > 0 else []
        sides += [p.boundary_bytes[s]] if s < S - 1 else []
        return sum(b * micro / hop.bytes_per_ms + hop.alpha for b in sides)

    slot = max(share * batch_ms / M + transfer(s) for s, share in enumerate(p.compute_shares))
    schedule = accumulation * (M + S - 1) * slot
    bare = accumulation * (M + S - 1) * max(p.compute_shares) * batch_ms / M  # without transfers
    sizes = [sum(t.nbytes for t in g) for g in p.gradients]
    worst = max(range(S), key=lambda s: sizes[s])
    end, busy, messages = schedule, 0.0, 0.0
    if D > 1:  # every stage's ring reduces at once, after the schedule, sharing the host's card
        ring = _Ring(D, net, share=min(S, net.ranks_per_host), per_host=max(1, net.ranks_per_host // S))
        end, busy, messages = _allreduce(p.gradients[worst], schedule, 0.0, ring, cycle_ms, fusion_bytes, 1)
    step = max(schedule, end)
    return Estimate(np, step, compute_ms, D * samples / step * 1e3, D * compute_ms / (np * step), sizes[worst],
                    round(2 * (D - 1) / D * sizes[worst]), busy, step - bare, messages, p.bubble)


# ----------------------------------------------------------------------------- gradients


def uniform_gradients(total_bytes: int, count: int) -> list[Tensor]:
    """`count` near-equal tensors (model order) whose gradients are ready at an even pace."""
    size, extra = divmod(int(total_bytes), count)
    return [Tensor(size + (1 if j < extra else 0), (count - j) / count) for j in range(count)]


def layer_cost(layer: LayerSpec) -> float:
    """Multiply-accumulates per sample, roughly: each weight used once per output position (dense,
    conv), per time step (recurrent), plus attention's scores; and one per output value."""
    out = math.prod(layer.output_shape)
    params = layer.param_count
    if layer.type in ("lstm", "gru"):
        return params * layer.input_shape[0] + out
    if layer.type == "multi_head_attention":
        t, kv = layer.input_shape[0], layer.input_shapes[-1][0]
        o = layer.options
        return params * max(t, kv) + 2 * t * kv * o["num_heads"] * o["key_dim"] + out
    if layer.type == "embedding":
        return out
    return params * math.prod(layer.output_shape[:-1] or (1,)) + out


def spec_gradients(spec: ModelSpec, bytes_per_value: int = 4, layers: Sequence[int] | None = None) -> list[Tensor]:
    """The trainable weights' gradients of `layers` (default: all) in model order; each layer's are
    ready when the backward pass, run from the last layer down, has done its share of the cost."""
    chosen = [spec.layers[i] for i in (layers if layers is not None else range(len(spec.layers)))]
    costs = [layer_cost(layer) for layer in chosen]
    total = sum(costs) or 1.0
    out, done = [], total
    for layer, cost in zip(chosen, costs, strict=True):
        ready = done / total  # the backward pass reaches this layer's end after the layers above it
        out += [Tensor(math.prod(w.shape) * bytes_per_value, ready) for w in layer.weights if w.trainable]
        done -= cost
    return out


# ----------------------------------------------------------------------------- a config's estimate


def horovod_knobs(cfg: Config) -> tuple[float, int]:
    """The cycle time (ms) and fusion threshold (bytes) a run of `cfg` gives Horovod: the config's
    (or its autotune_from log's best) values, unless HOROVOD_* variables set here win, as in a run.
    With horovod.autotune hvtrain exports neither (Horovod searches both while training, and the
    config must leave them at their defaults): the config's values then, the estimate's stand-in
    for wherever the search goes (a KeyError before)."""
    h = cfg.horovod
    env = horovod_env(h)
    try:
        cycle = float(os.environ.get("HOROVOD_CYCLE_TIME") or env.get("HOROVOD_CYCLE_TIME", h.cycle_time_ms))
        fusion = int(os.environ.get("HOROVOD_FUSION_THRESHOLD")
                     or env.get("HOROVOD_FUSION_THRESHOLD", int(h.fusion_threshold_mb * MIB)))
    except ValueError as exc:
        raise ConfigError(f"HOROVOD_CYCLE_TIME / HOROVOD_FUSION_THRESHOLD: expected numbers ({exc})") from None
    return cycle, fusion


def estimate_for_config(cfg: Config, spec: ModelSpec | None, np: int, network: Network | float, step_ms: float, *,
                        gradient_sizes: Sequence[int] | None = None) -> Estimate:
    """The estimate for `np` ranks running `cfg`, one rank's optimizer step taking `step_ms`.

    Gradients come from `spec` (fp16 on the wire with `train.compression: fp16`); a native
    model.entrypoint model needs `gradient_sizes` (values per trainable tensor, model order: what a
    built backend reports), taken as ready at an even pace. Submission follows the backend (module
    docs, point 3); cycle time and fusion threshold are what Horovod would get.

    Raises:
        ConfigError: an entrypoint model without `gradient_sizes`; np not a multiple of the stages.
    """
    bytes_per_value = 2 if cfg.train.compression == "fp16" else 4
    if gradient_sizes is not None:
        count = len(gradient_sizes)
        gradients = [Tensor(v * bytes_per_value, (count - j) / count) for j, v in enumerate(gradient_sizes)]
    elif spec is not None:
        gradients = spec_gradients(spec, bytes_per_value)
    else:
        raise cfg.fail("model.entrypoint", "the gradient sizes of a native model are known only once it is built: "
                       "omit --step-ms to build it and measure its step here")
    cycle, fusion = horovod_knobs(cfg)
    h, t = cfg.horovod, cfg.train
    groups = h.num_groups if cfg.backend in PER_GRADIENT_BACKENDS else max(1, h.num_groups)
    pipeline = None
    if cfg.pipelined:
        from hvtrain.pipeline.plan import make_plan

        plan = make_plan(cfg, spec, np)
        costs = [layer_cost(layer) for layer in spec.layers]
        total_cost = sum(costs) or 1.0
        pipeline = Pipeline(plan.micro_batches,
                            tuple(sum(costs[i] for i in st.layers) / total_cost for st in plan.stages),
                            tuple(tuple(spec_gradients(spec, bytes_per_value, st.layers)) for st in plan.stages),
                            tuple(st.out_values * 4 for st in plan.stages[:-1]))  # boundaries travel as float32
    try:
        return estimate(gradients, step_ms, np, network, samples=cfg.data.batch_size * t.grad_accumulation,
                        accumulation=t.grad_accumulation, cycle_ms=cycle, fusion_bytes=fusion, groups=groups,
                        pipeline=pipeline)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# ----------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Published:
    """A published Horovod scaling figure and what the estimate needs to reproduce it."""

    model: str
    params: int  # trainable (allreduced) values: keras.applications' model, weights=None
    tensors: int  # trainable tensors, ibid.
    images_per_sec: float  # one P100, batch 64, TensorFlow, synthetic data
    efficiency: float  # published scaling efficiency


# Horovod's README and docs/benchmarks.rst (github.com/horovod/horovod): tf_cnn_benchmarks, batch 64
# per GPU, "128 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network":
# 90% scaling efficiency for Inception V3 and ResNet-101, 68% for VGG-16, at 512 GPUs.
# One-GPU speeds: TensorFlow's benchmarks page (tensorflow/docs_src/performance/benchmarks.md, May
# 2017, DGX-1 P100, synthetic data, batch 64): Inception V3 142 img/s, VGG-16 154 img/s, ResNet-50
# 219 and ResNet-152 91.8 img/s. ResNet-101 is not listed: its 33 bottleneck blocks sit midway between
# ResNet-50's 16 and ResNet-152's 50, so its time per image is taken as the mean of theirs (129 img/s).
# Hop latencies: NCCL's tuning constants for the ring's Simple protocol (src/graph/tuning.cc): 14 us
# per network hop, 5.7 us per PCIe hop inside a host.
PAPER_NP, PAPER_BATCH = 512, 64
PAPER_NETWORK = Network(25.0, latency_us=14.0, ranks_per_host=4, local_latency_us=5.7)
PAPER = (
    Published("ResNet-101", 44_601_832, 418, 2 / (1 / 219 + 1 / 91.8), 0.90),
    Published("Inception V3", 23_817_352, 190, 142.0, 0.90),
    Published("VGG-16", 138_357_544, 32, 154.0, 0.68),
)


def paper_estimate(model: Published, np: int = PAPER_NP, network: Network = PAPER_NETWORK) -> Estimate:
    """The estimate for a published model under the benchmark's setup (Horovod's defaults then:
    5 ms cycle, 64 MiB fusion; each gradient submitted when ready; fp32 gradients)."""
    return estimate(uniform_gradients(model.params * 4, model.tensors), PAPER_BATCH / model.images_per_sec * 1e3,
                    np, network, samples=PAPER_BATCH)
