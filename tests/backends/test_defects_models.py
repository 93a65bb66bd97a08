"""Issue 21, the native-model output contract (items 2, 3, 11 and parts of 22): entrypoint models
written as their libraries' docs write them (tests.fixtures.user_models), built, trained and
exported by the real backends in one process. What the contract is: hvtrain.model.native and the
guide's "The native-model output contract" (docs/your-data-and-models.md)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from hvtrain.errors import ConfigError, HvtrainError
from hvtrain.metrics.suite import MetricSet, head_sums
from hvtrain.model.weights import describe_inputs, inputs_from
from hvtrain.tools.predict import convert
from tests.backends.conftest import make_backend
from tests.support.configs import CANCER, DIGITS, FIXTURE, backend_of
from tests.support.configs import native_config as config

REGRESSION = {"dataset": "synthetic:regression", "samples": 997, "features": 8, "validation_split": 0.2,
              "batch_size": 32}
TOKENS = {"entrypoint": "tests.fixtures.user_models:token_data", "normalize": "none", "batch_size": 32}
def built(model: str, data: dict = DIGITS, loss: str = "cross_entropy", lr: float = 0.003, **kwargs):
    return make_backend(backend_of(model), config(model, data, loss, lr, **kwargs))


def fit(backend, p, epochs: int) -> None:
    """The trainer's per-rank step on one rank: batches of the training split, weights 1/batch."""
    n, size = len(p.data.train), p.cfg.data.batch_size
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(n)
        for lo in range(0, n, size):
            x, y = p.data.train.take(order[lo:lo + size])
            assert backend.train_step(x, y, np.full(len(y), 1 / len(y), np.float32), apply=True)


def native(backend, x: np.ndarray) -> np.ndarray:
    """The user's model itself on `x`, inference mode, as float64 (a mapping: its 'logits')."""
    if backend.name == "torch":
        import torch

        backend.model.eval()
        try:
            with torch.no_grad():
                out = backend.model(torch.from_numpy(x))
        finally:
            backend.model.train()
    else:
        out = backend.model(x, training=False)
    if isinstance(out, Mapping):
        out = out["logits"]
    return np.asarray(out.numpy() if hasattr(out, "numpy") else out, np.float64)


def val_loss_sum(backend, p) -> float:
    x, y = p.data.x_val, p.data.y_val
    return float(backend.eval_batch(x, y, MetricSet.of(p.cfg, p.data), np.arange(len(y)))[0])


def exported(backend, p, tmp_path) -> np.ndarray:
    """The backend's own export format of the model, reloaded, on the raw validation rows."""
    fmt = "torchscript" if backend.name == "torch" else "savedmodel"
    inputs = inputs_from(describe_inputs(p.cfg, p.data), "the test's record")
    backend.export(fmt, str(tmp_path / "model"), inputs)
    raw = p.data.val.source.features(p.data.val.rows).astype(inputs.transform.dtype)
    return np.asarray(backend.load_export(fmt, str(tmp_path / "model"))(raw), np.float64)


@pytest.mark.parametrize("model", ["keras_softmax_head", "torch_softmax"])
def test_defect_02_softmax_head_trains_on_its_probabilities_and_predict_and_export_apply_it_once(model, tmp_path):
    """Defect: a model ending in a softmax (the usual Keras head) was trained as if it returned
    logits: softmax applied twice, val_loss floored at ~1.46 at 98% accuracy, and predict and the
    export graphs softmaxed the probabilities again (squashed toward uniform). Now the loss is the
    cross-entropy of the model's own probabilities, and predict/export return those probabilities."""
    backend, p = built(model)
    fit(backend, p, 3)
    y = p.data.y_val
    proba = native(backend, p.data.x_val)
    np.testing.assert_allclose(proba.sum(axis=1), 1, atol=1e-5)  # the model really ends in a softmax
    own = -float(np.sum(np.log(proba[np.arange(len(y)), y])))
    assert val_loss_sum(backend, p) == pytest.approx(own, rel=1e-4)
    assert own / len(y) < 0.3, f"val loss {own / len(y):.3f}: not learned"
    np.testing.assert_allclose(convert("probabilities", p.cfg.loss, backend.predict(p.data.x_val), None), proba,
                               atol=1e-5)
    z = backend.predict(p.data.x_val)  # predict --logits: the softmax's input, log p up to a constant per row
    np.testing.assert_allclose(z - np.log(np.exp(z).sum(axis=1, keepdims=True)), np.log(proba), atol=1e-4)
    np.testing.assert_allclose(exported(backend, p, tmp_path), proba, atol=1e-5)


