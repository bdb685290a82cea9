"""`python tests/helpers/gather_driver.py OUT TRAIN-FLAGS...`: the command line (python -m dptrain
train) with every all-gather of the host communicator recorded, so a test can see which buffer
went over the wire. Each rank writes OUT.RANK.json: [[dtype, elements sent], ...] in call
order (bfloat16 shows as uint16). Used by test_shadow.py under mpirun: CPU ranks talk over
dist.MPIComm, GPU ranks over the CUDA backend's NCCLComm (patched where CuPy imports)."""
import json
import sys

from dptrain.cli import main as cli_main
from dptrain import distributed as dist

calls, ranks = [], set()


def record(cls):
    """Make cls.all_gather note (dtype, size) of what it sends, then send it."""
    real = cls.all_gather

    def all_gather(self, send, recv):
        calls.append([str(send.dtype), int(send.size)])
        ranks.add(self.rank)
        return real(self, send, recv)

    cls.all_gather = all_gather


if __name__ == "__main__":
    out, flags = sys.argv[1], sys.argv[2:]
    record(dist.MPIComm)
    if "cuda" in flags:
        from dptrain.backend.cuda.nccl import NCCLComm

        record(NCCLComm)
    code = cli_main(["train", *flags])
    for rank in ranks:
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(calls, f)
    sys.exit(code)
