"""Layer -> stage -> rank plan for pipeline (and hybrid data x pipeline) parallelism.

Rank layout: world = D replicas x S stages, pipeline-major. Rank r is stage r % S of
replica r // S, so one pipeline's stages are consecutive ranks (on one node when slots
allow: activations stay local) and stage s's data-parallel group is {s, S+s, 2S+s, ...}.

    np=4, S=2:   replica 0: rank 0 (stage 0) -> rank 1 (stage 1)
                 replica 1: rank 2 (stage 0) -> rank 3 (stage 1)
                 allreduce groups: stage 0 {0, 2}, stage 1 {1, 3}

`placement: auto` splits layers into S contiguous stages balancing trainable parameter
counts: stage boundaries are placed where the running parameter total first reaches
k/S of the whole (k = 1..S-1), keeping at least one layer per stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvtrain.config.schema import Config
from hvtrain.model.spec import INPUT, ModelSpec
from hvtrain.pipeline.schedule import bubble_fraction, peak_in_flight, stage_ops


@dataclass(frozen=True)
class Stage:
    index: int
    first: int  # layer indices, inclusive
    last: int
    params: int
    device: str
    sources: tuple[int, ...]  # producers of the tensors it receives (INPUT = the model input)
    outputs: tuple[int, ...]  # producers of the tensors it sends on (the last stage: the model output)
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def out_values(self) -> int:
        """Values per sample the stage sends (all its outgoing tensors)."""
        return sum(math.prod(s) for s in self.out_shapes)


@dataclass(frozen=True)
class PipelinePlan:
    stages: tuple[Stage, ...]
    replicas: int
    micro_batches: int
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        return self.replicas * self.num_stages

    def stage_of(self, rank: int) -> int:
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        return rank // self.num_stages

    def rank_of(self, replica: int, stage: int) -> int:
        return replica * self.num_stages + stage

    def dp_group(self, stage: int) -> list[int]:
        return [self.rank_of(d, stage) for d in range(self.replicas)]

    def peak_micro_batches(self, stage: int) -> int:
        return peak_in_flight(stage_ops(self.schedule, self.num_stages, stage, self.micro_batches))

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.num_stages, self.micro_batches)


def make_plan(cfg: Config, spec: ModelSpec | None, world_size: int, local_devices: dict[str, int] | None = None
              ) -> PipelinePlan:
    """Validate the pipeline section against the model and world size.

    Raises:
        ConfigError: np not divisible by S, placement gaps/overlaps/empty stages, a native
            entrypoint model, or a device that does not exist here.
    """
    pc = cfg.parallel.pipeline
    S, M = pc.stages, pc.micro_batches  # each in its range: the config's (hvtrain.config.schema.Range)
    if spec is None:
        raise cfg.fail("parallel.pipeline", "a native model.entrypoint cannot be split into stages; "
                       "use model.layers")
    n = len(spec.layers)
    if S > n:
        raise cfg.fail("parallel.pipeline.stages", f"{S} stages for {n} layers: every stage needs a layer")
    if world_size % S:
        raise cfg.fail("parallel.pipeline.stages", f"the world size (-np {world_size}) must be a multiple of "
                       f"the {S} stages (np = replicas x stages)")
    bounds = _bounds(cfg, spec, S)
    stages = []
    for s, (first, last) in enumerate(bounds):
        device = _device(cfg, s, local_devices)
        params = sum(spec.layers[i].param_count for i in range(first, last + 1))
        if not any(w.trainable for i in range(first, last + 1) for w in spec.layers[i].weights):
            # its optimizer would have nothing to update (torch refuses an empty one; sharding cuts nothing)
            types = ", ".join(f"{i}: {spec.layers[i].type}" for i in range(first, last + 1))
            raise cfg.fail("parallel.pipeline.placement" if cfg.parallel.pipeline.placement != "auto"
                           else "parallel.pipeline.stages",
                           f"stage {s} holds no trainable weight (layers {types}); every stage needs one: "
                           "move these layers into a neighbouring stage with parallel.pipeline.placement")
        sources = (INPUT,) if s == 0 else crossing(spec, first - 1)
        outputs = (spec.output_index,) if s == S - 1 else crossing(spec, last)
        if s > 0 and INPUT in sources and spec.integer_input:
            raise cfg.fail("parallel.pipeline", f"stage {s} reads the model input (token ids), which stage "
                           "boundaries carry as float32; place the layers that read `input` in stage 0")
        stages.append(Stage(s, first, last, params, device, sources, outputs, tuple(_shape(spec, j) for j in sources),
                            tuple(_shape(spec, j) for j in outputs)))
    return PipelinePlan(tuple(stages), world_size // S, M, pc.schedule)


def crossing(spec: ModelSpec, cut: int) -> tuple[int, ...]:
    """The tensors a stage boundary after layer `cut` carries: every output produced at or before
    it (the model input included) that a later layer still reads, skip connections too."""
    readers = spec.consumers()
    return tuple(j for j in [INPUT, *range(cut + 1)] if any(r > cut for r in readers.get(j, ())))


def _shape(spec: ModelSpec, j: int) -> tuple[int, ...]:
    return spec.input_shape if j == INPUT else spec.layers[j].output_shape


def _bounds(cfg: Config, spec: ModelSpec, S: int) -> list[tuple[int, int]]:
    pc = cfg.parallel.pipeline
    n = len(spec.layers)
    tagged = [layer.stage for layer in spec.layers]
    if any(t is not None for t in tagged):
        if "parallel.pipeline.placement" in cfg.lines:
            raise cfg.fail("parallel.pipeline.placement", "give either placement or `stage:` keys on layers, not both")
        missing = [i for i, t in enumerate(tagged) if t is None]
        if missing:
            raise cfg.fail(spec.layers[missing[0]].path, "every layer needs a `stage:` key once one layer has one")
        ranges: dict[int, list[int]] = {}
        for i, t in enumerate(tagged):
            ranges.setdefault(t, []).append(i)
        placement = {s: [idx[0], idx[-1]] for s, idx in ranges.items()}
        where = "model.layers"
    elif pc.placement == "auto":
        return _auto(spec, S)
    elif isinstance(pc.placement, str):
        raise cfg.fail("parallel.pipeline.placement", f"expected 'auto' or {{stage: [first, last]}}, got "
                       f"{pc.placement!r}")
    else:
        placement, where = pc.placement, "parallel.pipeline.placement"
    for key, value in placement.items():
        ok = isinstance(key, int) and isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok:
            raise cfg.fail(where, f"expected {{stage: [first_layer, last_layer]}}, got {key!r}: {value!r}")
    if sorted(placement) != list(range(S)):
        empty = sorted(set(range(S)) - set(placement))
        extra = sorted(set(placement) - set(range(S)))
        what = f"stage {empty[0]} is empty (no layers)" if empty else f"stage {extra[0]} does not exist (stages: {S})"
        raise cfg.fail(where, what)
    bounds = [tuple(placement[s]) for s in range(S)]
    expected_first = 0
    for s, (first, last) in enumerate(bounds):
        if first > last:
            raise cfg.fail(where, f"stage {s}: [{first}, {last}] is empty (first > last)")
        if first > expected_first:
            raise cfg.fail(where, f"gap: layers {expected_first}..{first - 1} are in no stage "
                           f"(stage {s} starts at {first})")
        if first < expected_first:
            raise cfg.fail(where, f"overlap: stage {s} starts at layer {first}, but layer {first} is already in "
                           f"stage {s - 1}")
        expected_first = last + 1
    if expected_first != n:
        raise cfg.fail(where, f"gap: layers {expected_first}..{n - 1} are in no stage" if expected_first < n
                       else f"stage {S - 1} ends at layer {expected_first - 1}, but the model has {n} layers")
    return bounds


def _auto(spec: ModelSpec, S: int) -> list[tuple[int, int]]:
    counts = [layer.param_count for layer in spec.layers]
    total = sum(counts) or 1
    n = len(counts)
    cuts = []
    running, start = 0, 0
    for i, c in enumerate(counts):
        running += c
        k = len(cuts) + 1
        layers_left, stages_left = n - (i + 1), S - k
        if k < S and (running >= total * k / S or layers_left == stages_left) and layers_left >= stages_left:
            cuts.append((start, i))
            start = i + 1
    cuts.append((start, n - 1))
    return cuts


def _device(cfg: Config, stage: int, local_devices: dict[str, int] | None) -> str:
    """Normalised device name; checked against `local_devices` unless that is None (planning
    on a login node, where the framework is not imported)."""
    devices = cfg.parallel.pipeline.devices
    name = devices.get(stage, devices.get(str(stage), "cpu"))
    path = f"parallel.pipeline.devices.{stage}"
    if not isinstance(name, str):
        raise cfg.fail(path, f"expected a device name like cpu, cuda:0 or /GPU:0, got {name!r}")
    if name in ("cpu", "/CPU:0"):
        return "cpu"
    kind, index = _parse_device(name)
    if kind is None:
        raise cfg.fail(path, f"expected cpu, cuda:N or /GPU:N, got {name!r}")
    have = None if local_devices is None else local_devices.get("gpu", 0)
    if have is not None and index >= have:
        raise cfg.fail(path, f"device {name!r} does not exist on this host ({have} GPU(s) visible)")
    return f"gpu:{index}"


def _parse_device(name: str) -> tuple[str | None, int]:
    for prefix in ("cuda:", "/GPU:", "/gpu:", "gpu:"):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return "gpu", int(name[len(prefix):])
    return None, -1


def describe(plan: PipelinePlan, spec: ModelSpec, batch_size: int, bytes_per_value: int = 4) -> str:
    """The text `hvtrain plan` prints."""
    S, M = plan.num_stages, plan.micro_batches
    micro = math.ceil(batch_size / M)
    lines = [f"pipeline: {S} stages x {plan.replicas} replica(s) = {plan.world_size} ranks, "
             f"{M} micro-batches of ~{micro} samples, schedule {plan.schedule}, "
             f"bubble (S-1)/(M+S-1) = {plan.bubble:.3f}", ""]
    lines.append("layer  type        output shape      params      stage  ranks")
    for layer in spec.layers:
        s = next(st for st in plan.stages if layer.index in st.layers)
        ranks = ",".join(str(r) for r in plan.dp_group(s.index))
        lines.append(f"{layer.index:>5}  {layer.type:<10}  {str(list(layer.output_shape)):<16}  "
                     f"{layer.param_count:>10,}  {s.index:>5}  {ranks}")
    lines += ["", "stage  layers   device  params      act/sample(B)  peak micro  est. memory/rank"]
    for st in plan.stages:
        act = st.out_values * bytes_per_value
        inner = sum(math.prod(spec.layers[i].output_shape) for i in st.layers) * bytes_per_value
        peak = plan.peak_micro_batches(st.index)
        # weights + grads + up to 2 optimizer slots, and saved activations of the live micro-batches
        memory = st.params * bytes_per_value * 4 + inner * micro * peak
        lines.append(f"{st.index:>5}  {st.first:>2}..{st.last:<3}  {st.device:<6}  {st.params:>10,}  "
                     f"{act:>13,}  {peak:>10}  {_human(memory):>16}")
    lines += ["", "stage boundaries (tensors sent forward, and their gradients back, per sample):"]
    for st in plan.stages[:-1]:
        sent = ", ".join(f"{_producer(spec, j)} {list(shape)} {_human(math.prod(shape) * bytes_per_value)}"
                         for j, shape in zip(st.outputs, st.out_shapes, strict=True))
        lines.append(f"  {st.index} -> {st.index + 1}: {sent}")
    lines += ["", "data-parallel (allreduce) groups: " +
              "; ".join(f"stage {s}: ranks {plan.dp_group(s)}" for s in range(S))]
    return "\n".join(lines)


def _producer(spec: ModelSpec, j: int) -> str:
    if j == INPUT:
        return "input"
    layer = spec.layers[j]
    return f"layer {j} ({layer.name or layer.type})"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