def test_defect_02_evaluate_and_predict_of_a_softmax_head_use_its_probabilities(tmp_path):
    """The real paths after training (in-process, torch: hvtrain.train, hvtrain.evaluate and
    hvtrain.predict): evaluate probes the loaded model as training did, so its val_loss is
    training's, and predict's probabilities are the model's own."""
    import hvtrain

    cfg = config("torch_softmax")
    cfg["train"]["epochs"] = 3
    s = hvtrain.train(cfg, output_dir=str(tmp_path), quiet=True)
    assert s["val_loss"] < 0.3, s
    e = hvtrain.evaluate(cfg, str(tmp_path / "final.safetensors"), output_dir=str(tmp_path / "eval"))
    assert e["val_loss"] == pytest.approx(s["val_loss"], rel=1e-5) and e["val_accuracy"] == s["val_accuracy"]
    from sklearn.datasets import load_digits

    p = hvtrain.predict(cfg, str(tmp_path / "final.safetensors"), load_digits().data[:100].astype(np.float32))
    assert p.max(axis=1).mean() > 0.85 and np.mean(p.argmax(axis=1) == load_digits().target[:100]) > 0.9


def test_defect_02_keras_applications_default_softmax_classifier_is_scored_on_its_probabilities():
    """keras.applications.MobileNetV2(weights=None, classes=10) ends in classifier_activation='softmax'
    by default: recognised, and its loss is -log p of its own output (not a second softmax's).
    Only evaluated here (its training step takes ~10 s to compile on a CPU; the softmax heads
    above train)."""
    backend, p = built("keras_mobilenet", {"entrypoint": f"{FIXTURE}:images", "batch_size": 16,
                                           "normalize": "none"})
    head = backend.model.get_layer("predictions")  # untrained outputs are near uniform: make them not
    head.bias.assign(np.linspace(0.0, 6.0, 10, dtype=np.float32))
    proba = native(backend, p.data.x_val)
    yv = p.data.y_val
    assert val_loss_sum(backend, p) == pytest.approx(-float(np.sum(np.log(proba[np.arange(len(yv)), yv]))), rel=1e-4)
    assert backend.output_form().undo == "softmax"


@pytest.mark.parametrize("model", ["keras_sigmoid_head", "torch_sigmoid"])
def test_defect_02_sigmoid_head_trains_on_its_probabilities_and_predict_and_export_apply_it_once(model, tmp_path):
    """The binary twin of the softmax head: Dense(1, activation='sigmoid'), or a forward ending in
    torch.sigmoid, was trained with a sigmoid applied to its probability (outputs stuck in
    [0.5, 0.73]). Now: the binary cross-entropy of its probability, which predict/export return."""
    backend, p = built(model, CANCER, "binary_cross_entropy", lr=0.01)
    fit(backend, p, 3)
    y = p.data.y_val
    prob = native(backend, p.data.x_val)[:, 0]
    own = -float(np.sum(y * np.log(prob) + (1 - y) * np.log(1 - prob)))
    assert val_loss_sum(backend, p) == pytest.approx(own, rel=1e-4)
    assert own / len(y) < 0.2 and np.mean((prob > 0.5) == y) > 0.9
    got = convert("probabilities", p.cfg.loss, backend.predict(p.data.x_val), None)[:, 0]
    np.testing.assert_allclose(got, prob, atol=1e-5)
    np.testing.assert_allclose(exported(backend, p, tmp_path)[:, 0], prob, atol=1e-5)


def test_contract_log_softmax_output_is_trained_as_logits():
    """A torch model ending in F.log_softmax(x, dim=1) (pytorch/examples' MNIST Net): its
    log-probabilities are logits up to a constant, so the loss is its NLL and predict's
    probabilities are exp of them; nothing is converted (this passed before too: decided, tested)."""
    backend, p = built("torch_log_softmax")
    fit(backend, p, 2)
    y = p.data.y_val
    logp = native(backend, p.data.x_val)
    assert val_loss_sum(backend, p) == pytest.approx(-float(np.sum(logp[np.arange(len(y)), y])), rel=1e-4)
    np.testing.assert_allclose(convert("probabilities", p.cfg.loss, backend.predict(p.data.x_val), None),
                               np.exp(logp), atol=1e-5)


