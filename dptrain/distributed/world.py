"""The world: which rank this process is, how many there are, and how they talk.

Under ``mpirun`` the world comes from mpi4py's COMM_WORLD; the local rank (a
shared-memory split) picks the device. Under Slurm's ``srun`` without an MPI launcher (no
PMI, or an MPI that sees a world of one) the world comes from SLURM_* (dptrain.distributed.slurm) and
the ranks meet over TCP (dptrain.distributed.rendezvous), whose communicator answers the same mpi4py
calls. The backend's runtime supplies the communicator for its arrays (GPU: rank 0 makes an
NCCL unique id, the host communicator broadcasts it, every rank builds an NCCL communicator,
and the host is out of the hot path); where it has none (CPU), the host communicator itself
carries the collectives. Without a launcher the world has one rank and every collective is
a copy or nothing.

All three communicators (``LocalComm``, ``MPIComm`` here, NCCL in the CUDA backend)
have one interface, used by the reducer; collectives run on the backend's current
stream (the reducer picks the communication stream with ``runtime.on``):
    reduce_scatter(send, recv)   recv = this rank's 1/N slice of the mean of send over ranks
    all_gather(send, recv)       recv = the ranks' sends, concatenated in rank order
    all_reduce(buf, op)          in place, op "sum" or "mean"
    broadcast(buf, root=0)       in place
    barrier()
    check()                      raise if the communicator recorded an asynchronous error
                                 (NCCL); a no-op elsewhere. Safe to call from another thread
Buffers are 1-D and contiguous; in-place use (recv inside send at this rank's
offset, send inside recv at this rank's offset) is allowed, as NCCL allows it.
"""
from __future__ import annotations

import os
import sys
import traceback

import numpy as np

from dptrain import switches
from dptrain.backend.bfloat16 import BFLOAT16, from_bfloat16, to_bfloat16
from dptrain.distributed import slurm
from dptrain.errors import AgreedUsageError, RunStopped, UsageError

# Environment variables that MPI launchers set in every process they start.
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_mpi() -> bool:
    return any(var in os.environ for var in _LAUNCHER_VARS)


def check_foreign_launcher(mpi_size: int) -> None:
    """Stop when torchrun started several processes that MPI sees as worlds of one: each
    would train alone into the same files. (Slurm's tasks meet without MPI: dptrain.distributed.slurm.)"""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if size > 1 and "RANK" in os.environ and mpi_size == 1:
        raise RuntimeError(f"WORLD_SIZE={size}: started by torchrun as {size} processes, but "
                           f"MPI sees a world of one; dptrain's ranks talk over MPI: launch "
                           f"with mpirun -n {size} python -m dptrain ... (or mpiexec -n {size}, "
                           f"or srun -n {size} under Slurm)")


def constants(comm):
    """MPI's constants (SUM, MAX, IN_PLACE, COMM_TYPE_SHARED) for `comm`: mpi4py's, or the
    rendezvous communicator's own (importing mpi4py there would start MPI for nothing)."""
    own = getattr(comm, "MPI", None)
    if own is not None:
        return own
    from mpi4py import MPI

    return MPI


class LocalComm:
    """A world of one: collectives are copies or nothing."""

    name = "local"
    rank, size = 0, 1

    def __init__(self, be=None):
        self.be = be

    def reduce_scatter(self, send, recv):
        if recv is not send:
            self.be.copy_(recv, send)

    def all_gather(self, send, recv):
        if recv is not send:
            self.be.copy_(recv, send)

    def all_reduce(self, buf, op="sum"):
        pass

    def broadcast(self, buf, root=0):
        pass

    def barrier(self):
        pass

    def check(self):
        pass


