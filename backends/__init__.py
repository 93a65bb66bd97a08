"""The framework backends, installed as hvtrain.backends: the Backend interface (base), the loop's
step seam (steps), a pipeline stage's interface (stage), the registry of names (a leaf), and the
mirrored implementations torch/ and tensorflow/."""