@pytest.mark.parametrize("model", ["torch_squeezed_regressor", "keras_squeezed_regressor"])
def test_defect_03_squeezed_regression_output_learns_the_targets_not_the_batch_mean(model):
    """Defect: a one-target model returning `out.squeeze(-1)` ([batch]) passed the width check and
    trained on a [batch]-[batch, 1] broadcast loss: every sample against every target, so it
    learned the batch mean (val_r2 0.05 instead of 0.99), both backends, no warning. Now the
    output is taken as one column: the loss is the sample's own error, and r2 is high."""
    backend, p = built(model, REGRESSION, "mse", lr=0.01)
    fit(backend, p, 4)
    x, y = p.data.x_val, p.data.y_val
    out = backend.predict(x)
    assert out.shape == y.shape == (len(y), 1)
    assert val_loss_sum(backend, p) == pytest.approx(float(np.sum((native(backend, x) - y[:, 0]) ** 2)), rel=1e-4)
    r2 = 1 - np.sum((out - y) ** 2) / np.sum((y - y.mean()) ** 2)
    assert r2 > 0.9, f"val r2 {r2:.3f}"


def test_defect_03_squeezed_binary_logit_trains():
    """A binary classifier returning its logit as [batch] crashed mid-step (out[:, 0] of a 1-D
    tensor) after passing the width check; it is one logit per sample, taken as one column."""
    backend, p = built("torch_squeezed_binary", CANCER, "binary_cross_entropy", lr=0.01)
    fit(backend, p, 3)
    assert backend.predict(p.data.x_val).shape == (len(p.data.y_val), 1)
    assert backend.output_form().flat
    assert np.mean((backend.predict(p.data.x_val)[:, 0] > 0) == p.data.y_val) > 0.9


def test_defect_03_losses_and_metrics_refuse_a_shape_mismatch_instead_of_broadcasting(backend_name):
    """Defect: ops.py's losses and metrics.head_sums broadcast a [batch] output against [batch, 1]
    targets into [batch, batch] errors. Every loss and the metrics now refuse such shapes."""
    import importlib

    losses = importlib.import_module(f"hvtrain.backends.{backend_name}.ops").LOSSES
    tensor = get_tensor(backend_name)
    out, target = np.arange(4, dtype=np.float32), np.arange(4, dtype=np.float32).reshape(4, 1)
    for loss in ("mse", "mae"):
        with pytest.raises(ValueError, match=r"loss: outputs of shape \[4\] do not fit labels of shape \[4, 1\]"):
            losses[loss](tensor(out), tensor(target))
        with pytest.raises(HvtrainError, match=r"metrics: outputs of shape \[4\] do not fit labels of shape \[4, 1\]"):
            head_sums(loss, 0.0, out, target)
    ids = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=r"do not fit labels"):
        losses["binary_cross_entropy"](tensor(np.zeros((4, 2), np.float32)), tensor(ids))  # column 0 was taken
    with pytest.raises(HvtrainError, match=r"do not fit labels"):
        head_sums("cross_entropy", 0.0, np.zeros(4, np.float32), ids)


def get_tensor(backend_name: str):
    if backend_name == "torch":
        import torch

        return torch.from_numpy
    import tensorflow as tf

    return tf.constant


def test_contract_per_class_sigmoids_with_cross_entropy_are_undone_to_their_scores():
    """A final sigmoid under cross_entropy (a multi-label head on single-label data): its
    probabilities are turned back into the pre-sigmoid scores, which the softmax cross-entropy
    trains (a softmax of sigmoid outputs would squash them, as the double softmax did)."""
    backend, p = built("torch_sigmoid", features=64, outputs=10, lr=0.01)
    assert backend.output_form().undo == "sigmoid"
    fit(backend, p, 3)
    y = p.data.y_val
    z = np.log(native(backend, p.data.x_val)) - np.log1p(-native(backend, p.data.x_val))
    own = float(np.sum(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]))
    assert val_loss_sum(backend, p) == pytest.approx(own, rel=1e-4)
    assert np.mean(backend.predict(p.data.x_val).argmax(axis=1) == y) > 0.9


@pytest.mark.parametrize("model", ["torch_dict_logits", "keras_dict_logits", "torch_lazy"])
def test_contract_dict_logits_and_lazy_modules_train(model):
    """A module returning {'logits': ...} (a Hugging Face ModelOutput is an OrderedDict like this
    one) crashed in the step ('dict' has no attribute 'float'); nn.LazyLinear's weights did not
    exist when the optimizer was built. Both train now: the 'logits' entry is the output, and the
    first forward (the probe) materialises lazy modules before the optimizer takes them."""
    backend, p = built(model)
    fit(backend, p, 2)
    assert np.mean(backend.predict(p.data.x_val).argmax(axis=1) == p.data.y_val) > 0.9


