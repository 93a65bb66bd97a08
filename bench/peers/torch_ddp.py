"""PyTorch's own data parallelism: DistributedDataParallel over the gloo backend, started by
torchrun, the same model, per-rank batch, optimizer, data and threads as the Horovod peers.

    torchrun --standalone --nproc_per_node 2 bench/peers/torch_ddp.py MODEL EPOCHS STEPS BATCH
Prints one line per rank (bench.common.MARK + JSON): samples/s of each epoch, peak RSS.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import emit  # noqa: E402
from peers.torch_models import build, data, epochs  # noqa: E402

name, n_epochs, steps, batch = sys.argv[1], *(int(a) for a in sys.argv[2:5])
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DistributedDataParallel(build(name))  # broadcasts rank 0's parameters; averages gradients
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = data(name, steps * batch, seed=rank)
rates = epochs(model, opt, x, y, n_epochs, steps, batch, size)
emit(rank, samples_per_sec=rates)
dist.barrier()
# torch 2.13's gloo teardown aborted both ranks once in a full run ("terminate called without an
# active exception", SIGABRT) after the results were out; the peer ends without it
os._exit(0)
