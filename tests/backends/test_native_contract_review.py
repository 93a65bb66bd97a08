"""Issue 21 review, the native-model output contract (hvtrain.model.native, backends/*/native.py):

1. the output form was decided again on every build, on the weights loaded (evaluate, predict,
   export) and with the row-sum check beating the op that made the output: a trained per-class
   sigmoid under cross_entropy (rows summing to ~1) was evaluated and predicted as a softmax;
2. probabilities were turned back into logits as log p: saturated outputs got a wrong loss and no
   gradient (a bf16 sigmoid at z = 8: loss 16.6 instead of 8);
3. the torch probe kept every intermediate tensor alive, on 64 rows whatever the batch size;
4. predict refused a whole input over one NaN row in its first 64 ("non-finite scores ... before any
   training").
"""

from __future__ import annotations

import gc
import json
import shutil
import weakref

import numpy as np
import pytest

from hvtrain.errors import ConfigError
from hvtrain.model.native import OutputForm
from hvtrain.model.weights import INPUTS_KEY
from tests.backends.conftest import make_backend
from tests.support.configs import CANCER, DIGITS, FIXTURE, backend_of
from tests.support.configs import native_config as config

ONEHOT = {"entrypoint": f"{FIXTURE}:onehot_data", "normalize": "none", "batch_size": 32}
HEADS = {"torch": "torch_sigmoid", "tensorflow": "keras_sigmoid_head"}  # per-class sigmoids, features 10 -> 16 -> 10


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def sure_weights(backend: str, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The head as sure as long training on one-hot rows leaves it: z = 20 x - 10 (10 for the row's
    class, -10 for the others: sigmoids 0.99995 and 4.5e-5, rows summing to 1.0004)."""
    eye = np.eye(10, 16, dtype=np.float32)  # [I | 0]
    first, second = (eye.T, 20 * eye) if backend == "torch" else (eye, 20 * eye.T)  # torch [out, in]
    first, second = np.ascontiguousarray(first), np.ascontiguousarray(second)
    out = {}
    for name, w in weights.items():
        out[name] = {(16,): np.zeros(16, np.float32), (10,): np.full(10, -10, np.float32),
                     first.shape: first, second.shape: second}[w.shape]
    return out


@pytest.fixture(scope="module", params=sorted(HEADS))
def sure_run(request, tmp_path_factory):
    """A per-class sigmoid head trained one epoch under cross_entropy (its form recorded), its
    final.safetensors then holding the sure weights; the config and the run's directory."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    import hvtrain

    out = tmp_path_factory.mktemp(request.param)
    cfg = config(HEADS[request.param], ONEHOT, features=10, outputs=10)
    cfg["train"]["checkpoint_every"] = 1
    hvtrain.train(cfg, backend=request.param, output_dir=str(out), quiet=True)
    path = out / "final.safetensors"
    with safe_open(str(path), framework="numpy") as fh:
        metadata = fh.metadata()
    save_file(sure_weights(request.param, load_file(str(path))), str(path), metadata)
    return {**cfg, "backend": request.param}, out, metadata


def test_finding1_the_form_decided_in_training_travels_with_the_weights_and_checkpoints(sure_run):
    cfg, out, metadata = sure_run
    want = OutputForm(undo="sigmoid", pre=True).record()
    assert json.loads(metadata[INPUTS_KEY])["output"] == want
    from hvtrain.model.weights import read_weights

    ckpt = sorted(out.glob("ckpt-*.safetensors"))[-1]
    assert read_weights(ckpt).inputs.output == OutputForm(undo="sigmoid", pre=True)


def test_finding1_evaluate_of_a_sure_per_class_sigmoid_scores_its_sigmoid_inputs_not_a_softmax(sure_run):
    """Before: evaluate probed the sure weights, whose rows sum to ~1, and took the sigmoid for a
    softmax (val_loss 4.1e-4 = -log(p_y / sum p) instead of the cross-entropy of z, 1.9e-8)."""
    import hvtrain

    cfg, out, _ = sure_run
    e = hvtrain.evaluate(cfg, str(out / "final.safetensors"), output_dir=str(out / "eval"))
    assert e["val_loss"] == pytest.approx(float(np.log1p(9 * np.exp(-20.0))), abs=1e-7), e
    assert e["val_accuracy"] == 1.0


def test_finding1_predict_of_a_sure_per_class_sigmoid_is_the_softmax_of_its_sigmoid_inputs(sure_run):
    """Before: predict probed its input's first rows (one-hot: rows of the sure head sum to ~1) and
    returned p / sum(p): class j of a row 0.8 e_i + 0.2 e_j got 0.0025 instead of 6e-6."""
    import hvtrain

    cfg, out, _ = sure_run
    rng = np.random.default_rng(0)
    sure = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 64)]
    i, j = rng.integers(0, 10, 32), rng.integers(1, 10, 32)
    mixed = 0.8 * np.eye(10, dtype=np.float32)[i] + 0.2 * np.eye(10, dtype=np.float32)[(i + j) % 10]
    rows = np.concatenate([sure, mixed])
    got = hvtrain.predict(cfg, str(out / "final.safetensors"), rows)
    np.testing.assert_allclose(got, softmax(20.0 * rows.astype(np.float64) - 10.0), atol=1e-6)


