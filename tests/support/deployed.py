"""Exported artefacts loaded as a deployment loads them (onnxruntime, torch.jit, a SavedModel's
serving signature), never through hvtrain's code: what the export tests compare with."""

from __future__ import annotations


def reload(fmt: str, path: str):
    """The artefact as a deployment would load it (not through hvtrain's backend code)."""
    if fmt == "onnx":
        import onnxruntime

        s = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        assert [i.name for i in s.get_inputs()] == ["x"]
        return lambda x: s.run(None, {"x": x})[0]
    if fmt == "torchscript":
        import torch

        m = torch.jit.load(path)
        return lambda x: m(torch.from_numpy(x)).detach().numpy()
    import tensorflow as tf

    f = tf.saved_model.load(path).signatures["serving_default"]
    return lambda x: f(x=tf.constant(x))["probabilities"].numpy()
