"""Collectives over NCCL on CuPy arrays: the GPU communicator of dptrain.distributed's interface.

    reduce_scatter(send, recv)   recv = this rank's 1/N slice of the mean of send over ranks
    all_gather(send, recv)       recv = the ranks' sends, concatenated in rank order
    all_reduce(buf, op)          in place, op "sum" or "mean"
    broadcast(buf, root=0)       in place
    barrier()                    over the MPI communicator (host side)
    check()                      raise if NCCL recorded an asynchronous error (any thread)

Buffers are 1-D and contiguous; in-place use (recv inside send at this rank's offset, send
inside recv at this rank's offset) is allowed, as NCCL allows it. Every collective runs on
the CURRENT stream: callers pick it with ``runtime.on(runtime.comm_stream())``. The calls can
be captured in a CUDA graph (the communicator is built before any capture).
"""
from __future__ import annotations

import cupy
import numpy as np
from cupy.cuda import nccl  # its constants exist only where libnccl loads: read them on use


class NCCLComm:
    """An NCCL communicator over the ranks of an MPI communicator (mpi4py)."""

    name = "nccl"

    def __init__(self, mpi_comm):
        self.mpi_comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.avg = getattr(nccl, "NCCL_AVG", 4)  # ncclAvg, NCCL >= 2.10
        self.ops = {"sum": nccl.NCCL_SUM, "mean": self.avg}
        self.dtypes = {np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16,
                       # uint16 is bfloat16 here (the 16-bit parameter shadow's all-gather);
                       # ncclBfloat16 = 9 since NCCL 2.10, where CuPy does not name it
                       np.dtype(np.uint16): getattr(nccl, "NCCL_BFLOAT16", 9),
                       np.dtype(np.int64): nccl.NCCL_INT64}  # batch norm's batch counter

    def _dtype(self, array):
        try:
            return self.dtypes[np.dtype(array.dtype)]
        except KeyError:
            raise TypeError(f"nccl: dtype {array.dtype} is not supported") from None

    @staticmethod
    def _stream():
        return cupy.cuda.get_current_stream().ptr

    def reduce_scatter(self, send, recv):
        self.comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, self._dtype(send), self.avg,
                                self._stream())

    def all_gather(self, send, recv):
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._dtype(send),
                            self._stream())

    def all_reduce(self, buf, op="sum"):
        if op not in self.ops:
            raise ValueError(f"nccl.all_reduce: op must be 'sum' or 'mean', got {op!r}")
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf), self.ops[op],
                            self._stream())

    def broadcast(self, buf, root=0):
        self.comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf), root,
                            self._stream())

    def barrier(self):
        self.mpi_comm.Barrier()

    def check(self):
        """Raise RuntimeError if NCCL has an asynchronous error (ncclCommGetAsyncError):
        a remote rank failed or the network broke. Cheap, host-only, any thread."""
        try:
            self.comm.check_async_error()
        except RuntimeError as exc:  # cupy's NcclError is a RuntimeError
            raise RuntimeError(f"NCCL asynchronous error: {exc}") from None
