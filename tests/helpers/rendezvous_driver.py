"""Started as one of several Slurm tasks by tests/distributed/test_slurm.py: meets the others through the
rendezvous, runs every collective dptrain uses on its communicator, checks each result
against the one NumPy computes, and writes "ok" (or the first mismatch) to DIR/rank-R."""
import sys
import traceback
from pathlib import Path

import numpy as np

from dptrain import distributed as dist
from dptrain.distributed import slurm
from dptrain.distributed.rendezvous import connect

tasks = slurm.from_env()
comm = connect(tasks.rank, tasks.size, tasks.host, slurm.rendezvous_place(tasks), tasks.job, 30)
MPI = dist.constants(comm)
rank, size = comm.Get_rank(), comm.Get_size()


def data(r, n=12):  # what rank r contributes: different on every rank, exact in float64
    return np.arange(n, dtype=np.float64) * (r + 1) + r


def check():
    assert (rank, size) == (tasks.rank, tasks.size)
    assert comm.bcast({"id": 7} if rank == 1 else None, root=1) == {"id": 7}
    assert comm.allgather(rank * 10) == [r * 10 for r in range(size)]
    comm.Barrier()
    want = sum(data(r) for r in range(size))
    buf = data(rank)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    assert np.array_equal(buf, want)
    block = 12 // size  # the tests run 2, 3 or 4 ranks
    out = np.empty(block, dtype=np.float64)
    comm.Reduce_scatter_block(data(rank), out, op=MPI.SUM)
    assert np.array_equal(out, want[rank * block:(rank + 1) * block])
    gathered = np.empty(4 * size, dtype=np.float32)
    comm.Allgather(np.full(4, rank, dtype=np.float32), gathered)
    assert np.array_equal(gathered, np.repeat(np.arange(size, dtype=np.float32), 4))
    b = np.arange(5, dtype=np.int64) if rank == 0 else np.zeros(5, dtype=np.int64)
    comm.Bcast(b, root=0)
    assert np.array_equal(b, np.arange(5))
    dup = comm.Dup()
    send, recv = np.array([rank * 3], dtype=np.int32), np.zeros(1, dtype=np.int32)
    req = dup.Iallreduce(send, recv, op=MPI.MAX)
    comm.Barrier()  # another communicator's collective while the request is pending
    req.Wait()
    assert recv[0] == (size - 1) * 3
    odd = comm.Split(MPI.UNDEFINED if rank == 0 else rank % 2, key=-rank)
    if rank == 0:
        assert odd is None
    else:
        members = [r for r in range(1, size) if r % 2 == rank % 2][::-1]  # key=-rank: reversed
        assert odd.Get_size() == len(members) and odd.Get_rank() == members.index(rank)
        assert odd.allgather(rank) == members
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    assert host.allgather(tasks.host) == [tasks.host] * host.Get_size()


try:
    check()
    result = "ok"
except Exception:  # noqa: BLE001 - reported to the test through the file
    result = traceback.format_exc()
Path(sys.argv[1], f"rank-{rank}").write_text(result)
