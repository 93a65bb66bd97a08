"""The registry of backends: names only, so that the config schema, the CLI's choices and
`hvtrain doctor` can list them without importing a framework (a leaf: it imports nothing of
hvtrain). hvtrain.backends.base.get_backend imports the chosen one."""

from __future__ import annotations

# The one list of backends: name -> "module:Class"; modules are imported only when chosen.
BACKENDS = {
    "torch": "hvtrain.backends.torch.backend:TorchBackend",
    "tensorflow": "hvtrain.backends.tensorflow.backend:TensorFlowBackend",
}


# What each backend's export() writes (hvtrain export; ONNX is run by onnxruntime, whoever wrote it).
EXPORT_FORMATS = {"torch": ("onnx", "torchscript"), "tensorflow": ("onnx", "savedmodel")}


# Each backend's Horovod binding (hvtrain.runtime.horovod holds it; a backend asks it for the distributed
# optimizer, broadcasts, gradient averages and elastic state): name -> "module:Class".
HOROVOD = {
    "torch": "hvtrain.runtime.torch_horovod:TorchHorovod",
    "tensorflow": "hvtrain.runtime.tensorflow_horovod:TensorFlowHorovod",
}
