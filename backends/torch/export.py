"""Exported torch models: the model behind the raw-row normalisation and predict's output
activation, as ONNX (torch.onnx's dynamo exporter: torch.export, then onnxscript) or TorchScript
(torch.jit.trace), and TorchScript reloaded for the verification (ONNX is run by onnxruntime in
hvtrain.tools.export)."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import warnings
from collections.abc import Callable

import numpy as np
import torch

from hvtrain.model.native import PLAIN, OutputForm
from hvtrain.model.weights import Inputs, export_dtypes

from .native import reading, scores

OPSET = 18  # torch.onnx's dynamo exporter's default


class _Served(torch.nn.Module):
    """Raw rows -> (x - shift) / scale (training statistics; in float32, or in float64 then cast
    to float32 where float32 would lose raw values far from zero: hvtrain.model.weights.export_dtypes)
    -> model input shape ->
    model -> softmax (cross_entropy) / sigmoid (binary_cross_entropy) / as is (regression; in the
    targets' units: * scale + shift when they were normalised)."""

    def __init__(self, model: torch.nn.Module, inputs: Inputs, form: OutputForm = PLAIN) -> None:
        super().__init__()
        t = inputs.transform
        self.model, self.form = model, form
        _, normalise_in = export_dtypes(inputs)
        self.normalise, self.precise = normalise_in is not None, normalise_in == np.float64
        if self.normalise:
            self.register_buffer("shift", torch.from_numpy(np.asarray(t.shift, normalise_in).copy()))
            self.register_buffer("scale", torch.from_numpy(np.asarray(t.scale, normalise_in).copy()))
        self.width = math.prod(inputs.features)
        self.shape = tuple(t.shape) if t.shape is not None else tuple(inputs.features)
        self.activation = {"cross_entropy": "softmax", "binary_cross_entropy": "sigmoid"}.get(inputs.loss, "none")
        self.denormalise = inputs.target is not None and self.activation == "none"
        if self.denormalise:  # a forecaster trained on normalised targets answers in the series' units
            self.register_buffer("target", torch.tensor(inputs.target, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.precise:
            x = ((x.reshape(-1, self.width).double() - self.shift) / self.scale).float()
        elif self.normalise:
            x = (x.reshape(-1, self.width) - self.shift) / self.scale
        seen = reading(self.form)
        with seen or contextlib.nullcontext():
            out = self.model(x.reshape((-1,) + self.shape))
        out = scores(self.form, out, seen)  # logits, as training saw them
        if self.activation == "softmax":
            return torch.softmax(out, dim=1)
        if self.activation == "sigmoid":
            return torch.sigmoid(out)
        if self.denormalise:
            return out * self.target[1] + self.target[0]
        return out


def export(model: torch.nn.Module, fmt: str, path: str, inputs: Inputs, form: OutputForm = PLAIN) -> None:
    """Write `model` (not changed: a CPU copy in eval mode is exported) as `fmt` to `path`; `form`
    (hvtrain.model.native) turns an entrypoint model's output into the logits the activation is applied to
    (the input of its final activation where the form reads it, as training did)."""
    served = _Served(copy.deepcopy(model).cpu().float().eval(), inputs, form).eval()
    dtype = torch.from_numpy(np.zeros(0, export_dtypes(inputs)[0])).dtype
    example = torch.zeros((2,) + tuple(inputs.features), dtype=dtype)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporters' deprecation and tracer notes
        if fmt == "torchscript":
            torch.jit.save(torch.jit.trace(served, (example,)), path)
        elif fmt == "onnx":
            output = "outputs" if served.activation == "none" else "probabilities"
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed"
            with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
                torch.onnx.export(served, (example,), path, dynamo=True, external_data=False, opset_version=OPSET,
                                  input_names=["x"], output_names=[output],
                                  dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
        else:
            raise ValueError(f"torch exports onnx or torchscript, got {fmt!r}")


def load(fmt: str, path: str) -> Callable[[np.ndarray], np.ndarray]:
    """A TorchScript artefact reloaded, as a function of raw rows."""
    if fmt != "torchscript":
        raise ValueError(f"torch reloads torchscript, got {fmt!r}")
    module = torch.jit.load(path, map_location="cpu").eval()

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(np.ascontiguousarray(x))).numpy()

    return run
