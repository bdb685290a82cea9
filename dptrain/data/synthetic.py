"""The built-in synthetic dataset: 48x48 grayscale images of 7 shape classes.

Image i of a stream is a pure function of (seed, i): every per-image parameter is a
splitmix64 hash of (seed, i) computed in uint64 NumPy arithmetic, so any subset of
indices can be generated on its own (one rank's slice, one worker's chunk) and equals
the same rows of the whole set. The hash, not NumPy's generators, defines the data,
so a NumPy upgrade does not change it.

Rasterising is vectorised over a chunk of images: each shape is a signed distance
(negative inside, in pixels) built from terms that are linear in x and y, so a term is
an outer sum of a (n, 1, W) row and an (n, H, 1) column -- one full-size array op.
Coverage is a one-pixel smooth step of the distance (antialiasing). Distractor strokes
are rows of points splatted bilinearly, costing little next to the image.

``SyntheticSpec`` holds every knob of difficulty; ``SyntheticDataset`` adds the
train/val streams and normalisation constants, and keeps its arrays in the on-disk cache
(``dptrain.data.cache``), generated over worker processes (``dptrain.data.parallel``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from dptrain.data import cache as disk_cache
from dptrain.data.parallel import auto_workers, render_parallel

# Bump when the drawing code changes the pixels: it is part of the cache key.
GENERATOR_VERSION = 1

SIZE = 48
PIXELS = SIZE * SIZE
CLASSES = ("circle", "square", "triangle", "star", "plus", "crescent", "arrow")
NUM_CLASSES = len(CLASSES)
CHUNK = 256  # images rendered together: big enough to amortise Python, small enough for cache
SPLITS = ("train", "val")


@dataclass(frozen=True)
class SyntheticSpec:
    """Every parameter of difficulty, in one place. Ranges are (low, high), drawn uniformly.

    Intensities are fractions of full scale (1.0 = 255); lengths are pixels. Softmax
    regression on raw pixels stays near chance (random polarity leaves no class signal in
    any single pixel). With these defaults the reference CNN (PyTorch, AdamW 2e-3, batch 64)
    reached 79% validation accuracy after 3 epochs of 6,000 images; a harder setting
    (contrast 0.15-0.55, noise 0.03-0.14, 7 distractors) needs about 50,000 images and 6
    epochs to pass 95%, too long for a CPU quickstart.
    """
    radius: tuple = (8.0, 20.0)          # shape size (circumradius)
    margin: float = 0.8                  # centre stays >= margin*radius from the border
    outline_prob: float = 0.5            # probability of an outlined (not filled) shape
    stroke: tuple = (1.5, 3.5)           # outline width
    background: tuple = (0.2, 0.8)       # background level at the centre
    gradient: float = 0.15               # max background change from one edge to the other
    contrast: tuple = (0.45, 0.8)        # |shape - background|; polarity is random
    noise: tuple = (0.02, 0.06)          # std of additive per-pixel Gaussian noise
    distractors: int = 3                 # max distractor strokes per image (0..this, uniform)
    distractor_length: tuple = (1.0, 12.0)   # short ones read as dots
    distractor_contrast: tuple = (0.4, 1.0)  # relative to the shape's contrast

    def __post_init__(self):
        # Lists become tuples (hashable, one cache key per value) and ranges are checked.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (tuple, list)):
                lo, hi = (float(v) for v in value)
                if lo > hi:
                    raise ValueError(f"SyntheticSpec.{field.name}: low {lo} > high {hi}")
                object.__setattr__(self, field.name, (lo, hi))
        if self.distractors < 0:
            raise ValueError("SyntheticSpec.distractors must be >= 0")

    def key(self) -> str:
        """Short hash of the spec and the generator version, for cache file names."""
        text = repr((GENERATOR_VERSION, dataclasses.astuple(self)))
        return hashlib.sha1(text.encode()).hexdigest()[:10]


DEFAULT_SPEC = SyntheticSpec()

# ---------------------------------------------------------------------------- hashing

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wraps modulo 2**64)."""
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def _key(seed: int, salt: int = 0) -> np.uint64:
    return _mix(np.array([(seed ^ salt) & _MASK64], np.uint64))[0]


