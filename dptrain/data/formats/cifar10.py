"""CIFAR-10: ``--data-dir`` is (or holds) ``cifar-10-batches-py`` -- the python batches
``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta`` -- or
``cifar-10-batches-bin`` -- ``data_batch_1.bin`` .. ``data_batch_5.bin``, ``test_batch.bin``
and ``batches.meta.txt``. The test batch is the validation split.

The python batches are pickles. They are read by a restricted unpickler that builds only
dicts, lists, strings, bytes, ints and NumPy arrays of plain numeric dtypes; any other
object in the stream (the way a malicious pickle runs code) is refused with an error
naming the file, and nothing from it is executed. The result must then have the expected
shape: ``data`` uint8 (n, 3072), ``labels`` n ints in [0, 10).
"""
from __future__ import annotations

import codecs
import io
import os
import pickle

import numpy as np

from dptrain.data.formats.common import Decoded, check_labels, convert_channels, resize
from dptrain.errors import UsageError

NAME = "cifar10"
VERSION = 1
NUM_CLASSES = 10
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")
TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST = "test_batch"
RECORD = 1 + 3 * 32 * 32  # binary: one label byte, then the 32x32 R, G and B planes


def _layout(data_dir: str):
    """("py" | "bin", folder) of the first folder that holds a complete set of batches."""
    if not os.path.isdir(data_dir):
        raise UsageError(f"--data-dir {data_dir}: not a directory (CIFAR-10 needs its batches)")
    for folder in (data_dir, os.path.join(data_dir, "cifar-10-batches-py"),
                   os.path.join(data_dir, "cifar-10-batches-bin")):
        for kind, suffix in (("py", ""), ("bin", ".bin")):
            names = [n + suffix for n in TRAIN + (TEST,)]
            if all(os.path.isfile(os.path.join(folder, n)) for n in names):
                return kind, folder
    raise UsageError(f"--data-dir {data_dir}: no CIFAR-10 batches found (data_batch_1 .. 5 and "
                     f"test_batch, python or .bin)")


def sources(data_dir: str) -> list[str]:
    kind, folder = _layout(data_dir)
    suffix = ".bin" if kind == "bin" else ""
    files = [os.path.join(folder, n + suffix) for n in TRAIN + (TEST,)]
    meta = os.path.join(folder, "batches.meta.txt" if kind == "bin" else "batches.meta")
    return files + ([meta] if os.path.isfile(meta) else [])


# ----------------------------------------------------------------------------- safe unpickling
# The pure-Python unpickler, so that BUILD (set an object's state) can be checked too: it is
# allowed only on arrays (with a plain numeric dtype and raw bytes) and on dtypes (whose
# state may only restate the byte order), never on anything else.

_NUMERIC = set("biuf")


class _NdarrayMarker:
    """Stands for numpy.ndarray in the stream: only _reconstruct may use it."""


def _numeric(dt) -> np.dtype:
    dt = np.dtype(dt)
    if dt.kind not in _NUMERIC or dt.fields is not None or dt.subdtype is not None \
            or dt.hasobject:
        raise pickle.UnpicklingError(f"refusing dtype {dt!r}")
    return dt


def _reconstruct(cls, shape, dtype):
    if cls is not _NdarrayMarker:
        raise pickle.UnpicklingError(f"refusing to build {cls!r}")
    return np.ndarray.__new__(np.ndarray, (0,), _dtype(dtype))


def _frombuffer(buf, dtype, shape, order):
    if isinstance(buf, pickle.PickleBuffer):
        buf = bytes(buf.raw())
    if not isinstance(buf, (bytes, bytearray)) or not isinstance(shape, tuple) \
            or order not in ("C", "F"):
        raise pickle.UnpicklingError("refusing an array buffer")
    dt = _numeric(dtype)
    if len(buf) != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
        raise pickle.UnpicklingError("array data of the wrong length")
    return np.frombuffer(bytes(buf), dt).reshape(shape, order=order).copy()


def _dtype(spec, align=False, copy=False):
    if isinstance(spec, bytes):
        spec = spec.decode("ascii")
    if not isinstance(spec, str):
        raise pickle.UnpicklingError(f"refusing dtype {spec!r}")
    return _numeric(spec)


def _encode(text, encoding="latin1"):
    if not isinstance(text, str) or codecs.lookup(encoding).name not in ("latin-1", "iso8859-1"):
        raise pickle.UnpicklingError("refusing _codecs.encode other than latin-1")
    return text.encode("latin-1")


