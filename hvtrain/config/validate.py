"""The checks of a built Config that span several keys (dataset kinds, series and text options,
pipeline and Horovod settings, the metrics list against the loss), located like every config
error. The metric names are hvtrain.metrics.names (a leaf); what the metrics compute is
hvtrain.metrics.suite."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hvtrain.config.schema import Config

from hvtrain.metrics.names import (
    CLASS_METRICS,
    CLASSIFICATION,
    NAMES,
    REGRESSION,
    REGRESSION_METRICS,
    TOP_K_DEFAULT,
    Metric,
)


def parse_metrics(cfg: Config) -> list[Metric]:
    """The config's `metrics:` list, checked against the loss and the layout.

    Items are names, or `{top_k_accuracy: {k: N}}` (a bare `top_k_accuracy` means k=5).

    Raises:
        ConfigError: an unknown name, a malformed item, a metric the loss cannot give (r2 with
            cross_entropy, roc_auc without class probabilities) or a duplicate; located at
            `metrics[i]`.
    """
    out: list[Metric] = []
    for i, item in enumerate(cfg.metrics):
        path = f"metrics[{i}]"
        if isinstance(item, dict):
            if list(item) != ["top_k_accuracy"]:
                raise cfg.fail(path, f"expected a metric name or {{top_k_accuracy: {{k: N}}}}, got {item!r}")
            opts = item["top_k_accuracy"]
            k = opts.get("k") if isinstance(opts, dict) and list(opts) == ["k"] else None
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise cfg.fail(f"{path}.top_k_accuracy", f"expected {{k: N}} with an integer N >= 1, got {opts!r}")
            metric = Metric("top_k_accuracy", k)
        elif item in NAMES:
            metric = Metric(item, TOP_K_DEFAULT if item == "top_k_accuracy" else 0)
        else:
            raise cfg.fail(path, f"unknown metric {item!r}; expected one of {', '.join(NAMES)}")
        _check_fits(cfg, path, metric)
        if metric.key in {m.key for m in out}:
            raise cfg.fail(path, f"{metric.key} is listed twice")
        out.append(metric)
    return out


def _check_fits(cfg: Config, path: str, metric: Metric) -> None:
    name, loss = metric.name, cfg.loss
    if name == "roc_auc" and loss not in CLASSIFICATION:
        raise cfg.fail(path, f"roc_auc needs class probabilities (loss cross_entropy: softmax, or "
                             f"binary_cross_entropy: sigmoid), got loss={loss!r}")
    if name in CLASS_METRICS and loss not in CLASSIFICATION:
        raise cfg.fail(path, f"{name} needs a classification loss (cross_entropy or binary_cross_entropy), "
                             f"got loss={loss!r}")
    if name in REGRESSION_METRICS and loss not in REGRESSION:
        raise cfg.fail(path, f"{name} needs a regression loss (mse or mae), got loss={loss!r}")
    if name == "top_k_accuracy" and loss != "cross_entropy":
        raise cfg.fail(path, "top_k_accuracy ranks the scores of several classes: it needs loss cross_entropy, "
                             f"got loss={loss!r} (use accuracy)")


SERIES_KINDS = ("statsmodels", "npz")  # datasets that can be a 1-D series (npz: a 1-D `x`)


def _check_series_and_text(cfg: Config) -> None:
    """data.window / data.horizon against the dataset and loss (their ranges are the schema's); the
    checks that need the series' length are made where it is read (hvtrain/timeseries.py)."""
    d = cfg.data
    kind = (d.dataset or "").partition(":")[0]
    if d.window is None:
        if kind == "statsmodels":
            raise cfg.fail("data.window", f"{d.dataset} is a 1-D series: set data.window (values per input window)")
        if "data.horizon" in cfg.lines and d.horizon != 1:  # 1, the default, is what a saved full config holds
            raise cfg.fail("data.horizon", "only used with data.window")
    else:
        if kind not in SERIES_KINDS:
            raise cfg.fail("data.window", f"expected a 1-D series dataset (statsmodels:co2|sunspots, or npz:PATH "
                           f"whose x is 1-D), got {d.dataset or d.entrypoint or 'data='!r}")
        if cfg.loss not in ("mse", "mae"):
            raise cfg.fail("loss", f"a windowed series forecasts values: expected mse or mae, got {cfg.loss}")


def validate(cfg: Config, need_data: bool = True) -> None:
    """Cross-field checks that types and each option's Range (checked as it is read) cannot express."""
    d, o = cfg.data, cfg.optimizer
    if need_data and d.dataset is None and d.entrypoint is None and d.provided is None:
        raise cfg.fail("data", "expected data.dataset or data.entrypoint (or data= in hvtrain.train)")
    if d.dataset is not None and d.entrypoint is not None:
        raise cfg.fail("data.entrypoint", "give either data.dataset or data.entrypoint, not both")
    if d.entrypoint is not None and not _is_entrypoint(d.entrypoint):
        raise cfg.fail("data.entrypoint", f"expected 'package.module:function', got {d.entrypoint!r}")
    if d.kwargs and d.entrypoint is None:
        raise cfg.fail("data.kwargs", "only used with data.entrypoint")
    _check_series_and_text(cfg)
    h = cfg.horovod
    for path, value, default in [("horovod.cycle_time_ms", h.cycle_time_ms, 1.0),
                                 ("horovod.fusion_threshold_mb", h.fusion_threshold_mb, 64.0)]:
        if h.autotune and value != default:
            raise cfg.fail(path, f"autotune: true searches it, and a value hvtrain exported would be left out of "
                                 f"the search; leave it unset (got {value:g}), or export HOROVOD_* yourself to fix it")
    if h.reduction == "direct":  # what only Horovod's path has would be ignored without a word
        ignored = [("train.compression", cfg.train.compression == "fp16"), ("horovod.num_groups", h.num_groups > 0),
                   ("horovod.timeline", bool(h.timeline)), ("horovod.autotune", h.autotune),
                   ("horovod.autotune_from", bool(h.autotune_from))]
        for path, given in ignored:
            if given:
                raise cfg.fail(path, "acts on Horovod's allreduces, which horovod.reduction: direct does not use; "
                                     "set horovod.reduction: hooks (or auto), or leave it out")
    if h.autotune and h.autotune_from:
        raise cfg.fail("horovod.autotune_from", "give either autotune: true (search now) or autotune_from (use a "
                       "previous search's best values), not both")
    if h.autotune_from:
        from hvtrain.config.autotune import best_autotuned

        try:
            best_autotuned(h.autotune_from)
        except ValueError as exc:
            raise cfg.fail("horovod.autotune_from", str(exc)) from None
    if len(o.betas) != 2:
        raise cfg.fail("optimizer.betas", f"expected two numbers [beta1, beta2], got {o.betas}")
    if o.nesterov and o.name != "sgd":
        raise cfg.fail("optimizer.nesterov", f"only sgd supports nesterov, got optimizer.name={o.name!r}")
    if o.nesterov and o.momentum == 0:  # torch refuses it once Horovod runs; Keras trains plain SGD
        raise cfg.fail("optimizer.nesterov", "Nesterov momentum needs optimizer.momentum > 0 (0 < momentum < 1), "
                                             "got momentum 0")
    if d.global_batch_size is not None:
        if "data.batch_size" in cfg.lines:
            raise cfg.fail("data.global_batch_size", "give data.batch_size (per replica) or data.global_batch_size "
                                                     "(the whole step), not both")
        acc = cfg.train.grad_accumulation
        if d.global_batch_size % acc:
            raise cfg.fail("data.global_batch_size", f"{d.global_batch_size} is not a multiple of "
                           f"train.grad_accumulation {acc} (each of its steps takes an equal share)")
        if cfg.optimizer.scale_lr:
            raise cfg.fail("optimizer.scale_lr", "scales the lr with the rank count, for a batch that grows with it; "
                                                 "data.global_batch_size keeps the batch: set optimizer.lr for it")
    image = cfg.data.image
    if image.size is not None and len(image.size) != 2:
        raise cfg.fail("data.image.size", f"expected [height, width], got {image.size}")
    a = d.augment
    if a.resized_crop is not None and (len(a.resized_crop) != 2 or a.resized_crop[0] > a.resized_crop[1]):
        raise cfg.fail("data.augment.resized_crop", f"expected [min, max] area fractions, min <= max, got "
                                                    f"{a.resized_crop}")
    if d.window is not None and d.normalize == "channel":
        raise cfg.fail("data.normalize", "channel is for image rows; a series (data.window) is standard, minmax "
                                         "or none")
    parquet = (d.dataset or "").startswith("parquet:")
    if isinstance(d.features, list) and not parquet:
        raise cfg.fail("data.features", "a list of columns is for parquet:GLOB datasets (synthetic:*: a number)")
    if isinstance(d.features, list) and not d.features:
        raise cfg.fail("data.features", "expected at least one column name")
    if isinstance(d.features, list) and len(set(d.features)) != len(d.features):
        twice = sorted({c for c in d.features if d.features.count(c) > 1})
        raise cfg.fail("data.features", f"names {', '.join(map(str, twice))} more than once (a column is one feature)")
    for key, value in (("data.label", d.label), ("data.image.column", image.column)):
        if value is not None and not parquet:
            raise cfg.fail(key, f"names a column of a parquet:GLOB dataset; data.dataset is {d.dataset!r}")
    m = cfg.model
    if m.entrypoint is None and not m.layers:
        raise cfg.fail("model", "expected model.layers (the neutral spec) or model.entrypoint")
    if m.entrypoint is not None and m.layers:
        raise cfg.fail("model.entrypoint", "give either model.layers or model.entrypoint, not both")
    if m.entrypoint is not None and m.factory is None and not _is_entrypoint(m.entrypoint):
        raise cfg.fail("model.entrypoint", f"expected 'package.module:function', got {m.entrypoint!r}")
    if m.output_key is not None and m.layers:
        raise cfg.fail("model.output_key", "says where a native model's scores are (model.entrypoint); a model.layers "
                                           "model's output is its last layer, or model.output")
    if m.init_skip and m.init_from is None:
        raise cfg.fail("model.init_skip", "only used with model.init_from")
    if m.init_from is not None and m.entrypoint is not None:
        raise cfg.fail("model.init_from", "needs model.layers (neutral weights); an entrypoint model cannot be "
                       "initialised from a file")
    if m.entrypoint is None and m.input_shape is None:
        raise cfg.fail("model.input_shape", "required with model.layers")
    if m.input_shape is not None and not m.input_shape:  # each value's range: the schema's
        raise cfg.fail("model.input_shape", f"expected a list of positive integers, got {m.input_shape}")
    if cfg.train.shard_optimizer:
        _check_sharding(cfg)
    if cfg.train.randomness == "per_sample" and m.entrypoint is not None:
        raise cfg.fail("train.randomness", "per_sample draws the catalogue's dropout masks (model.layers); a "
                       "model.entrypoint model's layers draw from their framework's per-rank streams: set per_rank "
                       "or auto")
    classification = cfg.loss in ("cross_entropy", "binary_cross_entropy")
    if "metrics" not in cfg.lines and not classification:
        cfg.metrics = ["mse", "mae"]  # the default [accuracy] is for classification losses
    parse_metrics(cfg)


def _check_sharding(cfg: Config) -> None:
    """What train.shard_optimizer does not cover yet: refused at the key that asks for it."""
    t = cfg.train
    refusals = [
        (t.precision == "fp16", "and train.precision fp16 (the loss scale's skip decision) are not combined yet; "
                                "bf16 or fp32 shard"),
        (t.on_nan == "skip", "and train.on_nan: skip are not combined yet"),
        (t.compression != "none", "reduce-scatters full-precision gradients; train.compression fp16 is not "
                                  "combined with it yet"),
        (cfg.horovod.num_groups > 0, "cuts the gradients into chunks of horovod.fusion_threshold_mb; "
                                     "horovod.num_groups is not combined with it"),
    ]
    for refused, why in refusals:
        if refused:
            raise cfg.fail("train.shard_optimizer", why)


def _is_entrypoint(text: str) -> bool:
    module, sep, func = text.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and func.isidentifier()


def per_replica_batch(cfg: Config, replicas: int) -> int:
    """data.batch_size for `replicas` data-parallel replicas: data.global_batch_size split over them
    and the accumulation steps (set on `cfg`), or the configured per-replica batch.

    Raises:
        ConfigError: the global batch does not divide evenly.
    """
    g, acc = cfg.data.global_batch_size, cfg.train.grad_accumulation
    if g is None:
        return cfg.data.batch_size
    if g % (replicas * acc):
        m = g // acc
        fits = sorted({d for k in range(1, math.isqrt(m) + 1) if m % k == 0 for d in (k, m // k)})
        raise cfg.fail("data.global_batch_size", f"{g} does not split evenly over {replicas} replica(s)"
                       + (f" x {acc} accumulation steps" if acc > 1 else "") + "; replica counts it fits: "
                       + ", ".join(map(str, fits[:12])) + (" ..." if len(fits) > 12 else ""))
    cfg.data.batch_size = g // (replicas * acc)
    return cfg.data.batch_size


def per_sample_randomness(cfg: Config) -> bool:
    """Whether the catalogue's dropout masks are drawn per sample (train.randomness, auto resolved)."""
    return cfg.model.entrypoint is None and cfg.train.randomness != "per_rank"


def draws_seed(cfg: Config, spec: Any = None) -> int | None:
    """The seed the step runners key per-sample dropout masks by, None under per-rank streams or
    for a model `spec` that draws nothing (no dropout: its keys were 7% of a small MLP's step)."""
    if spec is not None and not spec.draws_random:
        return None
    return cfg.seed if per_sample_randomness(cfg) else None


def experiment_record(cfg: Config) -> dict:
    """The config as a run's identity (checkpoints, summary.json's config_hash): with
    data.global_batch_size, the per-replica batch is this world's derivation, not the experiment."""
    record = cfg.to_dict()
    if cfg.data.global_batch_size is not None:
        record["data"].pop("batch_size", None)
    return record