def _uniforms(seed: int, indices: np.ndarray, count: int) -> np.ndarray:
    """(n, count) float64 in [0, 1): a splitmix64 stream started from hash(seed, i)."""
    with np.errstate(over="ignore"):
        base = _mix(indices.astype(np.uint64) * _GOLDEN + _key(seed))
        steps = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        z = _mix(base[:, None] + steps[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def labels_for(seed: int, indices) -> np.ndarray:
    """Labels, balanced exactly: each aligned block of 7 indices holds a hash-chosen
    permutation of the 7 classes."""
    indices = _as_indices(indices)
    block = indices // NUM_CLASSES
    with np.errstate(over="ignore"):
        slots = block.astype(np.uint64)[:, None] * np.uint64(NUM_CLASSES) + np.arange(
            NUM_CLASSES, dtype=np.uint64)
        keys = _mix(slots * _GOLDEN + _key(seed, 0x1ABE1))
    perm = np.argsort(keys, axis=1, kind="stable")
    return perm[np.arange(len(indices)), indices % NUM_CLASSES].astype(np.int64)


def split_seed(seed: int, split: str) -> int:
    """The stream seed of a dataset split: train and val never share a stream."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return int(_key(seed, 0x5EED0000 + SPLITS.index(split) + 1))


@functools.lru_cache(maxsize=1)
def _noise_table() -> np.ndarray:
    """Windows of 2304 consecutive values: one window is one image's unit noise.

    Gaussian by Box-Muller from our own hash, so it does not depend on NumPy's
    generators; a window is picked by a fancy index (a memcpy), far cheaper than
    hashing every pixel."""
    n = 1 << 20
    u = _uniforms(0x0A15E, np.arange(n // 2 + PIXELS), 2)
    r = np.sqrt(-2.0 * np.log1p(-u[:, 0]))
    table = np.concatenate([r * np.cos(2 * np.pi * u[:, 1]), r * np.sin(2 * np.pi * u[:, 1])])
    table = table[: n + PIXELS].astype(np.float32)
    return np.lib.stride_tricks.sliding_window_view(table, PIXELS)[:n]


# --------------------------------------------------------------------------- geometry
# A shape function gets pixel offsets from the shape centre, dx (n,1,W) and dy (n,H,1),
# the rotation angle and size R (n,) and returns the signed distance (n,H,W) float32.

def _col(a):
    """Per-image values (n,) -- or one scalar -- shaped to broadcast over (n, H, W)."""
    return np.asarray(a, np.float32).reshape(-1, 1, 1)


def _plane(dx, dy, theta, nu, nv, offset):
    """nu*u + nv*v - offset in the frame rotated by theta: one full-size op."""
    c, s = np.cos(theta), np.sin(theta)
    a = nu * c - nv * s  # coefficient of dx
    b = nu * s + nv * c  # coefficient of dy
    return (dx * _col(a) - _col(offset)) + dy * _col(b)


def _uv(dx, dy, theta):
    one, zero = np.ones_like(theta), np.zeros_like(theta)
    return _plane(dx, dy, theta, one, zero, zero), _plane(dx, dy, theta, zero, one, zero)


def _max_planes(dx, dy, theta, angles, offsets):
    """Convex polygon: the largest of its half-plane distances (exact inside)."""
    d = None
    for a, off in zip(angles, offsets):
        p = _plane(dx, dy, theta, np.cos(a), np.sin(a), off)
        d = p if d is None else np.maximum(d, p, out=d)
    return d


def _circle(dx, dy, theta, R, cx=0.0, cy=0.0):
    d = ((dx - _col(cx)) ** 2) + ((dy - _col(cy)) ** 2)
    np.sqrt(d, out=d)
    d -= _col(R)
    return d


def _shape_circle(dx, dy, theta, R):
    return _circle(dx, dy, theta, 0.85 * R)


def _shape_square(dx, dy, theta, R):
    u, v = _uv(dx, dy, theta)
    np.abs(u, out=u)
    np.abs(v, out=v)
    np.maximum(u, v, out=u)
    u -= _col(0.72 * R)
    return u


def _shape_triangle(dx, dy, theta, R):
    angles = [2 * np.pi * k / 3 for k in range(3)]
    return _max_planes(dx, dy, theta, angles, [0.5 * R] * 3)


def _shape_star(dx, dy, theta, R):
    # A pentagram's five edge lines: inside the star means outside at most one of
    # them, so the distance is the second largest of the five half-plane distances.
    h = 1.05 * R * np.cos(2 * np.pi / 5)
    first = second = None
    for k in range(5):
        a = 2 * np.pi * k / 5
        p = _plane(dx, dy, theta, np.cos(a), np.sin(a), h)
        if first is None:
            first, second = p, np.full_like(p, -np.inf)
            continue
        np.maximum(second, np.minimum(first, p), out=second)
        np.maximum(first, p, out=first)
    return second


def _shape_plus(dx, dy, theta, R):
    u, v = _uv(dx, dy, theta)
    np.abs(u, out=u)
    np.abs(v, out=v)
    arm, half = _col(0.9 * R), _col(0.28 * R)
    bar1 = np.maximum(u - arm, v - half)
    bar2 = np.maximum(u - half, v - arm)
    return np.minimum(bar1, bar2, out=bar1)


def _shape_crescent(dx, dy, theta, R):
    r = 0.85 * R
    outer = _circle(dx, dy, theta, r)
    bite = _circle(dx, dy, theta, 0.8 * r, 0.45 * r * np.cos(theta), 0.45 * r * np.sin(theta))
    np.negative(bite, out=bite)
    return np.maximum(outer, bite, out=outer)


def _shape_arrow(dx, dy, theta, R):
    u, v = _uv(dx, dy, theta)
    # Shaft: u in [-0.9R, 0.25R], |v| <= 0.14R.
    shaft = np.abs(u - _col(-0.325 * R)) - _col(0.575 * R)
    np.maximum(shaft, np.abs(v) - _col(0.14 * R), out=shaft)
    # Head: triangle with its tip at u = 0.9R and its base at u = 0.15R, half-width 0.5R.
    tip, base, half = 0.9 * R, 0.15 * R, 0.5 * R
    n = np.hypot(half, tip - base)  # edge normals (half, +-(tip-base)) / n, through the tip
    nu, nv = half / n, (tip - base) / n
    zero, one = np.zeros_like(R), np.ones_like(R)
    head = _plane(dx, dy, theta, -one, zero, -base)
    np.maximum(head, _plane(dx, dy, theta, nu, nv, nu * tip), out=head)
    np.maximum(head, _plane(dx, dy, theta, nu, -nv, nu * tip), out=head)
    return np.minimum(shaft, head, out=shaft)


_SHAPES = (_shape_circle, _shape_square, _shape_triangle, _shape_star, _shape_plus,
           _shape_crescent, _shape_arrow)
assert len(_SHAPES) == NUM_CLASSES

# ------------------------------------------------------------------------- rendering

# Column layout of the per-image uniforms.
_P_RADIUS, _P_CX, _P_CY, _P_THETA, _P_OUTLINE, _P_STROKE, _P_BG, _P_GX, _P_GY, \
    _P_CONTRAST, _P_POLARITY, _P_NOISE, _P_NOISE_AT, _P_NDIST = range(14)
_P_DIST = 14       # then 5 columns per distractor: x, y, angle, length, contrast
_SPLAT_POINTS = 16  # points per distractor stroke


def _lerp(u, lo_hi):
    lo, hi = lo_hi
    return lo + (hi - lo) * u


def _render_chunk(seed: int, indices: np.ndarray, labels: np.ndarray,
                  spec: SyntheticSpec) -> np.ndarray:
    n = len(indices)
    k_max = spec.distractors
    u = _uniforms(seed, indices, _P_DIST + 5 * k_max)
    grid = np.arange(SIZE, dtype=np.float32)

    R = _lerp(u[:, _P_RADIUS], spec.radius)
    lo, hi = spec.margin * R, (SIZE - 1) - spec.margin * R
    cx, cy = lo + (hi - lo) * u[:, _P_CX], lo + (hi - lo) * u[:, _P_CY]
    theta = 2 * np.pi * u[:, _P_THETA]
    dx = grid[None, None, :] - _col(cx)
    dy = grid[None, :, None] - _col(cy)

    # Signed distance of each image's shape, one class at a time.
    dist = np.empty((n, SIZE, SIZE), np.float32)
    for c, shape in enumerate(_SHAPES):
        rows = np.flatnonzero(labels == c)
        if len(rows):
            dist[rows] = shape(dx[rows], dy[rows], theta[rows], R[rows])
    outline = u[:, _P_OUTLINE] < spec.outline_prob
    if outline.any():
        half_width = _col(0.5 * _lerp(u[outline, _P_STROKE], spec.stroke))
        dist[outline] = np.abs(dist[outline]) - half_width
    # Coverage: a smooth step one pixel wide across the boundary.
    cover = np.subtract(np.float32(0.5), dist, out=dist)
    np.clip(cover, 0.0, 1.0, out=cover)

    if k_max:
        _add_distractors(cover, u, spec)
        np.minimum(cover, 1.0, out=cover)

    # Intensities in 0..255: background plane, shape of random polarity, noise.
    bg = _lerp(u[:, _P_BG], spec.background)
    polarity = np.where(u[:, _P_POLARITY] < 0.5, -1.0, 1.0)
    contrast = _lerp(u[:, _P_CONTRAST], spec.contrast)
    fg = bg + polarity * contrast
    flip = (fg < 0.0) | (fg > 1.0)  # keep the shape inside the displayable range
    contrast = np.where(flip, -polarity, polarity) * contrast
    slope = spec.gradient / (SIZE - 1)
    gx = slope * (2 * u[:, _P_GX] - 1)
    gy = slope * (2 * u[:, _P_GY] - 1)
    centre = (SIZE - 1) / 2
    row = _col(255 * gx) * (grid[None, None, :] - centre) + _col(255 * bg + 0.5)  # +0.5: round
    col = _col(255 * gy) * (grid[None, :, None] - centre)
    img = cover
    img *= _col(255 * contrast)
    img += row
    img += col
    sigma = _lerp(u[:, _P_NOISE], spec.noise)
    table = _noise_table()
    at = (u[:, _P_NOISE_AT] * len(table)).astype(np.int64)
    noise = table[at].reshape(n, SIZE, SIZE)
    noise *= _col(255 * sigma)  # in place: fresh full-size arrays cost page faults
    img += noise
    np.maximum(img, 0.0, out=img)
    np.minimum(img, 255.0, out=img)
    return img.astype(np.uint8)


def _add_distractors(cover, u, spec):
    """Add short strokes (very short ones read as dots) to the coverage, in place.

    Each stroke is a row of points splatted bilinearly (np.add.at): the cost scales with
    the strokes' length, not the image area."""
    n, k_max = len(cover), spec.distractors
    count = np.floor(u[:, _P_NDIST] * (k_max + 1))
    img, slot = np.nonzero(np.arange(k_max)[None, :] < count[:, None])
    p = u[:, _P_DIST:].reshape(n, k_max, 5)[img, slot]
    length = _lerp(p[:, 3], spec.distractor_length)
    ang = np.pi * p[:, 2]
    t = np.linspace(-0.5, 0.5, _SPLAT_POINTS)
    px = (p[:, 0] * (SIZE - 1))[:, None] + (length * np.cos(ang))[:, None] * t
    py = (p[:, 1] * (SIZE - 1))[:, None] + (length * np.sin(ang))[:, None] * t
    # Each point deposits length/points of ink, so a line is ~1 px wide at full weight.
    ink = (_lerp(p[:, 4], spec.distractor_contrast) * np.maximum(length, 1.5)
           / _SPLAT_POINTS)[:, None]
    x0, y0 = np.floor(px), np.floor(py)
    fx, fy = px - x0, py - y0
    x0, y0 = x0.astype(np.int64), y0.astype(np.int64)
    base = img[:, None] * PIXELS
    flat = cover.reshape(-1)
    for ox, oy, wt in ((0, 0, (1 - fx) * (1 - fy)), (1, 0, fx * (1 - fy)),
                       (0, 1, (1 - fx) * fy), (1, 1, fx * fy)):
        xi, yi = x0 + ox, y0 + oy
        inside = (xi >= 0) & (xi < SIZE) & (yi >= 0) & (yi < SIZE)
        np.add.at(flat, (base + yi * SIZE + xi)[inside], (ink * wt)[inside].astype(np.float32))


# ------------------------------------------------------------------------ public API

def _as_indices(indices) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {idx.shape}")
    if idx.size == 0:
        return idx.astype(np.int64)
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices must be integers, got dtype {idx.dtype}")
    if idx.min() < 0:
        raise ValueError("indices must be non-negative")
    return idx.astype(np.int64)


def generate(seed: int, indices, spec: SyntheticSpec = DEFAULT_SPEC, progress=None):
    """Images (n, 1, 48, 48) uint8 and labels (n,) int64 for the given indices of stream
    ``seed``. Row j depends only on (seed, indices[j], spec). ``progress(done, total)``
    is called after each chunk, if given."""
    idx = _as_indices(indices)
    labels = labels_for(seed, idx)
    images = np.empty((len(idx), 1, SIZE, SIZE), np.uint8)
    for start in range(0, len(idx), CHUNK):
        stop = min(start + CHUNK, len(idx))
        images[start:stop, 0] = _render_chunk(seed, idx[start:stop], labels[start:stop], spec)
        if progress is not None:
            progress(stop, len(idx))
    return images, labels


def generate_parallel(seed: int, indices, workers: int | None = None,
                      spec: SyntheticSpec = DEFAULT_SPEC, progress=None, chunk: int = 8192):
    """Same result as ``generate``, split over forked worker processes
    (``dptrain.data.parallel.render_parallel``; one process for one worker or small
    counts)."""
    idx = _as_indices(indices)
    _noise_table()  # built once here, inherited by every worker

    def render(part, progress=None):
        return generate(seed, part, spec, progress)[0]

    images = render_parallel(render, idx, (1, SIZE, SIZE), workers, progress, chunk)
    return images, labels_for(seed, idx)


# normalization(DEFAULT_SPEC) as computed (tests/data/test_synthetic.py renders it again):
# rendering its 4096 images took a quarter of a second of every run's start.
DEFAULT_NORMALIZATION = (0.4996, 0.2229)


def normalization(spec: SyntheticSpec = DEFAULT_SPEC) -> tuple[float, float]:
    """(mean, std) of [0,1]-scaled pixels, from a fixed sample of 4096 images, so every
    rank and every subset normalises alike."""
    return DEFAULT_NORMALIZATION if spec == DEFAULT_SPEC else rendered_normalization(spec)


@functools.lru_cache(maxsize=8)
def rendered_normalization(spec: SyntheticSpec) -> tuple[float, float]:
    """normalization(spec), computed: the sample rendered and measured."""
    images, _ = generate(0x0A11, np.arange(4096), spec)
    x = images.astype(np.float64) / 255.0
    return round(float(x.mean()), 4), round(float(x.std()), 4)


# ---------------------------------------------------------------------------- dataset

class SyntheticDataset:
    """One split of the synthetic shapes dataset.

    ``images`` (n, 1, 48, 48) uint8 and ``labels`` (n,) int64 hold rows 0..n_images-1 of
    the split's stream, or only ``indices`` of it when given (nothing is cached then).
    ``mean``/``std`` normalise [0,1]-scaled pixels. The cache lives under ``cache_dir``
    (default ``$DPTRAIN_CACHE`` or ``~/.cache/dptrain``, see ``dptrain.data.cache``);
    ``cache=False`` skips it.
    Images loaded from the cache are a read-only memory map (``from_cache`` is True):
    ranks on one host then share one copy in the page cache.
    """
    num_classes = NUM_CLASSES
    classes = class_names = CLASSES
    image_shape = (1, SIZE, SIZE)

    def __init__(self, split: str, n_images: int, seed: int = 0, cache_dir: str | None = None,
                 indices=None, spec: SyntheticSpec = DEFAULT_SPEC, cache: bool = True,
                 workers: int | None = None, progress=None):
        if not isinstance(n_images, (int, np.integer)) or n_images <= 0:
            raise ValueError(f"n_images must be a positive integer, got {n_images!r}")
        self.split, self.n_images, self.seed, self.spec = split, int(n_images), int(seed), spec
        self.stream_seed = split_seed(self.seed, split)
        self.mean, self.std = normalization(spec)
        self.from_cache = False
        if indices is not None:
            idx = _as_indices(indices)
            if idx.size and idx.max() >= self.n_images:
                raise ValueError(f"indices must be < n_images={self.n_images}")
            self.indices = idx
            self.images, self.labels = self._generate(idx, workers, progress)
            return
        self.indices = None
        cache_dir = cache_dir or disk_cache.default_cache_dir()
        name = self.cache_name(spec, self.seed, split)
        found = None
        if cache:
            found = disk_cache.load(cache_dir, name, self.n_images, self.image_shape)
        if found is not None:
            self.images, self.labels = found
            self.from_cache = True
            return
        self.images, self.labels = self._generate(np.arange(self.n_images), workers, progress)
        if cache:
            disk_cache.store(cache_dir, name, self.images, self.labels)

    @staticmethod
    def cache_name(spec: SyntheticSpec, seed: int, split: str) -> str:
        """The cache entry name: images are a pure function of (spec, seed, split, index),
        so a larger entry serves a smaller set (its prefix)."""
        return f"synthetic-{spec.key()}-seed{seed}-{split}"

    def _generate(self, idx, workers, progress):
        if workers is None:
            workers = auto_workers(len(idx))
        return generate_parallel(self.stream_seed, idx, workers, self.spec, progress)

    def subset(self, indices) -> "SyntheticDataset":
        """A dataset of just these rows (indices into this split's stream)."""
        return SyntheticDataset(self.split, self.n_images, self.seed, indices=indices,
                                spec=self.spec, cache=False)

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return (f"SyntheticDataset(split={self.split!r}, n={len(self)}, seed={self.seed}, "
                f"spec={self.spec.key()})")