@pytest.mark.parametrize("model, data, loss, kwargs, message", [
    ("torch_dict_logits", DIGITS, "cross_entropy", {"key": "scores"},
     r"returns a mapping with keys \['scores'\]; hvtrain reads the scores from its 'logits' entry: set "
     r"model.output_key"),
    ("torch_softmax", DIGITS, "cross_entropy", {"dim": 0}, r"ends in a softmax whose rows do not sum to 1"),
    ("keras_softmax_one_unit", CANCER, "binary_cross_entropy", {}, r"ends in a softmax over its one output"),
    ("torch_log_softmax", DIGITS, "cross_entropy", {"dim": 0}, r"ends in a log_softmax whose rows are not "
                                                                r"log-probabilities"),
    ("torch_log_softmax", CANCER, "binary_cross_entropy", {"features": 30, "classes": 1},
     r"ends in a log_softmax over its one output"),
    ("torch_softmax", CANCER, "binary_cross_entropy", {"features": 30, "classes": 2},
     r"outputs 2 values per sample; loss binary_cross_entropy needs one logit \(two class scores are loss "
     r"cross_entropy's\)"),
    ("torch_odd", DIGITS, "cross_entropy", {"what": "rank3"},
     r"returns scores of shape \[64, 1, 10\] for a probe batch of 64 samples"),
    ("torch_odd", DIGITS, "cross_entropy", {"what": "nan"}, r"returns non-finite scores \(nan/inf\)"),
    ("torch_squeezed_regressor", DIGITS, "cross_entropy", {"features": 64},
     r"returns scores of shape \[64\] for a probe batch of 64 samples; loss cross_entropy needs \[64, 10\]"),
    ("torch_mlp_wide", DIGITS, "cross_entropy", {}, r"outputs 12 values per sample; loss cross_entropy needs one "
                                                   r"score per class \(10 classes\)"),
])
def test_contract_refuses_what_it_cannot_read_in_one_located_line(model, data, loss, kwargs, message):
    """What the contract does not take is refused at model.entrypoint, before any optimizer step,
    naming what was received: a mapping without 'logits' (a tuple's first value is taken since
    issue 23, tests/backends/test_native_outputs.py), a softmax
    over the batch (dim=0: trained silently on nonsense), a softmax over one output (constant 1:
    nothing learned, silently), a 1-D output for a loss that needs a class dimension."""
    if model == "torch_mlp_wide":
        cfg = config("x")
        cfg["model"] = {"entrypoint": "tests.fixtures.native_models:torch_mlp", "kwargs": {"classes": 12}}
        name = "tests.fixtures.native_models:torch_mlp"
        run = lambda: make_backend("torch", cfg)  # noqa: E731
    else:
        name = f"{FIXTURE}:{model}"
        run = lambda: built(model, data, loss, **kwargs)  # noqa: E731
    with pytest.raises(ConfigError, match=rf"model\.entrypoint: {name} {message}"):
        run()


@pytest.mark.parametrize("model", ["keras_unbuilt_sequential", "keras_subclassed"])
def test_defect_11_unbuilt_keras_models_build_on_the_data_and_train_save_predict_export(model, tmp_path):
    """Defect: a Keras model that is not built yet (a Sequential without keras.Input, a subclassed
    keras.Model) crashed on `model.inputs`, and its optimizer would have been built on no
    variables. Now its first call on the data's probe batch builds it, before the optimizer."""
    backend, p = built(model)
    assert len(backend.trainable_names()) == 4  # two Dense layers' kernels and biases
    weights = backend.get_weights()
    fit(backend, p, 2)
    assert np.mean(backend.predict(p.data.x_val).argmax(axis=1) == p.data.y_val) > 0.9
    trained = backend.get_weights()
    assert all(not np.array_equal(trained[k], weights[k]) for k in weights)
    backend.set_weights(weights)  # what predict/evaluate load: the names the built model has
    np.testing.assert_array_equal(backend.get_weights()[sorted(weights)[0]], weights[sorted(weights)[0]])
    backend.set_weights(trained)
    want = convert("probabilities", p.cfg.loss, backend.predict(p.data.x_val), None)
    np.testing.assert_allclose(exported(backend, p, tmp_path), want, atol=1e-5)


@pytest.mark.parametrize("model, kwargs", [("torch_token_ids", {}), ("torch_token_ids", {"cast": True}),
                                           ("keras_token_ids", {}), ("keras_token_ids", {"declared": False})])
