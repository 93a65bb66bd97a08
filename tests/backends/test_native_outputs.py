"""The native-model output contract's ways to the scores (issue 23): a tensor, a mapping's
'logits' (an HF-style output object), a tuple's first value, or what model.output_key names;
models written as their libraries' docs write them (tests.fixtures.user_models). What is not
there is refused at model.output_key in one line before any step."""

from __future__ import annotations

import numpy as np
import pytest

from hvtrain.errors import ConfigError
from tests.backends.conftest import make_backend
from tests.backends.test_defects_models import exported, fit
from tests.support.configs import DIGITS, backend_of
from tests.support.configs import native_config as config


def built(model: str, output_key=None, **kwargs):
    cfg = config(model, DIGITS, "cross_entropy", 0.003, **kwargs)
    if output_key is not None:
        cfg["model"]["output_key"] = output_key
    return make_backend(backend_of(model), cfg)


def own_scores(backend, x: np.ndarray, pick) -> np.ndarray:
    """The user's model itself on `x` (inference), the value `pick` takes from its output."""
    if backend.name == "torch":
        import torch

        backend.model.eval()
        try:
            with torch.no_grad():
                out = pick(backend.model(torch.from_numpy(x)))
        finally:
            backend.model.train()
        return out.double().numpy()
    return np.asarray(pick(backend.model(x, training=False)), np.float64)


@pytest.mark.parametrize(("model", "key", "kwargs", "pick", "where"), [
    ("torch_tuple", None, {}, lambda o: o[0], 0),
    ("keras_subclassed_tuple", None, {}, lambda o: o[0], 0),
    ("torch_resnet_output", None, {}, lambda o: o.logits, "logits"),
    ("torch_dict_logits", "scores", {"key": "scores"}, lambda o: o["scores"], "scores"),
    # a tensor in eval mode (the probe), (logits, aux) in training: crashed in the first step before
    ("torch_aux_in_training", None, {}, lambda o: o, None),
])
def test_the_scores_are_read_where_the_contract_says_and_predict_and_export_agree(model, key, kwargs, pick, where,
                                                                                  tmp_path):
    backend, p = built(model, key, **kwargs)
    assert backend.output_form().key == where
    fit(backend, p, 4)
    x = p.data.x_val
    logits = own_scores(backend, x, pick)
    np.testing.assert_allclose(backend.predict(x), logits, rtol=1e-5, atol=1e-5)
    assert np.mean(logits.argmax(axis=1) == p.data.y_val) > 0.85
    proba = np.exp(logits - logits.max(axis=1, keepdims=True))
    proba /= proba.sum(axis=1, keepdims=True)  # the export graphs end in the softmax the loss applied
    np.testing.assert_allclose(exported(backend, p, tmp_path), proba, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("model", "key", "kwargs", "message"), [
    ("torch_tuple", "logits", {}, r"model\.output_key: 'logits' names a mapping entry; .* returns a tuple/list of 2 "
                                  r"values: give the index of the scores"),
    ("torch_tuple", 2, {}, r"model\.output_key: .* returns a tuple/list of 2 values; there is no value 2"),
    ("torch_tuple", 1, {}, r"model\.entrypoint: .* outputs 48 values per sample"),
    ("torch_dict_logits", 0, {}, r"model\.output_key: 0 is a tuple index; .* returns a mapping with keys \['logits'\]"),
    ("torch_dict_logits", "scores", {}, r"model\.output_key: .* returns a mapping with keys \['logits'\]; hvtrain "
                                        r"reads the scores from its 'scores' entry: name one of them"),
    ("torch_softmax", "logits", {}, r"model\.output_key: 'logits': .* returns a tensor, which has no entries"),
])
def test_an_output_key_that_finds_no_scores_is_one_located_line(model, key, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        built(model, key, **kwargs)


def test_the_chosen_value_travels_in_the_inputs_record():
    """evaluate/predict/export of saved weights reuse the value training read (the record); a
    record naming no place a form can have is refused."""
    from hvtrain.model.native import OutputForm

    for form in (OutputForm(0), OutputForm(2, flat=True), OutputForm("scores", undo="softmax")):
        assert OutputForm.from_record(form.record()) == form
    for key in (-1, True, 1.5, ["logits"]):
        with pytest.raises(ValueError):
            OutputForm.from_record({"key": key, "flat": False, "undo": None, "pre": False})
    assert OutputForm(0).note("m:f") == "model.entrypoint m:f: trained on value 0 of its tuple"