class MPIComm:
    """Collectives over MPI (or the rendezvous) on NumPy arrays (the CPU backend)."""

    name = "mpi"

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def reduce_scatter(self, send, recv):
        if send.dtype.itemsize == 2:
            return self._reduce_scatter_16(send, recv)
        MPI = constants(self.comm)
        out = np.empty_like(recv)
        self.comm.Reduce_scatter_block(np.ascontiguousarray(send), out, op=MPI.SUM)
        out /= out.dtype.type(self.size)
        recv[...] = out

    def _reduce_scatter_16(self, send, recv):
        """16-bit floats (float16, or bfloat16 as uint16): MPI has no portable 16-bit float
        sum, so every rank receives the ranks' 16-bit slices of its shard (all-to-all: the
        bytes a ring reduce-scatter moves), sums them widened to float32 in rank order
        (deterministic), divides by N and rounds once to 16 bits. NCCL's ring rounds after
        each hop instead: its result may differ from this one in the last bit."""
        slices = np.ascontiguousarray(send).view(np.uint16).reshape(self.size, -1)
        got = np.empty_like(slices)
        self.comm.Alltoall(slices, got)
        wide = (from_bfloat16(got) if send.dtype == BFLOAT16
                else got.view(np.float16).astype(np.float32))
        mean = wide.sum(axis=0, dtype=np.float32) / np.float32(self.size)
        recv[...] = (to_bfloat16(mean) if send.dtype == BFLOAT16
                     else mean.astype(np.float16)).view(recv.dtype)

    def all_gather(self, send, recv):
        if send.dtype == np.float16:  # moves bits: MPI's 16-bit float type is optional
            send, recv = send.view(np.uint16), recv.view(np.uint16)
        self.comm.Allgather(np.array(send, copy=True), recv)

    def all_reduce(self, buf, op="sum"):
        MPI = constants(self.comm)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if op == "mean":
            buf /= buf.dtype.type(self.size)

    def broadcast(self, buf, root=0):
        self.comm.Bcast(buf, root=root)

    def barrier(self):
        self.comm.Barrier()

    def check(self):
        pass  # MPI reports errors where a call returns


class World:
    """rank, size, local_rank and the communicator for one device kind; `mpi_comm` is the
    host-side world communicator (mpi4py's, or the rendezvous one under Slurm; None without
    a launcher) and `host_comm` the one of this host's ranks."""

    def __init__(self, rank=0, size=1, local_rank=0, local_size=1, comm=None, mpi_comm=None,
                 host_comm=None):
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.comm = comm if comm is not None else LocalComm()
        self.mpi_comm = mpi_comm
        self.host_comm = host_comm
        self.be = getattr(self.comm, "be", None)  # the backend init built it for

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def host_communicator(world, key=None):
    """The ranks of this rank's host, as an MPI communicator (ordered by `key`, by default
    the world rank; under Slurm SLURM_LOCALID, so that the local rank is Slurm's).

    The one place that decides which ranks share a host: the local rank (which picks the
    GPU), the once-per-host work (dataset generation, kernel compilation) and the per-host
    caches all follow it. Normally it is MPI's shared-memory split (under Slurm without MPI:
    SLURM_NODEID); a test can instead name every rank's host in DPTRAIN_TEST_SIMULATED_HOSTS
    (comma-separated, one entry per rank), so one machine plays several hosts."""
    simulated = switches.value("TEST_SIMULATED_HOSTS")
    if not simulated:
        key = world.Get_rank() if key is None else key
        return world.Split_type(constants(world).COMM_TYPE_SHARED, key=key)
    hosts = [h.strip() for h in simulated.split(",")]
    if len(hosts) != world.Get_size() or not all(hosts):
        raise RuntimeError(f"{switches.var('TEST_SIMULATED_HOSTS')}={simulated!r}: expected "
                           f"{world.Get_size()} comma-separated host names, one per rank")
    order = sorted(set(hosts), key=hosts.index)  # hosts in order of their first rank
    return world.Split(order.index(hosts[world.Get_rank()]), key=world.Get_rank())


_job_comm = None  # the world communicator init built on: guarded aborts it


def init(be=None, device: str = "auto") -> World:
    """The world of this process: under mpirun or srun its rank among the job's, else a
    world of one. Selects this rank's device before anything is allocated on it.

    ``be``: the backend module (dptrain.backend.get); without it, the backend of ``device``
    ("auto": the GPU where CuPy sees one, else the CPU). The world is built once per
    process: a later ``init()`` returns it (``current()`` too); ``world.be`` is its backend.
    """
    global _current
    if be is None:
        from dptrain import backend

        if _current is not None and device == "auto":
            return _current
        be = backend.get(backend.resolve_device(device))
    _current = _init(be)
    _current.be = be
    return _current