def test_defect_22_token_id_entrypoint_models_are_fed_int64_ids_and_train(model, kwargs):
    """Defect: a torch nn.Embedding model got float32 inputs (torch raises on float indices); a
    Keras model with keras.Input(dtype='int64') got float32 rows against its int64 step signature
    (TypeError), and an undeclared Sequential starting with an Embedding was not built. Now an
    embedding reading the model input (seen on the probe batch), or an integer Input, makes the
    data int64 token ids."""
    backend, p = built(model, TOKENS, lr=0.01, **kwargs)
    fit(backend, p, 6)
    assert np.mean(backend.predict(p.data.x_val).argmax(axis=1) == p.data.y_val) > 0.8
    assert p.data.x_train.dtype == np.int64
    assert backend.native_inputs().token_ids and backend.native_inputs().vocabulary == 50


def test_defect_22_token_id_model_trains_predicts_and_exports_on_int64_ids(tmp_path):
    """The real paths (in-process, torch): the weights' inputs record says int64, so hvtrain.predict
    feeds the ids as ids and the TorchScript export takes int64 rows (verified by hvtrain export)."""
    import hvtrain
    from hvtrain.tools.export import export_model
    from tests.fixtures.user_models import token_data

    cfg = config("torch_token_ids", TOKENS, lr=0.01)
    cfg["train"]["epochs"] = 6
    s = hvtrain.train(cfg, output_dir=str(tmp_path), quiet=True)
    weights = str(tmp_path / "final.safetensors")
    x, y = token_data()
    labels = hvtrain.predict(cfg, weights, x[:200], kind="labels")
    assert np.mean(labels == y[:200]) > 0.8 and s["val_accuracy"] > 0.8, s
    done = export_model(cfg, weights, "torchscript", str(tmp_path / "model.pt"))
    assert done["input"]["dtype"] == "int64" and done["max_difference"] <= 1e-4


@pytest.mark.parametrize("model", ["torch_token_ids", "keras_token_ids"])
def test_defect_22_token_ids_refuse_normalisation_and_ids_past_the_embedding(model):
    """Token ids standardised into other ids (Keras would cast them back to ints silently), or ids
    past the embedding's rows (torch: IndexError mid-step; TF on a GPU: zeros), are refused before
    training, located."""
    with pytest.raises(ConfigError, match=rf"data\.normalize: must be none: {FIXTURE}:{model} reads token ids"):
        built(model, {**TOKENS, "normalize": "standard"})
    with pytest.raises(ConfigError, match=r"model\.entrypoint: .*: its embedding has 20 rows, the data holds token "
                                          r"id 49"):
        built(model, TOKENS, vocab=20)
    with pytest.raises(ConfigError, match=r"reads token ids .*, but the data's features are not non-negative whole"):
        built(model, {**CANCER, "normalize": "none"}, **({"length": 30} if model.startswith("keras") else {}))


@pytest.mark.parametrize("loss", ["binary_cross_entropy", "cross_entropy"])
def test_defect_22_classification_on_one_class_is_refused_before_training(loss):
    """Defect: binary_cross_entropy on data whose labels are all one class trained, and predict's
    labels then indexed classes[1] of a one-class list (IndexError). One class has nothing to tell
    apart: refused at `loss`, naming the class, before any framework starts."""
    from hvtrain.runtime.experiment import prepare

    cfg = config("torch_sigmoid", {"entrypoint": f"{FIXTURE}:one_class_data", "batch_size": 16}, loss, features=4)
    need = "2" if loss == "binary_cross_entropy" else "at least 2"
    with pytest.raises(ConfigError, match=rf"loss: {loss} needs {need} classes, the dataset has 1 \(label 1\)"):
        prepare(cfg)


def test_defect_22_user_torch_batchnorm_on_a_one_sample_batch_trains_and_keeps_its_statistics():
    """Defect: a user torch model with nn.BatchNorm1d crashed ('Expected more than 1 value per
    channel when training') on a rank's one-sample share of a tail batch; the catalogue's
    batchnorm normalises it with the running statistics and leaves them unchanged. So does a user's
    now; a batch of two still updates them."""
    backend, p = built("torch_batchnorm")
    before = backend.get_weights()
    assert backend.train_step(p.data.x_train[:1], p.data.y_train[:1], np.ones(1, np.float32), apply=True)
    after = backend.get_weights()
    for k in ("1.running_mean", "1.running_var"):
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    assert not np.array_equal(after["0.weight"], before["0.weight"])  # it did learn
    assert backend.model[1].training  # back in training mode for the next batch
    backend.train_step(p.data.x_train[:2], p.data.y_train[:2], np.full(2, 0.5, np.float32), apply=True)
    assert not np.array_equal(backend.get_weights()["1.running_mean"], after["1.running_mean"])
