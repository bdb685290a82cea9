"""``DataParallel``: a model of the user's, trained data-parallel with `train`'s machinery.

    world = dptrain.distributed.init()                      # mpirun / srun / one process
    dp.manual_seed(0)                                # the same initial weights on every rank
    ddp = dptrain.DataParallel(Net(), optimizer="adamw", lr=1e-3)
    step = ddp.compile(lambda batch: F.mse_loss(ddp(batch[0]), batch[1]))
    for x, y in data.batches(32, world, epoch):       # this rank's rows of the global batch
        step((x, y))

What it sets up is what `python -m dptrain train` runs: the parameters in one flat buffer
(dptrain.distributed.flat) cut into buckets, reduce-scatter of each bucket as backward completes
it, each rank updating only its shard with optimizer state for that shard only (ZeRO-1),
all-gather at the start of the next step (of the 16-bit shadow in mixed precision), the
non-finite guard and fp16 loss scaling (dptrain.run.nonfinite, dptrain.run.amp), the
step captured once by the backend's runtime and replayed (dptrain.run.compiled), dropout
masks drawn for the global batch (N ranks drop what one process would), and exact-resume
checkpoints in `train`'s format (``ddp.save(dir)`` / ``ddp.load(dir)``, dptrain.checkpoints).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import time
import warnings
from pathlib import Path

import numpy as np

import dptrain.engine.functional as F
from dptrain import distributed as dist
from dptrain.backend.bfloat16 import BFLOAT16
from dptrain.checkpoints.state import MODEL, OPTIM, from_json, restore_weights, to_json
from dptrain.checkpoints.store import MANIFEST, CheckpointError, CheckpointStore, load, step_dir
from dptrain.distributed import buckets
from dptrain.distributed.flat import FlatParameters
from dptrain.distributed.reducer import EXCHANGES, Reducer
from dptrain.distributed.startup import first_on_host
from dptrain.engine.autograd import Tensor, no_grad
from dptrain.engine.rng import init_rng, set_data_shard
from dptrain.errors import UsageError
from dptrain.optim import OPTIMIZERS
from dptrain.run import amp, script
from dptrain.run.evaluate import broadcast_buffers
from dptrain.run.nonfinite import NonFiniteGuard

SYNC_MODES = ("check", "broadcast")


def make_optimizer(spec, flat, segments, **options):
    """The optimizer over `segments` of `flat`: `spec` is a name of dptrain.optim.OPTIMIZERS
    ("sgd", "adamw") with `options` (lr: a number or a schedule, momentum, weight_decay,
    groups, ...), or a callable ``spec(flat, segments=...)`` such as
    ``functools.partial(AdamW, lr=1e-3)``. A bad option is a UsageError naming it."""
    if not callable(spec) and spec not in OPTIMIZERS:
        raise UsageError(f"optimizer {spec!r}: choose one of {', '.join(OPTIMIZERS)} or pass "
                         f"a callable (e.g. functools.partial(dptrain.optim.AdamW, lr=1e-3))")
    build = spec if callable(spec) else OPTIMIZERS[spec]
    if not callable(spec):
        taken = inspect.signature(build).parameters
        unknown = sorted(set(options) - set(taken))
        if unknown:
            known = [n for n in taken if n not in ("params", "segments")]
            raise UsageError(f"optimizer {spec!r} takes no {', '.join(unknown)} (it takes "
                             f"{', '.join(known)})")
    try:
        return build(flat, segments=segments, **options)
    except (TypeError, ValueError) as exc:  # BadArgument too: named with the optimizer
        raise UsageError(f"optimizer {getattr(spec, '__name__', spec)!r}: {exc}") from None


class DataParallel:
    """Wraps `model` for data-parallel training over `world` (default: ``dist.init()``).

    Arguments:
      optimizer   "adamw", "sgd" (with ``**options``: lr, weight_decay, momentum, ...) or a
                  callable ``(flat, segments=...) -> Optimizer``; ``lr`` a number or a
                  schedule (dptrain.optim.schedules)
      param_groups  PyTorch's list of dicts, ``[{"params": [...], "weight_decay": 0.0}]``
                  (parameters or their names; those in no group take the optimizer's own
                  options; dptrain.optim.no_decay_groups(model) leaves out biases and norms)
      precision   "auto" (bf16 where the device and every layer have it, else TF32 where
                  the GPU has it, else fp32), "fp32", "tf32", "bf16" or "fp16" (loss scaled)
      sync        "check" (default): stop with one line naming the parameters that differ
                  between ranks at the start (seed every rank alike, dptrain.manual_seed);
                  "broadcast": copy rank 0's parameters to every rank
      bucket_mb   size of the gradient-exchange buckets (MB), or "auto" (dptrain.distributed.buckets:
                  a smaller first bucket and a body size from the link and backward time)
      grad_exchange  "fp32" (default) or "bf16": reduce-scatter a 16-bit copy of each
                  bucket, its mean widened into the fp32 gradient shard (half the bytes)
      skip_nonfinite  steps with a NaN/inf loss or gradient that may be skipped (0: the
                  first one stops the run at the next ``step.metrics()``)
      loss_scale, loss_scale_interval  fp16's dynamic loss scale
      input_shapes  shapes of the model's input batches, the training batch's first (e.g.
                  [(256, 3, 32, 32)], evaluation batches' after it): given them, the GPU
                  builds only the kernels the model runs at those shapes (found by one
                  forward and backward of a copy that launches nothing) and the step's own,
                  a faster cold start; without, every kernel of the run's precision.
                  Others (a shape not named) are built on first use

    Only parameters with ``requires_grad`` are trained and exchanged (set it False to
    freeze a part of the model). Call the wrapper, ``ddp(x)``, in the step function: it
    feeds the model `precision`'s activations and returns float32 outputs.

    Reading the model between steps (see "Weights between steps" below) gives the current
    weights with nothing to call: ``ddp(x)``, ``ddp.eval()``, ``ddp.state_dict()``, and the
    wrapped model's (or any of its sub-modules') forward or ``state_dict()``. Under mpirun
    the first such read after a step is a collective: every rank makes it, in the same
    order (evaluate on every rank, or call ``ddp.eval()`` on every rank before an
    evaluation on rank 0 alone). ``save(dir)`` and ``load(dir)`` keep and restore the whole
    training state, at the same or another number of ranks.
    """

    # Weights between steps. A step ends with each rank having updated only its shard of
    # the flat parameters (ZeRO-1); the all-gather that makes them whole again opens the
    # next step, where it overlaps the forward. So the step itself leaves the other shards
    # a step behind, and anything that reads weights outside it must gather them first.
    # The step only sets a host flag (`_stale`, at world size > 1, in `stepping`); the
    # first read outside a step finds it and runs `sync_parameters` (a collective), which
    # clears it: the forward pre-hook of the root and of every module owning trained
    # parameters (not of the others, which would stop nn.fusion pairing them), the
    # state_dict pre-hook of every module, and `eval()`. Inside a step (`_in_step`) the
    # hooks do nothing, so a captured step runs exactly what it ran before, and a run that
    # never reads between steps never gathers outside them. Reading a parameter's array
    # directly (``p.data``) is not seen: call ``sync_parameters()`` first.

    def __init__(self, model, optimizer="adamw", *, world=None, precision="auto",
                 sync="check", bucket_mb=4.0, grad_exchange="fp32", skip_nonfinite=0, loss_scale=amp.INIT_SCALE,
                 loss_scale_interval=amp.INTERVAL, input_shapes=None, param_groups=None,
                 **options):
        if sync not in SYNC_MODES:
            raise UsageError(f"sync={sync!r}: choose one of {', '.join(SYNC_MODES)}")
        if grad_exchange not in EXCHANGES:
            raise UsageError(f"grad_exchange={grad_exchange!r}: choose one of "
                             f"{', '.join(EXCHANGES)}")
        self._stale = self._in_step = False  # see "Weights between steps"
        world = world or dist.current() or dist.init()
        self.protection = script.protection().attach(world)  # under dptrain.launch
        be = world.be
        if be is None:
            raise UsageError("DataParallel: the world has no backend; build it with "
                             "dptrain.distributed.init()")
        self.world, self.be, self.model = world, be, model.to(be.runtime.name)
        set_data_shard(world.rank, world.size)  # dropout draws the global batch's masks
        self.precision = self._resolve_precision(precision)
        self.dtype = amp.compute_dtype(self.precision)
        # the kernels of these dtypes, built in parallel once per host before the first step
        started = time.perf_counter()
        trace = _trace(self, input_shapes) if input_shapes else None
        report = first_on_host(world, lambda: be.runtime.prepare((np.float32, self.dtype),
                                                                  trace))
        self.prepare_s = time.perf_counter() - started
        self.prepare_report = report
        trained = [p for p in model.parameters() if p.requires_grad]
        if not trained:
            raise UsageError("DataParallel: the model has no parameter that requires grad")
        if sync == "check":
            _check_replicas(model, world, be)
        first, body = _bucket_bytes(bucket_mb, trained, world.size, grad_exchange)
        self.flat = FlatParameters(trained, world.size, body,
                                   shadow_dtype=amp.shadow_dtype(self.precision),
                                   first_bucket_bytes=first)
        if param_groups is not None:
            options["groups"] = _resolve_groups(param_groups, model)
        self.optimizer = make_optimizer(optimizer, self.flat,
                                        self.flat.shard_segments(world.rank), **options)
        self.reducer = Reducer(self.flat, world, model, exchange=grad_exchange)
        self._hook_reads(model, trained)
        self.reducer.broadcast_parameters()  # equal already when checked; casts the shadow
        for p in model.parameters():
            if not p.requires_grad:  # frozen: not in the flat buffer, so sent on its own
                world.comm.broadcast(p.data.reshape(-1), 0)
        broadcast_buffers(model, world.comm)
        self.scaler = (amp.LossScaler(be, loss_scale, loss_scale_interval)
                       if self.precision in amp.LOSS_SCALED else None)
        self.guard = NonFiniteGuard(self.optimizer, world.comm, skip_nonfinite, self.scaler)

    def _resolve_precision(self, precision):
        runtime = self.be.runtime
        try:
            runtime.set_precision("auto" if precision in amp.COMPUTE_DTYPES else precision)
            precision = amp.resolve(precision, runtime, self.model)
            amp.check_runtime(precision, runtime)
            amp.check_model(self.model, precision)
        except ValueError as exc:
            raise UsageError(str(exc).replace("--precision", "precision")) from None
        return precision

    # -- the forward, in the step's precision
    def __call__(self, *inputs):
        """model(*inputs) with float inputs cast to the compute dtype and float outputs
        back to float32 (mixed precision: 16-bit activations, fp32 loss); NumPy inputs
        (an evaluation batch) are copied to the device first (float64 as float32)."""
        inputs = [Tensor(self.be.asarray(x.astype(np.float32) if x.dtype == np.float64 else x))
                  if isinstance(x, np.ndarray) else x for x in inputs]  # host arrays too
        cast_in = [F.cast(x, self.dtype) if isinstance(x, Tensor) and x.dtype.kind == "f"
                   and self.dtype != np.float32 else x for x in inputs]
        return _to_float32(self.model(*cast_in))

    def compile(self, fn, *, capture=True, reduce=None, accumulate=1, clip_grad_norm=None):
        """The step that trains on one batch: ``step(batch)`` copies `batch` (an array, or
        a tuple, list or dict of arrays; host or device; float64 becomes float32) into fixed
        device buffers and runs ``fn(batch)`` on them as Tensors, then backward, the
        gradient exchange and the optimizer update.

        ``fn(batch)`` returns the loss (a scalar Tensor) or ``(loss, {name: value})`` with
        metrics the step sums on the device (scalars or fixed-shape Tensors); ``reduce``
        maps a metric to "mean" (default) or "sum" over the ranks; ``step.metrics()`` reads
        them. With ``capture`` (default) the step runs eagerly twice, is recorded once and
        then replayed (on the GPU, as a CUDA graph): `fn` must not read device values on the
        host, and every batch must have the first batch's shapes and dtypes (another shape
        is refused, naming both). ``capture=False`` runs `fn` eagerly every step (debugging).

        ``accumulate=k``: ``step(batch)`` splits each batch array's rows into k equal
        micro-batches and calls ``fn`` on each in turn, backward after each, with one
        gradient exchange and one update after the last (all k inside the captured step):
        one step on the whole batch in k times less activation memory, equal to float
        rounding (batch-norm statistics and dropout masks are the micro-batches' own).
        ``clip_grad_norm=c``: the averaged gradient scaled by min(1, c / its global norm)
        before the update, on the device (dptrain.run.clip); ``metrics()`` then has
        ``grad_norm``, the norm before clipping.
        """
        from dptrain.run.clip import ClipGradNorm
        from dptrain.run.compiled import CompiledStep

        clip = None
        if clip_grad_norm is not None:
            clip = ClipGradNorm(self.flat, self.optimizer.segments, self.world.comm,
                                clip_grad_norm)
        return CompiledStep(self, fn, capture=capture, reduce=reduce, accumulate=accumulate,
                            clip=clip)

    def capture(self, step):
        """`step` (a no-argument step) captured by the backend's runtime and replayed."""
        from dptrain.run.step import CAPTURE_WARMUP

        return self.be.runtime.capture(step, warmup=CAPTURE_WARMUP)

    # -- between steps
    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value):
        """A number (in place of any schedule) or a schedule (dptrain.optim.schedules): takes
        effect at the next step (written to the device before it, outside a graph)."""
        try:
            self.optimizer.set_lr(value)
        except ValueError as exc:
            raise UsageError(f"ddp.lr: {exc}") from None

    @contextlib.contextmanager
    def stepping(self):
        """Around each training step (CompiledStep): reads inside it are the step's own, and
        after it the shards other ranks updated are stale until the next read gathers them."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            self._stale = self.world.size > 1

    def _hook_reads(self, model, trained):
        mine = {id(p) for p in trained}
        for module in model.modules():
            module.register_state_dict_pre_hook(
                lambda _: self._before_read("state_dict()"))
            if module is model or any(id(p) in mine for p in module._params.values()):
                module.register_forward_pre_hook(
                    lambda _: self._before_read("a forward outside the step"))

    def _before_read(self, what):
        if self._stale and not self._in_step:
            self.sync_parameters(f"{what}, the first read of the weights after a step")

    def sync_parameters(self, what="ddp.sync_parameters()"):
        """Every rank's latest shard gathered (a collective: every rank calls it), rank 0's
        buffers broadcast: the whole model current, for evaluation or saving. Reads between
        steps call it themselves when a step ran since (see the class's docstring)."""
        with self.protection.watch(f"{what} (a collective: every rank makes it)", self.steps):
            self.reducer.sync_parameters()
            broadcast_buffers(self.model, self.world.comm)
        self._stale = False

    def state_dict(self):
        """The model's current weights (name -> NumPy array); the first read after a step,
        a collective under mpirun."""
        return self.model.state_dict()

    # -- the whole training state, for exact resume
    @property
    def steps(self) -> int:
        """Steps taken, those before a ``load`` included (the optimizer's count)."""
        return self.optimizer.steps

    def save(self, directory, keep: int = 3) -> Path:
        """Write the training state as checkpoint ``directory/step-NNNNNNNN`` (the format of
        ``train --checkpoint-dir``, dptrain.checkpoints) and keep the newest `keep` there;
        returns its path. A collective: every rank calls it at the same step, rank 0 writes.

        Saved: the model's weights and buffers, the optimizer's state gathered from every
        rank's shard, its step count and learning rate, fp16's loss scale, every rank's
        dropout generator and the initialisation generator. Not saved: where the loop is in
        its data (a pure function of the step for ``ArrayDataset.batches``: epoch
        ``steps // steps_per_epoch``, then skip ``steps % steps_per_epoch`` batches) and the
        metric sums since the last ``step.metrics()`` (save after a read to log on alike).
        Raises NonFiniteError rather than save past a step with a NaN/inf loss or gradient.
        """
        with self.protection.watch(f"ddp.save({str(directory)!r}) (a collective: every rank "
                                   f"calls it)", self.steps):
            return self._save(directory, keep)

    def _save(self, directory, keep):
        world, be = self.world, self.be
        self.guard.read(self.steps)  # never save past a non-finite step
        weights = {k: np.asarray(v) for k, v in self.state_dict().items()}
        optim = self.optimizer.gather_state(world.comm, self._trained_named())
        rng = _gather(world, to_json(be.runtime.get_rng_state()))
        path = step_dir(directory, self.steps)
        if not world.is_root:
            return path
        meta = {"world_size": world.size,
                "state": {"step": self.steps, "optimizer_steps": self.optimizer.steps,
                          "lr": self.optimizer.lr, "skipped": self.guard.skipped,
                          "loss_scale": self.scaler.state_dict() if self.scaler else None,
                          "rng": {"device": rng, "init": to_json(init_rng().bit_generator.state),
                                  "augment": None}},
                "library": {"optimizer": type(self.optimizer).__name__,
                            "precision": self.precision}}
        files = {MODEL: weights, OPTIM: {f"{key}:{name}": a for key, per in optim.items()
                                         for name, a in per.items()}}
        store = CheckpointStore(directory, keep)
        store.clean()
        written = store.write(self.steps, files, meta)
        store.prune()
        return written

    def load(self, path) -> int:
        """Restore the training state ``save`` wrote (or ``train --checkpoint-dir``, for the
        same model and optimizer): `path` is a checkpoint (``DIR/step-NNNNNNNN``) or a
        directory of them (the newest usable one). Returns the step to go on from. A
        collective: every rank calls it; rank 0 reads and sends. At the world size that
        saved it, training on is bitwise the uninterrupted run; at another, with the same
        global batch, the same to float rounding (each rank's dropout generator is then
        rank 0's, which every rank shares while the masks are drawn for the global batch).
        The buffers a compiled step reads are written in place: load before or between steps.
        """
        with self.protection.watch(f"ddp.load({str(path)!r}) (a collective: every rank "
                                   f"calls it)", self.steps):
            return self._load(path)

    def _load(self, path):
        world = self.world
        found = None
        if world.is_root:
            try:
                found = ("ok", _find_checkpoint(path))
            except UsageError as exc:
                found = ("error", str(exc))
        if world.size > 1:
            found = world.mpi_comm.bcast(found, root=0)
        if found[0] == "error":
            raise UsageError(found[1])
        where, manifest, files = found[1]
        state = manifest["state"]
        theirs = (manifest.get("library") or {}).get("optimizer")
        if theirs is not None and theirs != type(self.optimizer).__name__:
            raise UsageError(f"{where}: saved with optimizer {theirs}, this DataParallel has "
                             f"{type(self.optimizer).__name__}")
        restore_weights(files, where, self.model, self.optimizer, self._trained_named())
        self.optimizer.steps = int(state["optimizer_steps"])
        if state.get("lr") is not None:
            self.optimizer.lr = float(state["lr"])
        self.guard.skipped = int(state.get("skipped", 0))
        if self.scaler is not None and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])
        rng = from_json(state["rng"])
        device = rng["device"]
        self.be.runtime.set_rng_state(device[world.rank] if len(device) == world.size
                                      else device[0])
        init_rng().bit_generator.state = rng["init"]
        self._stale = False  # every rank holds the whole loaded weights
        return self.steps

    def _trained_named(self):
        """(name, parameter) of the parameters in the flat buffer (not the frozen ones)."""
        return [(n, p) for n, p in self.model.named_parameters() if id(p) in self.flat.offsets]

    def train(self, mode: bool = True):
        """The model's training mode; ``train(False)`` (``eval()``) also gathers the weights
        after a step (a collective under mpirun), so an evaluation that follows on some
        ranks only finds them current."""
        if not mode:
            self._before_read("ddp.eval()")
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)


