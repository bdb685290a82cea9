"""A user's loop that reads its model between DataParallel steps, for tests/run/
test_between_steps.py: `python between_steps_driver.py OUT PRECISION`, alone or under mpirun.

It trains 12 steps at a global batch of 16 and, after some of them, evaluates and reads the
weights the way users do, with no explicit ``sync_parameters()``; each read point starts with
another kind of first read (the lazy gather must come from that one):

    ddp_eval      ddp.eval(), then the parameters' arrays read directly (p.numpy())
    model_forward the loss of the wrapped model's own forward, model(x)
    model_state   model.state_dict() (PyTorch's ``ddp.module.state_dict()`` habit)
    sub_state     a sub-module's state_dict()
    ddp_call      the loss of ddp(x) under no_grad, in training mode

What the first read saw is saved ("first:STEP:NAME"); then, at every point, the evaluation
loss through ddp(x) in eval mode ("eval:STEP"), ``model.state_dict()`` ("model:STEP:NAME")
and ``ddp.state_dict()`` ("ddp:STEP:NAME"), and whether the 16-bit copy of the weights is
current. Every rank writes OUT.rank{r}.npz with these, the step losses, and the steps after
which the reducer gathered the weights outside a step."""
import sys

import numpy as np

import dptrain as dp
from dptrain import functional as F
from dptrain import nn

READS = {3: "ddp_eval", 5: "model_forward", 6: "model_state", 9: "sub_state", 11: "ddp_call"}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.head(F.flatten(F.relu(self.conv(x))))


def main(out, precision):
    world = dp.dist.init(device="cpu")
    dp.manual_seed(0)
    model = Net()
    ddp = dp.DataParallel(model, "adamw", lr=2e-2, precision=precision)
    syncs = []
    gather = ddp.reducer.sync_parameters
    ddp.reducer.sync_parameters = lambda: (syncs.append(step.steps), gather())

    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 1, 6, 6)).astype(np.float32)
    labels = rng.integers(0, 3, 64)
    data = dp.ArrayDataset(x, labels)
    x_eval = dp.tensor(rng.standard_normal((24, 1, 6, 6)).astype(np.float32))
    y_eval = dp.tensor(rng.integers(0, 3, 24))

    step = ddp.compile(lambda b: F.cross_entropy(ddp(b[0]), b[1]))
    losses, saved = [], {}
    for epoch in range(3):  # 64 samples / 16 a global batch: 4 steps an epoch
        for batch in data.batches(16 // world.size, world, epoch):
            step(batch)
            losses.append(step.metrics()["loss"])
            kind = READS.get(step.steps)
            if kind is None:
                continue
            first = f"first:{step.steps}"  # what the first read saw
            with dp.no_grad():
                if kind == "ddp_eval":  # eval() gathers: the arrays read directly are current
                    ddp.eval()
                    read = {name: p.numpy().copy() for name, p in model.named_parameters()}
                elif kind == "model_forward":
                    read = {"loss": F.cross_entropy(model(x_eval), y_eval).numpy()}
                elif kind == "model_state":
                    read = model.state_dict()
                elif kind == "sub_state":
                    read = model.head.state_dict()
                else:
                    read = {"loss": F.cross_entropy(ddp(x_eval), y_eval).numpy()}
                saved.update({f"{first}:{name}": value for name, value in read.items()})
                ddp.eval()
                loss = F.cross_entropy(ddp(x_eval), y_eval)
                ddp.train()
            saved[f"eval:{step.steps}"] = loss.numpy()
            for name, value in model.state_dict().items():
                saved[f"model:{step.steps}:{name}"] = value
            for name, value in ddp.state_dict().items():
                saved[f"ddp:{step.steps}:{name}"] = value
            shadows = [p for p in model.parameters() if p.shadow is not None]
            saved[f"shadow_current:{step.steps}"] = np.array(all(
                np.array_equal(p.be.to_numpy(p.shadow), p.numpy().astype(p.shadow.dtype))
                for p in shadows))
    np.savez(f"{out}.rank{world.rank}.npz", losses=np.array(losses), syncs=np.array(syncs),
             **saved)


if __name__ == "__main__":
    dp.launch(main, sys.argv[1], sys.argv[2])
