"""A host-side communicator over TCP for ranks that no MPI launcher joined (Slurm's `srun`
without PMI): the subset of mpi4py's Intracomm that dptrain calls, so the rest of the code
(NCCL's unique id, checkpoints, stop requests, the CPU backend's gradients) runs unchanged.

    comm = connect(rank, size, host, place, job, timeout)    # every rank, once
    comm.bcast(obj, root) / allgather(obj) / Barrier() / Dup() / Split(color, key) /
    Split_type(COMM_TYPE_SHARED, key) / Iallreduce(send, recv, op).Wait() /
    Bcast(buf, root) / Allgather(send, recv) / Allreduce(send|IN_PLACE, recv, op) /
    Reduce_scatter_block(send, recv, op) / Abort(code)

A star through rank 0: every rank holds one socket to rank 0, where a server thread gathers
each collective's contributions (matched by communicator and sequence number), computes the
result once (sums in rank order: every rank gets the same bits) and sends it back. Host
traffic is small (ids, metadata, one int per step; gradients only on the CPU backend), so
correctness and clear failures come before speed.

Failures end the job, as MPI's do: Abort on any rank makes rank 0 tell every rank to exit
with that code; a rank whose connection closes without saying goodbye (killed, crashed) makes
rank 0 abort the job naming it; a rank that loses rank 0 raises at its next collective (and
exits after a grace period if it never gets there). TCP keepalive notices a dead host.

Trust: frames are pickles, so only a rank that shows the job's secret is listened to. The
secret travels in the rendezvous file (mode 0600); with DPTRAIN_RENDEZVOUS=host:port it is
the job's id, and the network must be trusted, as MPI's own out-of-band channel is.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np

from dptrain import switches

# mpi4py's names for what the callers pass (dptrain.distributed.constants picks these or mpi4py's)
CONSTANTS = SimpleNamespace(SUM="sum", MAX="max", IN_PLACE=object(), COMM_TYPE_SHARED="shared",
                            UNDEFINED=None)
_REDUCE = {"sum": np.add, "max": np.maximum}
_HEADER = struct.Struct("!Q")
GOODBYE_WAIT_S = 30.0  # rank 0, at exit, waits this long for the others' goodbyes
ORPHAN_GRACE_S = 10.0  # a rank that lost rank 0 exits after this, wherever it is stuck
connected = False  # this process has met its ranks (its threads hold sockets: no forking)


class RendezvousError(RuntimeError):
    """The ranks could not meet, or the job lost a rank (the message names it)."""


# -- framing: 8-byte length, then a pickle

def _send(sock, lock, msg):
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock, n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return buf


def _recv(sock):
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, n))


def _keepalive(sock):
    # a host that vanishes (power, network) sends no FIN: keepalive notices within ~1 minute
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _exit(code, message=None):
    if message:
        try:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    os._exit(code)


class _Mailbox:
    """Results addressed to this rank, by (context, sequence); or the failure that ends all."""

    def __init__(self):
        self.cond = threading.Condition()
        self.items = {}
        self.failure = None

    def put(self, key, value):
        with self.cond:
            self.items[key] = value
            self.cond.notify_all()

    def fail(self, message):
        with self.cond:
            if self.failure is None:
                self.failure = message
            self.cond.notify_all()

    def ready(self, key):
        with self.cond:
            return key in self.items or self.failure is not None

    def take(self, key, rank):
        with self.cond:
            while key not in self.items:
                if self.failure is not None:
                    raise RendezvousError(f"rank {rank}: {self.failure}")
                self.cond.wait(1.0)
            return self.items.pop(key)


# -- the transport: one per process

class _Transport:
    def __init__(self, rank, size, hosts=None):
        self.rank, self.size = rank, size
        self.hosts = hosts  # rank -> host key (rank 0 only)
        self.mailbox = _Mailbox()
        self.closing = False

    def post(self, msg):
        raise NotImplementedError

    def abort(self, code, reason):
        raise NotImplementedError

    def close(self):
        pass


class _Client(_Transport):
    """A rank other than 0: one socket to rank 0, a thread that reads results from it."""

    def __init__(self, rank, size, sock):
        super().__init__(rank, size)
        self.sock, self.lock = sock, threading.Lock()
        self.gone = threading.Event()
        self.aborting = False
        threading.Thread(target=self._read, name="dptrain-rendezvous", daemon=True).start()

    def post(self, msg):
        try:
            _send(self.sock, self.lock, msg)
        except OSError as exc:
            self.mailbox.fail(f"lost the connection to rank 0 ({exc})")

    def _read(self):
        try:
            while True:
                msg = _recv(self.sock)
                if msg[0] == "result":
                    self.mailbox.put((msg[1], msg[2]), msg[3])
                elif msg[0] == "abort":  # the rank that asked for it has said why already
                    _exit(msg[1], None if self.aborting else
                          f"dptrain: rank {self.rank}: job aborted: {msg[2]}")
                elif msg[0] == "goodbye":
                    self.closing = True
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        self.gone.set()
        if self.closing:  # rank 0 said goodbye: only a collective it never joins fails
            self.mailbox.fail("rank 0 has finished and left")
            return
        message = "lost the connection to rank 0 (it exited or was killed without finishing)"
        self.mailbox.fail(message)
        # the main thread raises at its next collective; if it is stuck elsewhere, end here
        time.sleep(ORPHAN_GRACE_S)
        _exit(1, f"dptrain: rank {self.rank}: {message}; exiting")

    def abort(self, code, reason):
        self.aborting = True
        try:
            _send(self.sock, self.lock, ("abort", code, reason))
            self.sock.shutdown(socket.SHUT_WR)  # the abort reaches rank 0 before our FIN
            self.gone.wait(5.0)  # rank 0 tells the others, then closes
        except OSError:
            pass
        _exit(code)

    def close(self):
        if self.gone.is_set():
            return
        self.closing = True
        try:
            _send(self.sock, self.lock, ("goodbye",))
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class _Server(_Transport):
    """Rank 0: a reader thread per peer feeds one queue; one thread runs the collectives."""

    def __init__(self, size, hosts, peers):
        super().__init__(0, size, hosts)
        self.peers = peers  # rank -> socket
        self.locks = {r: threading.Lock() for r in peers}
        self.events = queue.Queue()
        self.members = {0: list(range(size))}  # context -> world ranks, in comm rank order
        self.next_context = 1
        self.pending = {}  # (context, seq) -> {comm rank: (kind, arg, payload)}
        self.left = set()  # ranks that said goodbye
        self.done = threading.Event()
        for r, sock in peers.items():
            threading.Thread(target=self._read, args=(r, sock), daemon=True,
                             name=f"dptrain-rendezvous-{r}").start()
        threading.Thread(target=self._serve, name="dptrain-rendezvous", daemon=True).start()

    def post(self, msg):
        self.events.put((0, msg))

    def _read(self, r, sock):
        try:
            while True:
                self.events.put((r, _recv(sock)))
        except (EOFError, OSError, pickle.UnpicklingError):
            self.events.put((r, ("eof",)))

    def _deliver(self, r, key, value):
        if r == 0:
            self.mailbox.put(key, value)
        else:
            try:
                _send(self.peers[r], self.locks[r], ("result", *key, value))
            except OSError:
                pass  # its reader reports the loss

    def _serve(self):
        while True:
            r, msg = self.events.get()
            kind = msg[0]
            if kind == "coll":
                try:
                    self._contribute(r, *msg[1:])
                except Exception as exc:  # noqa: BLE001 - a mismatch ends the job, named
                    self.abort(1, f"{exc}")
            elif kind == "abort":
                self.abort(msg[1], msg[2])
            elif kind == "goodbye":
                self.left.add(r)
                if len(self.left) == self.size - 1:
                    self.done.set()
            elif kind == "eof":
                if r in self.left:
                    continue
                self.abort(1, f"rank {r} closed its connection without finishing (it exited "
                              f"or was killed)")

    def _contribute(self, r, context, seq, kind, arg, payload):
        members = self.members[context]
        key = (context, seq)
        got = self.pending.setdefault(key, {})
        got[members.index(r)] = (kind, arg, payload)
        if len(got) < len(members):
            return
        del self.pending[key]
        kinds = {k for k, _, _ in got.values()}
        if len(kinds) != 1:
            calls = ", ".join(f"rank {members[i]}: {got[i][0]}" for i in sorted(got))
            raise RendezvousError(f"ranks called different collectives ({calls})")
        results = self._compute(kind, [got[i] for i in range(len(members))], members)
        # rank 0 last: its caller may change a shared result once it has it, the others'
        # copies are pickled by then
        for i in sorted(range(len(members)), key=lambda i: members[i] == 0):
            self._deliver(members[i], key, results[i])

    def _compute(self, kind, calls, members):
        n = len(members)
        args = [a for _, a, _ in calls]
        data = [p for _, _, p in calls]
        if kind == "barrier":
            return [None] * n
        if kind == "bcast":
            root = args[0]
            return [None if i == root else data[root] for i in range(n)]  # root keeps its own
        if kind == "allgather":
            return [data] * n
        if kind in ("allreduce", "reduce_scatter"):
            total = np.array(data[0], copy=True)
            for d in data[1:]:  # in rank order: the same bits on every rank
                _REDUCE[args[0]](total, d, out=total)
            if kind == "allreduce":
                return [total] * n
            block = total.size // n
            flat = total.reshape(-1)
            return [flat[i * block:(i + 1) * block] for i in range(n)]
        if kind in ("split", "split_type"):
            colors = ([self.hosts[w] for w in members] if kind == "split_type"
                      else [a[0] for a in args])
            out = [None] * n
            for color in dict.fromkeys(c for c in colors if c is not None):
                group = sorted((i for i in range(n) if colors[i] == color),
                               key=lambda i: (args[i][1], i))
                context = self._new_context([members[i] for i in group])
                for i in group:
                    out[i] = (context, [members[j] for j in group])
            return out
        if kind == "dup":
            context = self._new_context(list(members))
            return [(context, list(members))] * n
        raise RendezvousError(f"unknown collective {kind!r}")

    def _new_context(self, members):
        context, self.next_context = self.next_context, self.next_context + 1
        self.members[context] = members
        return context

    def abort(self, code, reason):
        """Tell every other rank to exit with `code`, then exit (from any thread)."""
        for r, sock in self.peers.items():
            try:
                sock.settimeout(5.0)
                _send(sock, self.locks[r], ("abort", code, reason))
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        _exit(code, f"dptrain: rank 0: aborting the job: {reason}")

    def close(self):
        # the others may still be reading their last results: let them say goodbye first
        self.closing = True
        for r, sock in self.peers.items():
            try:
                _send(sock, self.locks[r], ("goodbye",))
            except OSError:
                pass
        self.done.wait(GOODBYE_WAIT_S)


# -- the communicator

class _Request:
    def __init__(self, comm, key, recv):
        self.comm, self.key, self.recv = comm, key, recv

    def Test(self):
        if self.key is not None and not self.comm.transport.mailbox.ready(self.key):
            return False
        self.Wait()
        return True

    def Wait(self):
        if self.key is not None:
            result = self.comm._take(self.key)
            self.recv.reshape(-1)[...] = np.asarray(result).reshape(-1)
            self.key = None


class Comm:
    """The ranks `members` (world ranks, in this communicator's rank order)."""

    MPI = CONSTANTS
    rendezvous = True  # what dptrain.distributed.watchdog asks: no point-to-point messages here

    def __init__(self, transport, context, members):
        self.transport, self.context, self.members = transport, context, members
        self.rank, self.size = members.index(transport.rank), len(members)
        self.seq = 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    # every collective: post this rank's part, then wait for rank 0's answer
    def _start(self, kind, arg=None, payload=None):
        self.seq += 1
        key = (self.context, self.seq)
        self.transport.post(("coll", self.context, self.seq, kind, arg, payload))
        return key

    def _take(self, key):
        return self.transport.mailbox.take(key, self.transport.rank)

    def _call(self, kind, arg=None, payload=None):
        return self._take(self._start(kind, arg, payload))

    # -- Python objects
    def bcast(self, obj, root=0):
        result = self._call("bcast", root, obj if self.rank == root else None)
        return obj if self.rank == root else result

    def allgather(self, obj):
        return self._call("allgather", None, obj)

    def Barrier(self):
        self._call("barrier")

    # -- buffers (NumPy)
    def Bcast(self, buf, root=0):
        result = self._call("bcast", root, np.asarray(buf) if self.rank == root else None)
        if self.rank != root:
            buf.reshape(-1)[...] = result.reshape(-1)

    def Allgather(self, send, recv):
        parts = self._call("allgather", None, np.ascontiguousarray(send))
        recv.reshape(-1)[...] = np.concatenate([p.reshape(-1) for p in parts])

    def Alltoall(self, send, recv):
        # recv's i-th block = rank i's block for this rank (all of send travels via rank 0)
        parts = self._call("allgather", None, np.ascontiguousarray(send))
        mine = [p.reshape(self.size, -1)[self.rank] for p in parts]
        recv.reshape(self.size, -1)[...] = np.stack(mine)

    def Allreduce(self, send, recv, op=CONSTANTS.SUM):
        send = recv if send is CONSTANTS.IN_PLACE else send
        recv.reshape(-1)[...] = self._call("allreduce", op, np.asarray(send)).reshape(-1)

    def Reduce_scatter_block(self, send, recv, op=CONSTANTS.SUM):
        recv.reshape(-1)[...] = self._call("reduce_scatter", op, np.asarray(send))

    def Iallreduce(self, send, recv, op=CONSTANTS.SUM):
        return _Request(self, self._start("allreduce", op, np.array(send, copy=True)), recv)

    # -- new communicators
    def _comm(self, result):
        return None if result is None else Comm(self.transport, *result)

    def Dup(self):
        return self._comm(self._call("dup"))

    def Split(self, color=0, key=0):
        return self._comm(self._call("split", (color, key)))

    def Split_type(self, split_type, key=0):
        return self._comm(self._call("split_type", (split_type, key)))

    def Free(self):
        pass

    def Abort(self, errorcode=0):
        reason = f"rank {self.transport.rank} called abort (exit code {errorcode})"
        self.transport.abort(errorcode, reason)


# -- meeting: rank 0 listens, the others find it

def _candidates(info):
    """Addresses to try for rank 0: the name it published, then its addresses."""
    out = [info["host"]] + list(info.get("addrs", []))
    if info["host"] == socket.gethostname():
        out.append("127.0.0.1")
    return list(dict.fromkeys(out))


def _listen(port=0):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    sock.listen(128)
    return sock


def _publish(path, info):
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the secret is inside
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def _where(place):
    return (f"rendezvous address {place[1]}:{place[2]}" if place[0] == "tcp"
            else f"rendezvous file {place[1]}")


def _serve_rendezvous(size, host, place, job, deadline):
    try:
        if place[0] == "tcp":
            listener, secret = _listen(place[2]), job
        else:
            listener, secret = _listen(), secrets.token_hex(16)
            name = socket.gethostname()
            try:
                addrs = sorted({a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)})
            except OSError:
                addrs = []
            place[1].parent.mkdir(parents=True, exist_ok=True)
            _publish(place[1], {"host": name, "addrs": addrs, "port": listener.getsockname()[1],
                                "secret": secret, "job": job, "size": size})
    except OSError as exc:
        raise RendezvousError(f"rank 0: cannot open the {_where(place)}: {exc}; point "
                              f"{switches.var('RENDEZVOUS')} at a directory every node can "
                              f"write, or at host:port") from None
    peers, hosts = {}, {0: host}
    note_at = time.monotonic() + 30.0
    try:
        while len(peers) < size - 1:
            if note_at and time.monotonic() > note_at:  # say why the start is slow, once
                note_at = 0
                sys.stderr.write(f"dptrain: rank 0: {len(peers) + 1} of {size} ranks have met "
                                 f"at {_where(place)}; waiting for the others\n")
                sys.stderr.flush()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, size)) - set(peers))
                raise RendezvousError(
                    f"rank 0: {len(missing)} of {size} ranks did not join within the "
                    f"rendezvous timeout (missing ranks {_short(missing)}) at {_where(place)}; "
                    f"were all {size} tasks started by srun in the same step?")
            listener.settimeout(min(left, 1.0))
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(10.0)
            try:
                (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
                if n > 65536:
                    raise ValueError("not a hello")
                hello = json.loads(_recv_exact(sock, n).decode())
            except (OSError, EOFError, ValueError):
                sock.close()  # not one of ours
                continue
            if not isinstance(hello, dict) or hello.get("secret") != secret:
                sock.close()
                continue
            r = hello.get("rank")
            problem = (f"expected {size} ranks, rank {r} says {hello.get('size')}"
                       if hello.get("size") != size else
                       f"rank {r} joined twice" if r in peers else
                       f"rank {r} is outside 1..{size - 1}" if not (isinstance(r, int)
                                                                   and 0 < r < size) else None)
            if problem:
                _reply(sock, {"error": problem})
                raise RendezvousError(f"rank 0: {problem} ({_where(place)})")
            sock.settimeout(None)
            _keepalive(sock)
            peers[r], hosts[r] = sock, hello["host"]
        for sock in peers.values():
            _reply(sock, {"ok": True})
    finally:
        listener.close()
        if place[0] == "file":
            try:
                os.unlink(place[1])
            except OSError:
                pass
    return _Server(size, hosts, peers)


def _short(ranks):
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def _reply(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _join(rank, size, host, place, job, deadline):
    """Find rank 0, show the secret, wait until every rank has joined."""
    last = "nothing published yet"
    while time.monotonic() < deadline:
        if place[0] == "tcp":
            info = {"host": place[1], "port": place[2], "secret": job, "job": job}
        else:
            try:
                info = json.loads(place[1].read_text())
            except (OSError, ValueError):
                time.sleep(0.1)  # rank 0 has not written it yet
                continue
        for address in _candidates(info):
            try:
                sock = socket.create_connection((address, info["port"]), timeout=5.0)
            except OSError as exc:
                last = f"{address}:{info['port']}: {exc}"
                continue
            try:
                hello = json.dumps({"rank": rank, "size": size, "host": host,
                                    "secret": info["secret"]}).encode()
                sock.sendall(_HEADER.pack(len(hello)) + hello)
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
                answer = json.loads(_recv_exact(sock, n).decode())
            except (OSError, EOFError, ValueError) as exc:
                sock.close()
                last = f"{address}:{info['port']}: {exc or type(exc).__name__}"
                continue  # a stale file from an earlier step, or rank 0 gave up
            if "error" in answer:
                raise RendezvousError(f"rank {rank}: rank 0 refused it: {answer['error']}")
            sock.settimeout(None)
            _keepalive(sock)
            return _Client(rank, size, sock)
        time.sleep(0.2)
    raise RendezvousError(f"rank {rank}: could not reach rank 0 within the rendezvous timeout "
                          f"at {_where(place)} ({last}); did rank 0 start?")


def connect(rank, size, host, place, job, timeout) -> Comm:
    """Every rank: meet the others; returns the world communicator (rank order = `rank`).
    `host` groups ranks for Split_type; `place` is dptrain.distributed.slurm.rendezvous_place's."""
    global connected
    deadline = time.monotonic() + timeout
    if rank == 0:
        transport = _serve_rendezvous(size, host, place, job, deadline)
    else:
        transport = _join(rank, size, host, place, job, deadline)
    atexit.register(transport.close)
    connected = True
    return Comm(transport, 0, list(range(size)))