def _resolve_groups(groups, model) -> list[dict]:
    """`groups` with each parameter name replaced by the parameter (UsageError naming an
    unknown one)."""
    if isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups):
        raise UsageError("param_groups: a list of dicts, e.g. [{'params': [...], "
                         "'weight_decay': 0.0}]")
    named = dict(model.named_parameters())
    out = []
    for i, group in enumerate(groups):
        params = []
        for p in group.get("params", ()):
            if isinstance(p, str):
                if p not in named:
                    raise UsageError(f"param_groups[{i}]: the model has no parameter {p!r}")
                p = named[p]
            params.append(p)
        out.append({**group, "params": params})
    return out


def _bucket_bytes(bucket_mb, params, n, exchange):
    """(first bucket bytes or None, body bucket bytes): `bucket_mb` MB each, or "auto"'s plan
    for the gradient bytes this exchange sends, scaled back to the fp32 buffer's bytes."""
    if bucket_mb == "auto":
        wire = 2 if exchange == "bf16" else 4
        first, body, _ = buckets.plan([p.size * wire for p in reversed(params)], n)
        return first * 4 // wire, body * 4 // wire
    if isinstance(bucket_mb, str) or not bucket_mb > 0:
        raise UsageError(f"bucket_mb={bucket_mb!r}: a positive number of MB, or 'auto'")
    return None, int(bucket_mb * 2**20)


