"""Keras 3 fixes to an installed Horovod 0.28.1's TensorFlow binding (issue 25, horovod#4290).

Horovod 0.28.1 was written for Keras 2, whose variables were tf.Variables and whose optimizers
had `variables()` (a method) and `_compute_gradients`. Under TensorFlow >= 2.16, `tf.keras` is
Keras 3: its variables wrap a tf.Variable (`.value`) and have no `ref()`, optimizer variables are
a list property, and BatchNormalization has no `fused` argument and a new `_moments(inputs, mask)`.
So a hand-written Horovod TF2 loop failed in DistributedGradientTape's local sources, the Keras
DistributedOptimizer, the broadcast callback and the elastic Keras state.

The edits, each checked (the script fails when one does not apply) and idempotent:
  1. horovod/tensorflow/__init__.py imports horovod/tensorflow/hvtrain_keras3.py (this file's
     KERAS3 module text), whose install() gives Keras 3 variables TF's `ref()` (the reference of
     the tf.Variable they wrap: the same variable whichever of the two a caller hands over), so
     register_local_source / register_local_var, PartialDistributedGradientTape and every
     `.ref()`-keyed map in Horovod take Keras variables.
  2. SyncBatchNormalization: no `fused` passed to Keras 3 (which has only the unfused path),
     `_moments` takes Keras 3's arguments, and `call` names its input and `training` (Keras 3
     builds a layer from the shape of the argument it finds by name); the statistics are
     allreduced as before.
  3. broadcast_variables and the gradients' allreduce take Keras 3 variables (as the tf.Variables they wrap: a tf.function
     took a Keras variable for a tensor it could not assign).
  4. `optimizer.variables()` -> hvtrain_keras3.optimizer_variables(optimizer) (a method in Keras
     2, a list in Keras 3): the broadcast callback, TensorFlowKerasState's save/restore/sync,
     and the DistributedOptimizer's `variables`.
  5. BroadcastGlobalVariablesCallback's local_variables accepts Keras variables.
  6. The learning-rate callbacks (warmup, schedule) read and set Keras 3's learning_rate
     (Keras 3 has no backend.get_value nor optimizer.lr); momentum correction is skipped there
     with a warning (Keras 3 traces a float momentum into its update); MetricAverageCallback
     averages with tf.constant (Keras 3 has no backend.constant).
  7. The Keras DistributedOptimizer under Keras 3: `apply` (what Keras 3's apply_gradients,
     model.fit and LossScaleOptimizer call) allreduces the gradients unless they are
     compute_gradients' own result (recognised by identity, not by a flag a lone
     compute_gradients could leave set), accumulates them first with backward_passes_per_step > 1
     and updates on aggregation steps only; compute_gradients differentiates the tf.Variables;
     apply_gradients drops Keras 2's experimental_aggregate_gradients; the wrapped class keeps the
     optimizer's module, so a saved model loads without Horovod.
  8. SyncBatchNormalization under Keras 3 passes a mask on and is never jit-compiled (Horovod's
     allreduce has no XLA kernel). Whether tf.keras is Keras 3 is read from tf.keras itself
     (TF_USE_LEGACY_KERAS makes it Keras 2 beside a Keras 3 `keras`).

  9. Keras 3's LossScaleOptimizer around Horovod's DistributedOptimizer (what compile makes under
     mixed_float16) steps only where the gradients are finite on every rank (patch 3): each rank
     decided on its own, and one that overflowed skipped the allreduce the others waited in.

Not covered (known): tf_keras's LossScaleOptimizer (TF_USE_LEGACY_KERAS) keeps its per-rank check;
Keras 3's auto jit_compile on GPUs meets
Horovod's ops in model.fit (compile with jit_compile=False); `groups=` of Keras variables in a
graph-built tape; a DistributedGradientTape's gradients given to a DistributedOptimizer are
reduced twice (use one of the two, as Horovod's examples do).

The module is written last: its presence (with an edit checked by hvtrain's keras3_patch) means
every edit is in.

Usage: python scripts/horovod_keras3.py   (with the venv's python; setup runs it after the build)
"""

from __future__ import annotations

import sys
from pathlib import Path

PATCH = 3  # hvtrain doctor reads this from the installed module (bumped whenever an edit changes)

