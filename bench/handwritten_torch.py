"""The peer hvtrain is measured against: a hand-written Horovod PyTorch loop.

Same model, data size, batch, optimizer and threads as bench/mlp.yaml. Prints one JSON line
(rank 0): samples/s over the timed steps of every epoch (evaluation excluded, as in hvtrain).
"""

import json
import sys
import time

import horovod.torch as hvd
import torch
from torch import nn

epochs, steps, batch = (int(a) for a in sys.argv[1:4])
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
x = torch.randn(steps * batch, 64)
y = torch.randint(0, 10, (steps * batch,))
rates = []
for _ in range(epochs):
    perm = torch.randperm(len(x))
    t0 = time.perf_counter()
    for s in range(steps):
        idx = perm[s * batch:(s + 1) * batch]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    loss.item()
    rates.append(steps * batch * hvd.size() / (time.perf_counter() - t0))
if hvd.rank() == 0:
    print(json.dumps({"samples_per_sec": rates}))