def test_finding4_predict_of_an_entrypoint_model_with_a_nan_first_row_predicts_nan_for_it(sure_run):
    """Before: `hvtrain predict` refused the whole input (exit 2, 'non-finite scores ... 64 training
    samples, before any training'); a catalogue model predicts nan for that row and the others."""
    import hvtrain

    cfg, out, _ = sure_run
    rows = np.eye(10, dtype=np.float32)[np.arange(40) % 10]
    rows[0, 3] = np.nan
    got = hvtrain.predict(cfg, str(out / "final.safetensors"), rows)
    if cfg["backend"] == "torch":
        assert np.isnan(got[0]).all()
    else:  # TF's relu maps nan to 0 (its own op, a catalogue model's too): the row's z is -10 everywhere
        np.testing.assert_allclose(got[0], 0.1, atol=1e-6)
    np.testing.assert_allclose(got[1:], softmax(20.0 * rows[1:].astype(np.float64) - 10.0), atol=1e-6)


def test_finding1_a_resume_keeps_the_recorded_form(sure_run, tmp_path):
    """A resume builds from the seeded weights and takes the form its checkpoint recorded (one
    more epoch from the first one's checkpoint, the same form in the new final.safetensors)."""
    import hvtrain
    from hvtrain.model.weights import read_weights

    cfg, out, _ = sure_run
    cfg = json.loads(json.dumps(cfg))
    cfg["train"]["epochs"] = 2
    run = tmp_path / "run"
    shutil.copytree(out, run)
    s = hvtrain.train(cfg, output_dir=str(run), quiet=True, resume="auto")
    assert s["resumed_from"] and s["steps"] > 0
    assert read_weights(run / "final.safetensors").inputs.output == OutputForm(undo="sigmoid", pre=True)


def test_finding1_a_known_op_decides_over_the_row_sums_and_the_record_is_reused_as_it_is():
    """The builds themselves: the sure weights (rows summing to 1.0004) stay a sigmoid when decided
    again (a file without a record); a record is reused; a record the model contradicts is refused."""
    backend, p = make_backend("torch", config("torch_sigmoid", ONEHOT, features=10, outputs=10))
    sure = sure_weights("torch", backend.get_weights())
    again, _ = make_backend("torch", config("torch_sigmoid", ONEHOT, features=10, outputs=10), weights=sure)
    assert again.output_form().undo == "sigmoid"
    assert again.output_form() == OutputForm(undo="sigmoid", pre=True)
    from hvtrain.backends.torch.native import returned
    from hvtrain.model.native import decide_form

    x = p.data.train.features(np.arange(16))
    got = returned(p.cfg, backend.model, x, backend.device)
    with pytest.raises(ConfigError, match=r"model.entrypoint: .*trained on logits .*now returns a final sigmoid's input"):
        decide_form(p.cfg, got, 16, 10, OutputForm(), training=False)


# --------------------------------------------------------------------------- 2: saturated outputs