KERAS3 = '''"""hvtrain's Keras 3 compatibility for Horovod 0.28.1 (scripts/horovod_keras3.py wrote this file)."""

PATCH = {patch}


def install():
    """Keras 3 variables get TF's ref() (the reference of the tf.Variable they wrap); Keras 3's
    LossScaleOptimizer around Horovod's agrees over the ranks whether the gradients are finite."""
    try:
        import keras
    except ImportError:
        return
    variable = getattr(keras, "Variable", None)
    if variable is not None and not hasattr(variable, "ref") and hasattr(variable, "value"):
        variable.ref = lambda self: self.value.ref()
    scaler = getattr(getattr(keras, "optimizers", None), "LossScaleOptimizer", None)
    check = getattr(scaler, "check_finite", None)
    if check is not None and not getattr(check, "hvtrain", False):
        scaler.check_finite = _agreed_check_finite(check)


def _agreed_check_finite(local_check):
    """LossScaleOptimizer.check_finite where the inner optimizer is Horovod's (what compile makes of
    it under mixed_float16): finite only if the gradients are finite on every rank. On its own, a
    rank that overflowed skipped the step while the others allreduced in theirs: they waited on it,
    or the ranks fell apart."""
    def check_finite(self, grads):
        finite = local_check(self, grads)
        if not hasattr(self.inner_optimizer, "_allreduce_grads"):  # not a Horovod DistributedOptimizer
            return finite
        import horovod.tensorflow as hvd
        import tensorflow as tf

        # over the optimizer's process set, as its gradients are; no shortcut on the size, which a
        # traced step would keep after an elastic world grew (Horovod's own reduction checks it at run time)
        process_set = getattr(self.inner_optimizer, "process_set", hvd.global_process_set)
        if not process_set.included():
            return finite
        return hvd.allreduce(tf.cast(finite, tf.int32), op=hvd.Min, name="hvtrain.loss_scale.finite",
                             process_set=process_set) > 0

    check_finite.hvtrain = True
    return check_finite


def optimizer_variables(optimizer):
    """An optimizer's variables: a method in Keras 2, a list (property) in Keras 3."""
    got = optimizer.variables
    return list(got() if callable(got) else got)


def is_variable(value):
    """A tf.Variable or a Keras 3 variable (which wraps one)."""
    import tensorflow as tf

    try:
        import keras

        keras_variable = getattr(keras, "Variable", ())
    except ImportError:
        keras_variable = ()
    return isinstance(value, tf.Variable) or (bool(keras_variable) and isinstance(value, keras_variable))


def tf_variables(variables):
    """Keras 3 variables as the tf.Variables they wrap (a tf.function takes a Keras variable for
    a tensor, not a variable it can assign); anything else as it is."""
    try:
        import keras

        keras_variable = getattr(keras, "Variable", None)
    except ImportError:
        keras_variable = None
    return [v.value if keras_variable is not None and isinstance(v, keras_variable) else v for v in variables]


def get_value(backend, optimizer, name):
    """An optimizer hyperparameter ('lr' or 'momentum') as a float: Keras 2's backend.get_value,
    or Keras 3's attribute (learning_rate a variable, momentum a float)."""
    if not keras3():
        return backend.get_value(getattr(optimizer, name))
    import numpy as np

    return float(np.asarray(getattr(optimizer, "learning_rate" if name == "lr" else name)))


def set_value(backend, optimizer, name, value):
    """Set an optimizer hyperparameter. Keras 3 reads a float momentum when it traces its update:
    changing it later would change nothing, so momentum correction is skipped (with a warning)."""
    if not keras3():
        return backend.set_value(getattr(optimizer, name), value)
    attr = "learning_rate" if name == "lr" else name
    current = getattr(optimizer, attr)
    if hasattr(current, "assign"):
        current.assign(value)
    elif name == "momentum":
        global _WARNED
        if not _WARNED:
            import warnings

            warnings.warn("Horovod's momentum correction is skipped under Keras 3: its optimizers read a float "
                          "momentum once, when the update is traced")
            _WARNED = True
    else:
        setattr(optimizer, attr, value)


_WARNED = False


def gated_apply(counter, optimizer, apply):
    """Keras 3 with backward_passes_per_step > 1: `apply()` (the update, which counts an iteration)
    when the aggregation helper's `counter` is back at 0 (its accumulated gradients were just
    allreduced), else only the iteration counted, as Keras 2's helper did."""
    import tensorflow as tf

    def update():
        apply()
        return tf.identity(optimizer.iterations)

    def skip():
        optimizer.iterations.assign_add(1)
        return tf.identity(optimizer.iterations)

    return tf.cond(tf.equal(counter, 0), update, skip)


def keras3():
    """Whether tf.keras (what Horovod's Keras classes subclass) is Keras 3: with TF_USE_LEGACY_KERAS
    and tf_keras it is Keras 2 even where `import keras` gives Keras 3."""
    import tensorflow as tf

    return tf.keras.layers.BatchNormalization.__module__.startswith("keras.src")
'''.format(patch=PATCH)

