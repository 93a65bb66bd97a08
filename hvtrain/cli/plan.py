from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from hvtrain.config.schema import Config
    from hvtrain.tools.scaling import Estimate, Network

MEASURED_STEPS = 10


class _Number(click.ParamType):
    """A finite float, > 0 (or >= 0): click's FloatRange lets nan and inf through."""

    name = "number"

    def __init__(self, zero_ok: bool = False) -> None:
        self.zero_ok = zero_ok

    def convert(self, value, param, ctx) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"expected a number, got {value!r}", param, ctx)
        if not math.isfinite(number) or number < 0 or (number == 0 and not self.zero_ok):
            self.fail(f"expected a finite number {'>= 0' if self.zero_ok else '> 0'}, got {value!r}", param, ctx)
        return number


@click.command()
@click.argument("config")
@click.option("-np", "--num-proc", "np", type=click.IntRange(min=1), required=True, help="World size the plan is for.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a config value.")
@click.option("--network", "gbit", type=_Number(), metavar="GBIT",
              help="Estimate step time and scaling efficiency on a network of GBIT Gbit/s per host.")
@click.option("--step-ms", type=_Number(), metavar="MS",
              help="One rank's optimizer step, measured elsewhere: imports no framework. Default: measure it here.")
@click.option("--latency-us", type=_Number(zero_ok=True), default=10.0, show_default=True,
              help="Latency of one ring hop between hosts.")
@click.option("--ranks-per-host", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ranks on each host (a job on one host runs at --local-gbit).")
@click.option("--local-gbit", type=_Number(), metavar="GBIT", help="Bandwidth within a host (default: --network).")
@click.option("--json", "as_json", is_flag=True, help="Print the estimate for NP as one JSON object.")
def plan(config: str, np: int, overrides: tuple[str, ...], gbit: float | None, step_ms: float | None,
         latency_us: float, ranks_per_host: int, local_gbit: float | None, as_json: bool) -> None:
    """Print the pipeline plan of CONFIG on NP ranks (no training, no framework import), or with
    --network the estimated step time, efficiency and traffic of NP ranks (and powers of two below)."""
    from hvtrain.errors import BackendUnavailable
    from hvtrain.runtime.experiment import prepare

    if gbit is None:
        source = click.get_current_context().get_parameter_source
        given = [name for name, value in [("--step-ms", step_ms), ("--local-gbit", local_gbit), ("--json", as_json)]
                 if value]
        given += [name for name, key in [("--latency-us", "latency_us"), ("--ranks-per-host", "ranks_per_host")]
                  if source(key) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{', '.join(given)}: only with --network GBIT")
        from hvtrain.config.validate import per_replica_batch
        from hvtrain.pipeline.plan import describe, make_plan

        p = prepare(config, overrides=overrides)
        plan = make_plan(p.cfg, p.spec, np)
        click.echo(describe(plan, p.spec, per_replica_batch(p.cfg, plan.replicas)))
        return
    from hvtrain.tools.scaling import Network, estimate_for_config

    p = prepare(config, overrides=overrides)
    if p.cfg.data.global_batch_size is not None:  # the model is weak scaling: each rank's batch fixed
        raise p.cfg.fail("data.global_batch_size", "hvtrain plan --network estimates a fixed per-replica batch "
                         "at each rank count; for this estimate give data.batch_size instead (--set "
                         "data.global_batch_size=null --set data.batch_size=B)")
    if p.cfg.pipelined:  # a bad world size fails before a measurement
        from hvtrain.pipeline.plan import make_plan

        make_plan(p.cfg, p.spec, np)
    source, sizes = "given", None
    if step_ms is None:
        from hvtrain.tools.measure import measure_step

        source = "measured"
        try:
            step_ms, sizes = measure_step(p, steps=MEASURED_STEPS, ranks_per_host=ranks_per_host)
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"measuring a step here needs the config's backend: {exc}; or give "
                                     "--step-ms MS, a step measured elsewhere") from None
        click.echo(f"compute measured on this host: {step_ms:.3f} ms/step ({MEASURED_STEPS} steps, "
                   f"{p.cfg.backend}, one process with one of {ranks_per_host} rank(s)' share of the CPUs)",
                   err=as_json)
        if p.spec is not None:
            sizes = None  # the spec also says when each layer's gradients are ready
    net = Network(gbit, latency_us, ranks_per_host, local_gbit)
    stages = p.cfg.parallel.pipeline.stages
    counts = sorted({2 ** j for j in range(np.bit_length()) if 2 ** j % stages == 0} | {np})
    estimates = [estimate_for_config(p.cfg, p.spec, n, net, step_ms, gradient_sizes=sizes) for n in counts]
    if as_json:
        click.echo(json.dumps({**estimates[-1].to_dict(), "compute_source": source, "network_gbit": gbit,
                               "autotune": p.cfg.horovod.autotune,
                               "latency_us": latency_us, "ranks_per_host": ranks_per_host, "local_gbit": local_gbit}))
    else:
        click.echo(_table(p.cfg, estimates, net, source))


def _table(cfg: Config, estimates: list[Estimate], net: Network, source: str) -> str:
    from hvtrain.tools.scaling import PER_GRADIENT_BACKENDS, horovod_knobs

    first = estimates[0]
    cycle, fusion = horovod_knobs(cfg)
    h, t = cfg.horovod, cfg.train
    if cfg.pipelined:
        submit = "after the pipeline schedule"
    elif cfg.backend in PER_GRADIENT_BACKENDS and h.num_groups == 0:
        submit = "each as the backward pass produces it"
    else:
        submit = f"in {max(1, h.num_groups)} group(s), each once all of its gradients are ready"
    samples = cfg.data.batch_size * t.grad_accumulation
    pc = cfg.parallel.pipeline
    layout = (f"{pc.stages} pipeline stages, {pc.micro_batches} micro-batches, bubble {first.bubble:.3f}"
              if cfg.pipelined else "data parallel")
    local = f", {net.local_gbit:g} Gbit/s within a host" if net.local_gbit else ""
    lines = [
        f"scaling estimate: {cfg.source} ({cfg.backend}, {layout}, {samples} samples per replica and step)",
        f"compute: {first.compute_ms:.3f} ms per step on one rank ({source})",
        f"gradients: {_bytes(first.grad_bytes)} per step{' (the largest stage)' if cfg.pipelined else ''}, "
        f"allreduced {submit}",
        f"Horovod: cycle {cycle:g} ms, fusion threshold {_bytes(fusion)}"
        f"{' (autotune: searched while training, estimated at these)' if h.autotune else ''}; "
        f"network {net.gbit:g} Gbit/s per host, "
        f"{net.latency_us:g} us per hop, {net.ranks_per_host} rank(s) per host{local}",
        "",
        "ranks    step ms    samples/s  efficiency  bytes/step/rank  allreduce ms  exposed comm ms",
    ]
    for e in estimates:
        lines.append(f"{e.np:>5}  {e.step_ms:>9.3f}  {e.samples_per_sec:>11,.0f}  {e.efficiency:>9.1%}  "
                     f"{_bytes(e.wire_bytes_per_rank):>15}  {e.allreduce_ms:>12.3f}  {e.exposed_comm_ms:>15.3f}")
    lines += ["", "efficiency = samples/s / (ranks x one rank's samples/s); the model and its assumptions: "
              "hvtrain/scaling.py"]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