def _saturate(backend, big: float, classes: int) -> None:
    """The head's last layer set to output the constant logits [big, 0, ...] (one: [big])."""
    bias = np.zeros(classes, np.float32)
    bias[0] = big
    if backend.name == "torch":
        import torch

        last = [m for m in backend.model.modules() if isinstance(m, torch.nn.Linear)][-1]
        with torch.no_grad():
            last.weight.zero_()
            last.bias.copy_(torch.from_numpy(bias))
    else:
        last = backend.model.layers[-1]
        last.kernel.assign(np.zeros(last.kernel.shape, np.float32))
        last.bias.assign(bias)


def _bias_grad(backend) -> np.ndarray:
    """The last layer's bias gradient after one train_step(apply=False)."""
    if backend.name == "torch":
        import torch

        last = [m for m in backend.model.modules() if isinstance(m, torch.nn.Linear)][-1]
        return last.bias.grad.double().numpy()
    index = [i for i, v in enumerate(backend.train_vars) if v is backend.model.layers[-1].bias][0]
    return np.asarray(backend.accum[index].numpy(), np.float64)


@pytest.mark.parametrize("model, data, loss, big, label, exact, overrides", [
    ("torch_sigmoid", CANCER, "binary_cross_entropy", 20.0, 0, 20.0 + np.log1p(np.exp(-20.0)), ()),
    ("keras_sigmoid_head", CANCER, "binary_cross_entropy", 20.0, 0, 20.0 + np.log1p(np.exp(-20.0)), ()),
    ("torch_softmax", DIGITS, "cross_entropy", 120.0, 1, 120.0, ()),
    ("keras_softmax_head", DIGITS, "cross_entropy", 120.0, 1, 120.0, ()),
    ("torch_sigmoid", CANCER, "binary_cross_entropy", 8.0, 0, 8.0 + np.log1p(np.exp(-8.0)), ("train.precision=bf16",)),
], ids=["torch-sigmoid-z20", "keras-sigmoid-z20", "torch-softmax-gap120", "keras-softmax-gap120",
        "torch-sigmoid-z8-bf16"])
def test_finding2_a_saturated_head_gets_the_exact_loss_and_a_gradient(model, data, loss, big, label, exact,
                                                                      overrides):
    """Before: log p of the clipped probabilities: 16.6 for a sigmoid at z = 20 (fp32) or z = 8
    (bf16 rounds p to 1), 87.3 for a softmax 120 behind, and a zero gradient: stuck for good.
    Now the activation's input is trained on; predict gives it as the logits."""
    kwargs = {"features": 30} if data is CANCER else {}
    backend, p = make_backend(backend_of(model), config(model, data, loss, **kwargs), *overrides)
    classes = 1 if loss == "binary_cross_entropy" else 10
    _saturate(backend, big, classes)
    x = p.data.train.features(np.arange(4)).astype(np.float32)
    y = np.full(4, label, np.int64)
    backend.loss_sum(reset=True)
    assert backend.train_step(x, y, np.full(4, 0.25, np.float32), apply=False)
    assert backend.loss_sum(reset=True) == pytest.approx(exact, rel=2e-3 if overrides else 1e-6)
    grad = _bias_grad(backend)
    assert np.abs(grad).max() == pytest.approx(1.0, rel=1e-2), grad  # d loss / d z of the wrong class: ~1
    logits = backend.predict(x)
    assert logits[0, 0] == pytest.approx(big, rel=1e-2 if overrides else 1e-6)
    assert backend.output_form().pre


def test_finding2_probabilities_known_only_by_their_rows_are_refused_under_bf16():
    """A hand-written softmax (no op to read the input of) can only be undone as log p, which bf16
    rounding makes wrong: refused in one line at model.entrypoint; trained as log p in fp32."""
    with pytest.raises(ConfigError, match=r"model.entrypoint: .* final softmax .*under train.precision bf16"):
        make_backend("torch", config("torch_manual_softmax"), "train.precision=bf16")
    backend, _ = make_backend("torch", config("torch_manual_softmax"))
    assert backend.output_form() == OutputForm(undo="softmax", pre=False)


# --------------------------------------------------------------------------- 3: the probe's memory