# (file under horovod/, old text, new text): each old text must occur exactly once
EDITS = [
    ("tensorflow/__init__.py",
     "from horovod.tensorflow.functions import ",
     "from horovod.tensorflow.hvtrain_keras3 import install as _hvtrain_keras3  # hvtrain's patch\n"
     "_hvtrain_keras3()\n"
     "from horovod.tensorflow.functions import "),
    ("tensorflow/__init__.py",
     "    if _executing_eagerly():\n        return _make_subgraph(allreduce_grads)\n",
     "    if _executing_eagerly():\n"
     "        compiled = _make_subgraph(allreduce_grads)\n\n"
     "        def allreduce_grads_of_variables(grads, vars=None, use_generic_names=False):\n"
     "            # hvtrain's patch: Keras 3 variables as their tf.Variables (a tf.function traces a\n"
     "            # Keras variable as a tensor, reading its value)\n"
     "            from horovod.tensorflow.hvtrain_keras3 import tf_variables\n"
     "            return compiled(grads, None if vars is None else tf_variables(vars), use_generic_names)\n\n"
     "        return allreduce_grads_of_variables\n"),
    ("tensorflow/sync_batch_norm.py",
     "    super(SyncBatchNormalization, self).__init__(fused=fused, **kwargs)\n\n"
     "  def _moments(self, inputs, reduction_axes, keep_dims, **kwargs):\n"
     "    \"\"\"Compute the mean and variance: it overrides the original _moments.\"\"\"\n"
     "    worker_mean, worker_variance = super(SyncBatchNormalization, self)._moments(\n"
     "      inputs, reduction_axes, keep_dims=keep_dims, **kwargs)\n",
     "    from horovod.tensorflow.hvtrain_keras3 import keras3  # hvtrain's patch: Keras 3 has no fused argument\n"
     "    if keras3():\n"
     "      super(SyncBatchNormalization, self).__init__(**kwargs)\n"
     "      self.supports_jit = False  # Horovod's allreduce has no XLA kernel (Keras 3 jit-compiles on GPUs)\n"
     "    else:\n"
     "      super(SyncBatchNormalization, self).__init__(fused=fused, **kwargs)\n\n"
     "  def _moments(self, inputs, *args, **kwargs):\n"
     "    \"\"\"Compute the mean and variance: it overrides the original _moments (Keras 2's\n"
     "    (inputs, reduction_axes, keep_dims) or Keras 3's (inputs, mask)).\"\"\"\n"
     "    worker_mean, worker_variance = super(SyncBatchNormalization, self)._moments(\n"
     "      inputs, *args, **kwargs)\n"),
    ("tensorflow/functions.py",
     "        inplace: whether to perform in-place broadcasts\n    \"\"\"\n",
     "        inplace: whether to perform in-place broadcasts\n    \"\"\"\n"
     "    from horovod.tensorflow.hvtrain_keras3 import tf_variables  # hvtrain's patch: Keras 3 variables\n"
     "    variables = tf_variables(variables)\n"),
    ("tensorflow/sync_batch_norm.py",
     "  def call(self, *args, **kwargs):\n    outputs = super(SyncBatchNormalization, self).call(*args, **kwargs)\n",
     "  def call(self, inputs, training=None, mask=None, **kwargs):  # hvtrain's patch: Keras 3 finds the\n"
     "    if mask is not None:  # input, training and mask by name\n"
     "      kwargs['mask'] = mask\n"
     "    outputs = super(SyncBatchNormalization, self).call(inputs, training=training, **kwargs)\n"),
    ("_keras/callbacks.py",
     "                hvd.broadcast_variables(self.model.optimizer.variables(),",
     "                from horovod.tensorflow.hvtrain_keras3 import optimizer_variables  # hvtrain's patch\n"
     "                hvd.broadcast_variables(optimizer_variables(self.model.optimizer),"),
    ("tensorflow/keras/callbacks.py",
     "        elif not all(isinstance(var, tf.Variable) for var in local_variables):",
     "        elif not all(__import__('horovod.tensorflow.hvtrain_keras3', fromlist=['is_variable']).is_variable(var)\n"
     "                     for var in local_variables):  # hvtrain's patch: Keras 3 variables too"),
    ("tensorflow/keras/callbacks.py",
     "        elif isinstance(local_variables, tf.Variable):",
     "        elif __import__('horovod.tensorflow.hvtrain_keras3', fromlist=['is_variable']).is_variable(local_variables):"),
    ("tensorflow/elastic.py",
     "        broadcast_variables(optimizer.variables(), root_rank=0)",
     "        broadcast_variables(optimizer_variables(optimizer), root_rank=0)"),
    ("tensorflow/elastic.py",
     "            self._saved_optimizer_state = [tf.identity(var) for var in self.optimizer.variables()]",
     "            self._saved_optimizer_state = [tf.identity(var) for var in optimizer_variables(self.optimizer)]"),
    ("tensorflow/elastic.py",
     "            self._saved_optimizer_state = [var.numpy() for var in self.optimizer.variables()] if _IS_TF2",
     "            self._saved_optimizer_state = [var.numpy() for var in optimizer_variables(self.optimizer)] if _IS_TF2"),
    ("tensorflow/elastic.py",
     "            for var, saved_var in zip(self.optimizer.variables(), self._saved_optimizer_state):",
     "            for var, saved_var in zip(optimizer_variables(self.optimizer), self._saved_optimizer_state):"),
    ("tensorflow/elastic.py",
     "from horovod.tensorflow.functions import broadcast_object, broadcast_object_fn, broadcast_variables\n",
     "from horovod.tensorflow.functions import broadcast_object, broadcast_object_fn, broadcast_variables\n"
     "from horovod.tensorflow.hvtrain_keras3 import optimizer_variables  # hvtrain's patch\n"),
    ("_keras/__init__.py",
     "                return CallableList(super(self.__class__, self).variables())",
     "                from horovod.tensorflow.hvtrain_keras3 import optimizer_variables  # hvtrain's patch\n"
     "                return CallableList(optimizer_variables(super(self.__class__, self)))"),
    ("_keras/__init__.py",
     "            allreduced_grads = self._allreduce(grads, weights)\n"
     "            return list(zip(allreduced_grads, weights))\n",
     "            allreduced_grads = self._allreduce(grads, weights)\n"
     "            self._hvtrain_reduced = list(allreduced_grads)  # hvtrain's patch: apply() need not reduce them\n"
     "            return list(zip(allreduced_grads, weights))\n"),
    ("_keras/__init__.py",
     "    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),\n"
     "               dict(_DistributedOptimizer.__dict__))\n",
     "    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),\n"
     "               dict(_DistributedOptimizer.__dict__))\n"
     "    cls.__module__ = optimizer.__class__.__module__  # hvtrain's patch: a saved model loads without Horovod\n"),
    ("_keras/__init__.py",
     "            elif hasattr(base_class, '_aggregate_gradients'):\n"
     "                return base_class._aggregate_gradients(grads_and_vars)\n",
     "            elif hasattr(base_class, '_aggregate_gradients'):\n"
     "                return base_class._aggregate_gradients(grads_and_vars)\n"
     "            elif not hasattr(base_class, 'aggregate_gradients'):  # hvtrain's patch: Keras 3 aggregates\n"
     "                return [g for g, _ in grads_and_vars]  # nothing outside tf.distribute\n"),
    ("_keras/__init__.py",
     "        def apply_gradients(self, *args, **kwargs):\n",
     "        def apply(self, grads, trainable_variables=None):\n"
     "            \"\"\"hvtrain's patch (Keras 3): apply_gradients, model.fit and LossScaleOptimizer call\n"
     "            apply(grads, variables). The gradients are allreduced here (accumulated first when\n"
     "            backward_passes_per_step > 1) unless they are compute_gradients' own result, and the\n"
     "            update runs on aggregation steps only.\"\"\"\n"
     "            base = super(self.__class__, self)\n"
     "            if trainable_variables is None:\n"
     "                trainable_variables = self._trainable_variables\n"
     "            grads, trainable_variables = list(grads), list(trainable_variables)\n"
     "            reduced = getattr(self, '_hvtrain_reduced', ())  # compute_gradients' result, by identity\n"
     "            self._hvtrain_reduced = ()\n"
     "            if not any(g is not None for g in grads) or \\\n"
     "                    not all(any(g is r for r in reduced) for g in grads if g is not None):\n"
     "                grads = list(self._allreduce(grads, trainable_variables))\n"
     "            self._aggregated_gradients = False\n"
     "            if self._agg_helper is None:\n"
     "                return base.apply(grads, trainable_variables)\n"
     "            from horovod.tensorflow.hvtrain_keras3 import gated_apply\n"
     "            return gated_apply(self._agg_helper.counter, self, lambda: base.apply(grads, trainable_variables))\n\n"
     "        def apply_gradients(self, *args, **kwargs):\n"
     "            if not hasattr(super(self.__class__, self), '_compute_gradients'):  # hvtrain's patch: Keras 3\n"
     "                kwargs.pop('experimental_aggregate_gradients', None)  # has no such argument (Keras 2's);\n"
     "                return super(self.__class__, self).apply_gradients(*args, **kwargs)  # it calls apply()\n"),
    ("_keras/__init__.py",
     "            tape = tf.GradientTape() if tape is None else tape\n"
     "            if hasattr(base_class, '_compute_gradients'):",
     "            tape = tf.GradientTape() if tape is None else tape\n"
     "            if not hasattr(base_class, '_compute_gradients') and not hasattr(base_class, 'compute_gradients'):\n"
     "                # hvtrain's patch: Keras 3 optimizers compute no gradients; the tape does\n"
     "                from horovod.tensorflow.hvtrain_keras3 import tf_variables\n"
     "                var_list = list(var_list)\n"
     "                if callable(loss):\n"
     "                    with tape:\n"
     "                        tape.watch(tf_variables(var_list))\n"
     "                        loss = loss()\n"
     "                grads_and_vars = list(zip(tape.gradient(loss, tf_variables(var_list), grad_loss), var_list))\n"
     "            elif hasattr(base_class, '_compute_gradients'):"),
]
# the learning-rate callbacks: Keras 3 has no backend.get_value/set_value nor optimizer.lr
_KV = "__import__('horovod.tensorflow.hvtrain_keras3', fromlist=['get_value'])"
EDITS += [
    ("_keras/callbacks.py", "self.backend.get_value(self.model.optimizer.lr)",
     f"{_KV}.get_value(self.backend, self.model.optimizer, 'lr')", 4),
    ("_keras/callbacks.py", "self.backend.set_value(self.model.optimizer.lr, new_lr)",
     f"{_KV}.set_value(self.backend, self.model.optimizer, 'lr', new_lr)"),
    ("_keras/callbacks.py", "self.backend.get_value(self.model.optimizer.momentum)",
     f"{_KV}.get_value(self.backend, self.model.optimizer, 'momentum')"),
    ("_keras/callbacks.py", "hvd.allreduce(self.backend.constant(value, name=metric)).numpy()",
     "hvd.allreduce(tf.constant(value, name=metric)).numpy()  # hvtrain's patch: Keras 3 has no backend.constant"),
    ("_keras/callbacks.py", "self.backend.set_value(self.model.optimizer.momentum,",
     f"{_KV}.set_value(self.backend, self.model.optimizer, 'momentum',", 2),
]


def apply(root: Path) -> list[str]:
    """Write the module and apply every edit under `root` (the installed horovod/); what changed."""
    done = []
    texts: dict[str, str] = {}
    for rel, old, new, *count in EDITS:
        times = count[0] if count else 1
        text = texts.setdefault(rel, (root / rel).read_text())
        if new in text:
            continue  # applied before
        if text.count(old) != times:
            sys.exit(f"horovod_keras3: the text to patch occurs {text.count(old)} times, not {times}, in "
                     f"{root / rel}:\n{old}")
        texts[rel] = text.replace(old, new)
        done.append(rel)
    for rel, text in texts.items():
        (root / rel).write_text(text)
    (root / "tensorflow" / "hvtrain_keras3.py").write_text(KERAS3)  # last: its presence means every edit is in
    return done


def main() -> None:
    import importlib.util

    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("horovod_keras3: Horovod is not installed in this Python")
    root = Path(list(spec.submodule_search_locations)[0])
    changed = apply(root)
    print(f"horovod_keras3: patch {PATCH} on {root}" + (f" ({len(changed)} edits)" if changed else " (already applied)"))


if __name__ == "__main__":
    main()
