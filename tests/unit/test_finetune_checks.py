"""model.init_from / init_skip and per-layer `trainable: false` (issue 12, item 6) without a framework:
config and spec checks, which weights start from the file, and the errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from safetensors.numpy import save_file

from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError
from hvtrain.model.spec import build_spec
from hvtrain.model.weights import initial_weights

LAYERS = [{"type": "dense", "units": 8, "activation": "relu", "name": "body", "trainable": False},
          {"type": "batchnorm", "name": "bn", "trainable": False},
          {"type": "dense", "units": 6, "name": "mid"},
          {"type": "dense", "units": 3, "name": "head"}]


def config(**model):
    return load_config({"name": "ft", "seed": 4, "data": {"dataset": "synthetic:classification", "classes": 3},
                        "model": {"input_shape": [20], "layers": LAYERS, **model}})


def test_frozen_layers_have_no_trainable_weights():
    spec = build_spec(config())
    frozen = {w.name for layer in spec.layers[:2] for w in layer.weights}
    assert [layer.trainable for layer in spec.layers] == [False, False, True, True]
    assert frozen == {"layers.0.kernel", "layers.0.bias", "layers.1.gamma", "layers.1.beta", "layers.1.moving_mean",
                      "layers.1.moving_variance"}
    assert not any(w.trainable for w in spec.weight_specs() if w.name in frozen)
    assert spec.param_count == 8 * 6 + 6 + 6 * 3 + 3  # only what the optimizer updates


def test_trainable_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"model.layers\[0\].trainable: expected true or false, got 'no'"):
        build_spec(load_config({"name": "x", "data": {"dataset": "sklearn:iris"},
                                "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 3,
                                                                          "trainable": "no"}]}}))


@pytest.mark.parametrize("model,message", [
    ({"init_skip": ["head"]}, "model.init_skip: only used with model.init_from"),
    ({"init_from": "x.safetensors", "entrypoint": "pkg.mod:fn", "layers": []},
     "model.init_from: needs model.layers (neutral weights)"),
])
def test_init_config_errors(model, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(**model)


def source_weights(tmp_path, head_units: int = 5):
    """A neutral file of a model with the same body/bn/mid and another head (another task)."""
    cfg = load_config({"name": "src", "seed": 99, "data": {"dataset": "synthetic:classification"},
                       "model": {"input_shape": [20], "layers": LAYERS[:3] + [{"type": "dense", "units": head_units}]}})
    w = build_spec(cfg).init_weights(99)
    w["layers.1.moving_mean"] = np.full(8, 0.25, np.float32)  # not the seeded values
    save_file(w, str(tmp_path / "src.safetensors"), metadata={"format": "hvtrain-neutral-v1"})
    return w


def test_init_from_loads_every_layer_but_the_skipped_ones(tmp_path):
    src = source_weights(tmp_path)
    cfg = config(init_from=str(tmp_path / "src.safetensors"), init_skip=["head"])
    weights, note = initial_weights(cfg, build_spec(cfg))
    seeded = build_spec(cfg).init_weights(cfg.seed)
    assert not np.array_equal(seeded["layers.0.kernel"], src["layers.0.kernel"])  # the file is not the seed
    for name in [k for k in seeded if not k.startswith("layers.3.")]:
        assert np.array_equal(weights[name], src[name]), name
    for name in ("layers.3.kernel", "layers.3.bias"):
        assert np.array_equal(weights[name], seeded[name])  # the new head keeps its seeded init
    assert note == f"init_from {tmp_path}/src.safetensors: layers body, bn, mid loaded; head seeded; frozen: body, bn"


def test_a_changed_head_without_init_skip_is_named(tmp_path):
    source_weights(tmp_path)
    cfg = config(init_from=str(tmp_path / "src.safetensors"))
    with pytest.raises(ConfigError, match=r"<dict>: model.init_from: .*src.safetensors: layers.3.kernel of "
                                          r"model.layers\[3\] \(head\) has shape \[6, 5\], the model needs \[6, 3\]; "
                                          r"list the layer's name in model.init_skip"):
        initial_weights(cfg, build_spec(cfg))


def test_unknown_skip_name_and_missing_file(tmp_path):
    source_weights(tmp_path)
    cfg = config(init_from=str(tmp_path / "src.safetensors"), init_skip=["haed"])
    with pytest.raises(ConfigError, match="model.init_skip: no layer is named 'haed'; named layers: body, bn, mid, head"):
        initial_weights(cfg, build_spec(cfg))
    cfg = config(init_from=str(tmp_path / "nothere.safetensors"))
    with pytest.raises(ConfigError, match="model.init_from: .*nothere.safetensors: weights file not found"):
        initial_weights(cfg, build_spec(cfg))


class _Payload:
    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_pickle_is_refused_and_never_run(tmp_path):
    payload = _Payload()
    payload.marker = str(tmp_path / "pwned")
    (tmp_path / "evil.safetensors").write_bytes(pickle.dumps(payload))
    cfg = config(init_from=str(tmp_path / "evil.safetensors"))
    with pytest.raises(ConfigError, match="evil.safetensors: not a readable safetensors file"):
        initial_weights(cfg, build_spec(cfg))
    assert not (tmp_path / "pwned").exists()


def mismatched(tmp_path, kind: str):
    """A source [dense, layernorm, dense] saved as final.safetensors or as a checkpoint (both record
    their layers), and a config whose layer 1 is a batchnorm."""
    from hvtrain.io import checkpoints as checkpoint
    from hvtrain.model.weights import layer_metadata

    layers = [{"type": "dense", "units": 8, "name": "a"}, {"type": "layernorm", "name": "norm"},
              {"type": "dense", "units": 3, "name": "head"}]
    src = load_config({"name": "src", "data": {"dataset": "synthetic:classification", "classes": 3},
                       "model": {"input_shape": [20], "layers": layers}})
    spec = build_spec(src)
    w = spec.init_weights(1)
    if kind == "final":
        path = tmp_path / "final.safetensors"
        save_file(w, str(path), metadata={"format": "hvtrain-neutral-v1", **layer_metadata(spec)})
    else:
        path = checkpoint.save(tmp_path, {f"weights.{k}": v for k, v in w.items()},
                               {"step": 1, "epoch": 1, "run_id": "0123abcd", "config": src.to_dict()}, keep=1)
    return path, layers


@pytest.mark.parametrize("kind", ["final", "checkpoint"])
def test_a_layer_of_another_type_at_the_same_index_is_named_with_both_layers(tmp_path, kind):
    """Defect: layers matched by index and tensor shape only, so a source layer of another kind
    loaded when its tensors fit, or failed with a misleading 'has no such tensor ... init_skip'.
    The source's recorded layer types (final.safetensors metadata, a checkpoint's config) are
    compared first and the error names both layers."""
    path, layers = mismatched(tmp_path, kind)
    target = [layers[0], {"type": "batchnorm", "name": "bn"}, layers[2]]
    def target_config(**extra):
        return load_config({"name": "t", "data": {"dataset": "synthetic:classification", "classes": 3},
                            "model": {"input_shape": [20], "layers": target, "init_from": str(path), **extra}})

    cfg = target_config()
    with pytest.raises(ConfigError) as e:
        initial_weights(cfg, build_spec(cfg))
    assert str(e.value) == (f"<dict>: model.init_from: {path}: layers.1 (norm) is a layernorm layer, "
                            "model.layers[1] (bn) here is a batchnorm: layers match by index, so the shared layers "
                            "must come first and in the same order; list the layer's name in model.init_skip to keep "
                            "its seeded init")
    skipped = target_config(init_skip=["bn"])
    _, note = initial_weights(skipped, build_spec(skipped))  # skipped: the other layers still load
    assert note == f"init_from {path}: layers a, head loaded; bn seeded"


def test_renamed_layers_load_and_are_listed(tmp_path):
    """A different name at the same index with the same type is allowed (layers get renamed), and
    the start-up line says so: a reordering of same-typed layers shows there."""
    path, layers = mismatched(tmp_path, "final")
    target = [{**layers[0], "name": "encoder"}, layers[1], layers[2]]
    cfg = load_config({"name": "t", "data": {"dataset": "synthetic:classification", "classes": 3},
                       "model": {"input_shape": [20], "layers": target, "init_from": str(path)}})
    _, note = initial_weights(cfg, build_spec(cfg))
    assert note == f"init_from {path}: layers encoder, norm, head loaded (renamed: a -> encoder)"


def test_resume_from_a_checkpoint_does_not_read_init_from(tmp_path, monkeypatch):
    """Defect: `--resume` read model.init_from again (failing once the file had moved, and printing
    that it loaded weights the checkpoint then replaced). Resuming from a checkpoint skips it;
    `--resume auto` with no checkpoint file yet still starts from init_from."""
    from hvtrain.io import checkpoints as checkpoint
    from hvtrain.training import entry as session

    seen = {}
    monkeypatch.setattr(session, "_train", lambda p, *args: seen.setdefault("p", p))
    out = tmp_path / "out"
    cfg = config(init_from=str(tmp_path / "moved.safetensors"))
    cfg.output_dir = str(out)
    ckpt = checkpoint.save(tmp_path, {"weights.x": np.zeros(1, np.float32)}, {"step": 1, "run_id": "0123abcd"}, keep=1)
    p = session.train(cfg, resume=str(ckpt))
    assert p.initial is None and p.initial_note == (f"init_from {tmp_path}/moved.safetensors: not read (resuming "
                                                    "from a checkpoint, whose weights continue)")
    with pytest.raises(ConfigError, match="moved.safetensors: weights file not found"):
        session.train(cfg, resume="auto")  # no checkpoint in the output directory: a fresh start, from init_from
    out.mkdir()
    checkpoint.save(out, {"weights.x": np.zeros(1, np.float32)}, {"step": 1, "run_id": "0123abcd"}, keep=1)
    assert session.train(cfg, resume="auto").initial is None


def test_resume_auto_finding_nothing_usable_after_skipping_init_from_is_an_error():
    """`--resume auto` skipped init_from because checkpoint files were there, but none verified or
    matched: a seeded start would silently drop the fine-tuning source."""
    from types import SimpleNamespace

    from hvtrain.errors import HvtrainError
    from hvtrain.training.loop import fit

    run = SimpleNamespace(checkpoints=SimpleNamespace(start=lambda *args: None), init_unread=True,
                          steps=SimpleNamespace(shard="model", replicas=1), cfg=config(init_from="a.safetensors"))
    with pytest.raises(HvtrainError, match=r"--resume auto: no checkpoint to continue, and model.init_from "
                                           r"\(a.safetensors\) was not read"):
        fit(run, "auto")
