"""The hand-written Horovod PyTorch loop hvtrain is measured against, written the way Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py is: hvd.init, DistributedOptimizer (op=Average,
no compression), broadcast of parameters and optimizer state, Horovod's default knobs.

    horovodrun -np 2 -H localhost:2 python bench/peers/torch_horovod.py MODEL EPOCHS STEPS BATCH
Prints one line per rank (bench.common.MARK + JSON): samples/s of each epoch, peak RSS.
"""

import sys
from pathlib import Path

import horovod.torch as hvd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import emit  # noqa: E402
from peers.torch_models import build, data, epochs  # noqa: E402

name, n_epochs, steps, batch = sys.argv[1], *(int(a) for a in sys.argv[2:5])
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = build(name)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Average)
x, y = data(name, steps * batch, seed=hvd.rank())
emit(hvd.rank(), samples_per_sec=epochs(model, opt, x, y, n_epochs, steps, batch, hvd.size()))
