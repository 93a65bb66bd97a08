"""TensorFlow's own multi-worker data parallelism: tf.distribute.MultiWorkerMirroredStrategy
with ring all-reduce (CommunicationImplementation.RING), one worker process per rank found
through TF_CONFIG, a custom training loop over the same Keras 3 MLP, per-rank batch, optimizer,
data and threads as the Horovod peers (the loss is averaged over the global batch, so the
summed gradients are the average: the same math as Horovod's op=Average).

    TF_CONFIG='{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": I}}' \
        python bench/peers/tf_mwms.py EPOCHS STEPS BATCH [MODEL]          (one process per worker)
Prints one line per worker (bench.common.MARK + JSON): samples/s of each epoch, peak RSS.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import emit  # noqa: E402
from peers.tf_models import SHAPES, build, data, epochs, keras, one_thread, tf  # noqa: E402

n_epochs, steps, batch = (int(a) for a in sys.argv[1:4])
name = sys.argv[4] if len(sys.argv) > 4 else "mlp"
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
one_thread()
keras.utils.set_random_seed(0)
ring = tf.distribute.experimental.CommunicationOptions(
    implementation=tf.distribute.experimental.CommunicationImplementation.RING)
strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=ring)
size = strategy.num_replicas_in_sync
with strategy.scope():
    model = build(name)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    opt.build(model.trainable_variables)


def replica_step(xb, yb):
    with tf.GradientTape() as tape:
        per_sample = tf.nn.sparse_softmax_cross_entropy_with_logits(yb, model(xb, training=True))
        loss = tf.nn.compute_average_loss(per_sample, global_batch_size=batch * size)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))  # all-reduced (summed) across workers
    return loss


@tf.function(input_signature=[tf.TensorSpec((None, *SHAPES[name]), tf.float32), tf.TensorSpec((None,), tf.int64)])
def step(xb, yb):
    return strategy.run(replica_step, args=(xb, yb))


x, y = data(steps * batch, seed=rank, name=name)
emit(rank, samples_per_sec=epochs(step, x, y, n_epochs, steps, batch, size))