def _trace(ddp, input_shapes):
    """The model run as a step will run it, for the backend's prepare to record its kernels:
    forward and backward on the first shape, forward in eval mode on every shape, on a copy
    (its parameters, gradients and batch-norm estimates are the copy's; sync-BN's
    communicator is left out, so no collective runs)."""
    shapes = [tuple(int(n) for n in s) for s in input_shapes]
    be = ddp.be

    def trace():
        memo = {id(m.comm): None for m in ddp.model.modules()
                if getattr(m, "comm", None) is not None}
        # the twin's arrays copied by the copy engine (a CuPy copy compiles a kernel first)
        for t in [*ddp.model.parameters(), *ddp.model.buffers()]:
            for a in (getattr(t, "data", None), getattr(t.grad, "data", None)):
                if a is not None and id(a) not in memo:
                    memo[id(a)] = be.runtime.clone(a)
        twin = copy.copy(ddp)
        twin.model = copy.deepcopy(ddp.model, memo)
        for i, shape in enumerate(shapes):
            twin.model.train(i == 0)
            with contextlib.nullcontext() if i == 0 else no_grad():
                out = twin(Tensor(be.zeros(shape, np.float32)))
            if i == 0 and isinstance(out, Tensor) and out.requires_grad:
                out.backward(Tensor(be.zeros(out.shape, np.float32)))

    return trace


