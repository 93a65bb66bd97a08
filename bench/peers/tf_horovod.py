"""The hand-written Horovod TensorFlow 2 loop hvtrain is measured against, written the way
Horovod's examples/tensorflow2/tensorflow2_synthetic_benchmark.py is (a tf.function step with
hvd.DistributedGradientTape, variables broadcast from rank 0, Horovod's default knobs), for
Keras 3: Horovod's TF layer expects tf.Variables, so it gets each Keras variable's `.value`.

    horovodrun -np 2 -H localhost:2 python bench/peers/tf_horovod.py EPOCHS STEPS BATCH [MODEL]
Prints one line per rank (bench.common.MARK + JSON): samples/s of each epoch, peak RSS.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers.tf_models import SHAPES, build, data, epochs, keras, one_thread, tf  # noqa: E402, I001

import horovod.tensorflow as hvd  # noqa: E402

from common import emit  # noqa: E402

n_epochs, steps, batch = (int(a) for a in sys.argv[1:4])
name = sys.argv[4] if len(sys.argv) > 4 else "mlp"
hvd.init()
one_thread()
keras.utils.set_random_seed(0)
model = build(name)
opt = keras.optimizers.SGD(0.01, momentum=0.9)
opt.build(model.trainable_variables)
hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
hvd.broadcast_variables([v.value for v in opt.variables], root_rank=0)


@tf.function(input_signature=[tf.TensorSpec((None, *SHAPES[name]), tf.float32), tf.TensorSpec((None,), tf.int64)])
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, model(xb, training=True)))
    tape = hvd.DistributedGradientTape(tape)  # op=Average, no compression
    grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
    opt.apply(grads, model.trainable_variables)
    return loss


x, y = data(steps * batch, seed=hvd.rank(), name=name)
emit(hvd.rank(), samples_per_sec=epochs(step, x, y, n_epochs, steps, batch, hvd.size()))