def current():
    """The world the last ``init`` built, or None."""
    return _current


_current = None


def _init(be) -> World:
    global _job_comm
    if not launched_by_mpi():
        tasks = slurm.from_env()
        if tasks is not None:
            return _init_slurm(be, tasks)
        check_foreign_launcher(1)
        return World(comm=LocalComm(be))
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError("started by an MPI launcher but mpi4py is not installed "
                           "(pip install 'dptrain[mpi]')") from None
    world = MPI.COMM_WORLD
    tasks = slurm.from_env() if world.Get_size() == 1 else None
    if tasks is not None:
        # srun with a PMI plugin this MPI cannot use: every task is a singleton
        return _init_slurm(be, tasks)
    _job_comm = world
    return _build(be, world)


def _init_slurm(be, tasks) -> World:
    """The world of Slurm's tasks, met through the rendezvous (dptrain.distributed.rendezvous)."""
    global _job_comm
    from dptrain.distributed import rendezvous

    world = rendezvous.connect(tasks.rank, tasks.size, tasks.host, slurm.rendezvous_place(tasks),
                               tasks.job, slurm.rendezvous_timeout())
    _job_comm = world
    return _build(be, world, tasks.local_rank)


def _build(be, world, host_key=None) -> World:
    rank, size = world.Get_rank(), world.Get_size()
    node = host_communicator(world, host_key)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    if size == 1:
        check_foreign_launcher(1)
        return World(comm=LocalComm(be), mpi_comm=world)
    try:
        be.runtime.select_device(local_rank)  # raises when the host has too few devices
    except RuntimeError as exc:
        raise RuntimeError(f"rank {rank}: {exc} (this host runs {local_size} ranks)") from None
    comm = be.runtime.communicator(world) or MPIComm(world)
    return World(rank, size, local_rank, local_size, comm, world, node)


def job_rank() -> int:
    """This process's rank in the job (0 before the ranks met, or without a launcher)."""
    return _job_comm.Get_rank() if _job_comm is not None else 0


def root_decides(world, check):
    """check() on rank 0 (which alone reads and writes the run's files), its outcome on every
    rank: what it returns, or the UsageError it raises, raised by every rank alike as an
    AgreedUsageError (one line from rank 0, no abort)."""
    outcome = ("ok", None)
    if world.is_root:
        try:
            outcome = ("ok", check())
        except UsageError as exc:
            outcome = ("error", str(exc))
    if world.size > 1 and world.mpi_comm is not None:
        outcome = world.mpi_comm.bcast(outcome, root=0)
    if outcome[0] == "error":
        raise AgreedUsageError(outcome[1])
    return outcome[1]


def guarded(fn):
    """Run fn() and return its exit code. Under mpirun or srun, an exception (or a non-zero
    exit) on any rank prints its traceback prefixed with the rank and aborts the whole job,
    so no rank is left waiting in a collective."""
    tasks = None
    if not launched_by_mpi():
        try:
            tasks = slurm.from_env()
        except slurm.SlurmError:
            pass  # init reports it
        if tasks is None:
            try:
                return fn()
            except RunStopped as exc:
                if not exc.agreed:
                    raise
                return exc.exit_code
    try:
        code, failure = fn(), None
        if not code:
            return code
    except RunStopped as exc:
        if not exc.agreed:
            code, failure = 1, exc
        else:  # every rank stopped after the same step: each exits with the code, no abort
            return exc.exit_code
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        code = exc.code if isinstance(exc.code, int) else 1
        failure = None
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job
        code, failure = 1, exc
    comm = _job_comm
    if comm is None and launched_by_mpi():
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank = comm.Get_rank() if comm is not None else tasks.rank if tasks else 0
    if failure is not None:
        text = "".join(traceback.format_exception(failure)).rstrip()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.flush()
    if comm is None:  # failed before the ranks met: each rank ends on its own
        return code
    comm.Abort(code)