def _gather(world, mine) -> list:
    """Every rank's `mine` (a host object), in rank order."""
    return world.mpi_comm.allgather(mine) if world.size > 1 else [mine]


def _find_checkpoint(path):
    """(where, manifest, files) of the checkpoint at `path`, or of the newest usable one in
    the directory `path`; UsageError naming the path and why otherwise."""
    path = Path(path)
    where = f"load {path}"
    if (path / MANIFEST).exists():
        try:
            return (where, *load(path))
        except CheckpointError as exc:
            raise UsageError(f"{where}: {exc}") from None
    skipped = []
    found = CheckpointStore(path).latest(warn=skipped.append)
    if found is None:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise UsageError(f"{where}: no checkpoint there{why}")
    for message in skipped:  # newer ones that failed a check
        warnings.warn(f"dptrain: {message}", stacklevel=3)
    return (f"load {found[0]}", *found[1:])


def _to_float32(out):
    if isinstance(out, Tensor):
        return F.cast(out, np.float32) if out.dtype.kind == "f" or out.dtype == BFLOAT16 else out
    if isinstance(out, (tuple, list)):
        return type(out)(_to_float32(o) for o in out)
    return out


def _check_replicas(model, world, be):
    """UsageError on every rank naming the parameters whose values differ from rank 0's."""
    if world.size == 1:
        return
    named = list(model.named_parameters())
    differs = np.zeros(len(named), np.float32)
    for i, (_, p) in enumerate(named):
        ref = be.copy(p.data).reshape(-1)
        world.comm.broadcast(ref, 0)
        differs[i] = not np.array_equal(be.to_numpy(ref), be.to_numpy(p.data).reshape(-1))
    flags = be.asarray(differs)
    world.comm.all_reduce(flags, "sum")
    bad = [name for (name, _), f in zip(named, be.to_numpy(flags)) if f > 0]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise UsageError(f"parameters differ between ranks at the start: "
                         f"{', '.join(bad[:3])}{more} (seed every rank alike with "
                         f"dptrain.manual_seed before building the model, or pass "
                         f"sync='broadcast' to copy rank 0's)")


__all__ = ["DataParallel", "make_optimizer"]