def test_finding3_the_torch_probe_keeps_no_intermediate_tensor_alive():
    """Before: the op recorder held every tensor of the probe's forward (a forward needing 483 MiB
    under no_grad peaked at 3364 MiB). Counted here: the hidden layers' outputs still alive when
    the last layer runs."""
    import torch

    from hvtrain.backends.torch.native import returned
    from tests.fixtures.user_models import torch_deep

    _, p = make_backend("torch", config("torch_softmax"))
    model = torch_deep(depth=8)
    outputs: list[weakref.ref] = []
    alive: list[int] = []
    hidden = [m for m in model if isinstance(m, torch.nn.ReLU)]
    for m in hidden:
        m.register_forward_hook(lambda mod, args, out: outputs.append(weakref.ref(out)))
    model[-1].register_forward_hook(lambda mod, args, out: alive.append(sum(r() is not None for r in outputs)))
    got = returned(p.cfg, model, p.data.train.features(np.arange(8)), torch.device("cpu"))
    gc.collect()
    assert got.activation == "softmax" and len(outputs) == len(hidden) == 9
    assert alive == [0], alive  # under no_grad each is freed once the next layer has it


def test_finding3_the_probe_batch_is_no_larger_than_a_batch():
    """Before: 64 rows whatever data.batch_size: a model sized for batch 8 ran out of memory at build."""
    from hvtrain.model.native import probe_batch
    from hvtrain.runtime.experiment import prepare
    from hvtrain.runtime.session import build_native

    p = prepare(config("torch_softmax", {**DIGITS, "batch_size": 8}))
    assert len(probe_batch(p.data)) == 64 and len(probe_batch(p.data, 8)) == 8

    class Recorder:
        def build(self, cfg, spec, weights, num_outputs, runtime, example=None, form=None):
            self.example = example

        def native_inputs(self):
            from hvtrain.model.native import NativeInputs

            return NativeInputs()

    backend = Recorder()
    build_native(p.cfg, backend, None, None, p.data, None)
    assert backend.example.shape == (8, 64)


def test_finding1_a_resume_whose_checkpoint_recorded_another_form_is_refused_in_one_line(tmp_path):
    """A checkpoint trained its loss on one form; a build that takes another (the model's code
    changed) would continue on another loss: refused at model.entrypoint before any step."""
    from hvtrain.config.load import load_config
    from hvtrain.io.reporter import Reporter
    from hvtrain.training.checkpoint import CheckpointManager
    from tests.support.one_rank import LOOP, FakeRuntime

    cfg = load_config({**LOOP, "output_dir": str(tmp_path)})
    rt = FakeRuntime()
    reporter = Reporter(rt.info, tmp_path, quiet=True)

    def manager(form: OutputForm) -> CheckpointManager:
        return CheckpointManager(cfg, rt, reporter, None, {"output": form.record()})

    first = manager(OutputForm(undo="sigmoid", pre=True))
    first.start(None, "model", 1)
    first.save({"epoch": 1, "step": 5, "offset": 0, "loss_sum": 0.0, "epoch_steps": 5}, "model", True,
               {"w": np.zeros(2, np.float32)}, 1)
    assert manager(OutputForm(undo="sigmoid", pre=True)).start("auto", "model", 1) is not None
    with pytest.raises(ConfigError, match=r"model.entrypoint: .*ckpt-.* was trained on a final sigmoid's input .*"
                                          r"this build takes a final softmax's probabilities"):
        manager(OutputForm(undo="softmax")).start("auto", "model", 1)


def test_a_sure_single_sigmoid_is_not_taken_for_a_softmax_over_one_output():
    """Cold review: a Keras Dense(1, sigmoid) whose probe rows all round to p = 1.0 in float32
    (z > 16.6) was classed a softmax (log p = 0 = log_softmax exactly): evaluate/predict/export of
    its confident rows were refused against the recorded sigmoid, and such a head at build
    refused as a softmax over one output. A one-output softmax (p = 1 at any z) still is one."""
    from hvtrain.backends.tensorflow.native import _sigmoid_or_softmax

    z = np.full((4, 1), 20.0)
    p = np.asarray(1 / (1 + np.exp(-z)), np.float32).astype(np.float64)
    assert _sigmoid_or_softmax(z, p) == "sigmoid"
    assert _sigmoid_or_softmax(np.full((4, 1), 0.3), np.ones((4, 1))) == "softmax"