class _SafeUnpickler(pickle._Unpickler):
    """Only the globals a NumPy array's pickle needs, each replaced by a checked builder."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.numeric", "_frombuffer"): _frombuffer,
        ("numpy._core.numeric", "_frombuffer"): _frombuffer,
        ("numpy", "ndarray"): _NdarrayMarker,
        ("numpy", "dtype"): _dtype,
        ("_codecs", "encode"): _encode,
    }

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing the global {module}.{name}") from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refusing persistent ids")

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, np.dtype):
            order = state[1] if isinstance(state, tuple) and len(state) > 1 else None
            order = order.decode("ascii", "replace") if isinstance(order, bytes) else order
            native = "<" if np.little_endian else ">"
            if order not in ("=", "|", native) and not (inst.itemsize == 1 and order in "<>"):
                raise pickle.UnpicklingError(f"refusing a dtype state (byte order {order!r})")
            return  # the dtype was built whole by _dtype; its state adds nothing we take
        if type(inst) is np.ndarray and isinstance(state, tuple) and len(state) == 5:
            version, shape, dt, fortran, raw = state
            if not isinstance(dt, np.dtype) or not isinstance(raw, (bytes, bytearray)) \
                    or not isinstance(shape, tuple) \
                    or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise pickle.UnpicklingError("refusing an array state")
            _numeric(dt)
            if len(raw) != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
                raise pickle.UnpicklingError("array data of the wrong length")
            inst.__setstate__((version, shape, dt, bool(fortran), bytes(raw)))
            return
        raise pickle.UnpicklingError(f"refusing to set the state of a {type(inst).__name__}")

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def safe_unpickle(path: str):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise UsageError(f"{path}: cannot read ({err.strerror})") from None
    try:
        return _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError, OverflowError) as err:
        raise UsageError(f"{path}: not a CIFAR-10 python batch ({type(err).__name__}: "
                         f"{err})") from None


def _get(d: dict, key: str):
    for k in (key, key.encode()):
        if k in d:
            return d[k]
    return None


def _read_py(path: str):
    batch = safe_unpickle(path)
    if not isinstance(batch, dict):
        raise UsageError(f"{path}: not a CIFAR-10 python batch (a {type(batch).__name__}, not "
                         f"a dict)")
    data, labels = _get(batch, "data"), _get(batch, "labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise UsageError(f"{path}: 'data' must be uint8 (n, 3072), got {got}")
    if not isinstance(labels, (list, np.ndarray)) or len(labels) != len(data) or not all(
            isinstance(v, (int, np.integer)) for v in labels):
        raise UsageError(f"{path}: 'labels' must be {len(data)} integers")
    labels = np.asarray(labels, np.int64)
    check_labels(labels, NUM_CLASSES, path)
    return data.reshape(-1, 3, 32, 32), labels


def _read_bin(path: str):
    try:
        raw = np.fromfile(path, np.uint8)
    except OSError as err:
        raise UsageError(f"{path}: cannot read ({err.strerror})") from None
    if raw.size == 0 or raw.size % RECORD:
        raise UsageError(f"{path}: {raw.size} bytes is not a whole number of {RECORD}-byte "
                         f"CIFAR-10 records (truncated or not a CIFAR-10 binary batch)")
    records = raw.reshape(-1, RECORD)
    labels = records[:, 0].astype(np.int64)
    check_labels(labels, NUM_CLASSES, path)
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def _class_names(kind: str, folder: str) -> tuple:
    if kind == "bin":
        path = os.path.join(folder, "batches.meta.txt")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                names = [n.strip().decode("utf-8", "replace") for n in f.read().splitlines()]
            names = [n for n in names if n]
            if len(names) == NUM_CLASSES:
                return tuple(names)
        return CLASSES
    path = os.path.join(folder, "batches.meta")
    if os.path.isfile(path):
        meta = safe_unpickle(path)
        names = _get(meta, "label_names") if isinstance(meta, dict) else None
        if isinstance(names, list) and len(names) == NUM_CLASSES:
            return tuple(n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n)
                         for n in names)
    return CLASSES


def decode(data_dir: str, channels=None, image_size=None, on_bad_image="error") -> Decoded:
    kind, folder = _layout(data_dir)
    read = _read_bin if kind == "bin" else _read_py
    suffix = ".bin" if kind == "bin" else ""
    parts = []
    for names in (TRAIN, (TEST,)):
        pieces = [read(os.path.join(folder, n + suffix)) for n in names]
        images = np.concatenate([p[0] for p in pieces])
        labels = np.concatenate([p[1] for p in pieces])
        images = resize(convert_channels(images, channels), image_size)
        parts.append((np.ascontiguousarray(images), labels))
    return Decoded(parts[0], parts[1], _class_names(kind, folder))
