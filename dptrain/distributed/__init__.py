"""Everything that spans processes: the world, the gradient exchange and keeping a job alive.

    world.py       which rank this is, the communicators (Local, MPI; NCCL lives in the backend)
    flat.py        all parameters and gradients in one padded buffer per dtype, 16-bit shadow
    reducer.py     buckets of that buffer: reduce-scatter (fp32 or bf16), this rank's shard,
                   all-gather
    buckets.py     --bucket-mb auto: bucket sizes from the link and the backward's timing
    timeline.py    a step's per-bucket exchange timeline, as JSON
    launcher.py    finding mpirun / mpiexec / srun and building their command lines
    slurm.py       the world from SLURM_* when srun started the ranks without MPI
    rendezvous.py  the TCP meeting place for that case, answering mpi4py's calls
    watchdog.py    aborts a job whose collective or step never finishes
    stopping.py    SIGINT/SIGTERM: every rank stops after the same step
    startup.py     once-per-host work (kernel builds) while the host's other ranks wait

May import: dptrain.errors, dptrain.fileio, dptrain.backend, dptrain.engine. Never the loop,
the command line or the benchmarks.
"""
from dptrain.distributed.world import (LocalComm, MPIComm, World, check_foreign_launcher,
                                       constants, current, guarded, host_communicator, init,
                                       launched_by_mpi)

__all__ = ["World", "LocalComm", "MPIComm", "init", "current", "guarded", "constants",
           "host_communicator", "launched_by_mpi", "check_foreign_launcher"]
