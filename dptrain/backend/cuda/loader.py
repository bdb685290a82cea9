"""Compile the CUDA sources in kernels/ once per process and hand out their functions.

Every launcher in the cuda backend gets its kernels here (through ``launch.kernel``):

    fn = loader.function("elementwise.cu", "map2_kernel<float, Add>")

The first request for a kernel compiles its file's part with NVRTC through
``cupy.RawModule``: a file's template instantiations (its ``// instantiate:`` lines, handed
over as ``name_expressions``) are split by element family (float and the type-free
kernels; ``double``; ``__half``; ``__nv_bfloat16``) and each family into modules of at most CHUNK
instantiations, so the 16-bit instantiations and the heavy main loops compile in parallel
and only the modules a run uses are built on demand. Later requests reuse the module. CuPy
caches the compiled binary on disk (``$CUPY_CACHE_DIR``, default ~/.cupy/kernel_cache), so a
second process start skips NVRTC.

Cold start: ``runtime.prepare()`` builds the parts of every file this GPU can run that the
run's dtypes need ahead of the first step (``every_unit()``), one thread per part (a
float32 / TF32 run skips the 16-bit and double families, a bf16 run the float16 and double
ones). Given the kernels a run launches (a trace), it builds modules of exactly those
instantiations instead (``groups()``, ``module_of()``): a whole part is up to eight kernels
the run may never launch, and every one costs compile time. ``Builds`` takes such units as
they become known (the step's own before the trace, each heavy main loop as the trace
records it), so the compile runs beside the trace instead of after it; ``begin()`` starts
the step's own earlier still, while the run loads its data and builds its model, and the
next ``take()`` (prepare's) carries those builds on. Threads, not processes, because
CuPy's binding calls ``nvrtcCompileProgram`` with the GIL released (``with nogil`` in
cupy_backends/cuda/libs/nvrtc.pyx; the installed binary brackets the call with
PyEval_SaveThread / PyEval_RestoreThread), NVRTC is documented thread-safe, and a thread's
module is loaded straight into this process's CUDA context: a process pool would pay a
CuPy import and a CUDA context per worker and hand its results back through the disk.
``python -m dptrain bench startup`` measures one worker against many on a fresh cache.

Cache identity: CuPy 14.2 names a cached binary by a hash of (GPU architecture, options,
NVRTC version, source, name expressions): the architecture is in its key already. The
source handed to CuPy also carries the digest of our headers (so editing a .cuh
recompiles), and ``cache_key(filename, arch, part)`` is our own key of a part's build
(source, headers, options, architecture, part), by which the in-process table of modules is
kept.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import itertools
import os
import re
import shutil
import threading
import time
from pathlib import Path

from dptrain import switches


def kernel_dir() -> Path:
    """Where the .cu files are: beside the package in a source tree, inside it in a wheel."""
    return _kernel_dir(switches.value("KERNEL_DIR"))


@functools.lru_cache(maxsize=None)
def _kernel_dir(override) -> Path:  # found once per $DPTRAIN_KERNEL_DIR: every build asks
    candidates = [Path(override)] if override else []
    here = Path(__file__).resolve().parents[2]  # dptrain/
    candidates += [here / "kernels", here.parent / "kernels"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.cu")):
            return path
    raise RuntimeError(
        "dptrain: cannot find the CUDA sources (kernels/*.cu); looked in "
        + ", ".join(str(p) for p in candidates)
    )


def cuda_include_dir() -> Path:
    """The toolkit's include directory, so <mma.h> and <cuda_bf16.h> compile under NVRTC."""
    return _cuda_include_dir(os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"),
                             os.environ.get("PATH"))


@functools.lru_cache(maxsize=None)
def _cuda_include_dir(cuda_path, cuda_home, path) -> Path:  # found once per environment
    roots = [cuda_path, cuda_home]
    nvcc = shutil.which("nvcc", path=path)
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    for root in roots:
        if root and (Path(root) / "include" / "cuda_runtime.h").exists():
            return Path(root) / "include"
    raise RuntimeError(
        "dptrain: no CUDA toolkit headers found (looked under CUDA_PATH, CUDA_HOME, "
        "the nvcc on PATH and /usr/local/cuda); install the CUDA toolkit or set CUDA_PATH"
    )


# "// instantiate: add_kernel<float>" lines in a .cu file name the template
# instantiations NVRTC must emit; each file lists its own, one line per template, in product
# form: "map2_kernel<{float, double}, {Add, Mul}>" is the four instantiations (';' separates
# expressions).
_INSTANTIATE = re.compile(r"^//\s*instantiate:\s*(.+?)\s*$", re.MULTILINE)
_ALTERNATIVES = re.compile(r"\{([^{}]*)\}")


# "// nvrtc-options: -arch=sm_90a" lines add compiler options for that file alone (appended
# after the common ones; CuPy then appends its own -arch=sm_XX, and NVRTC 13 keeps the
# arch-specific sm_90a target over the plain sm_90 of the same family).
_OPTIONS = re.compile(r"^//\s*nvrtc-options:\s*(.+?)\s*$", re.MULTILINE)
# `// instantiations-per-module: N` in a .cu file: its families split into modules of at most
# N instantiations (default CHUNK). Files whose instantiations each take seconds to build
# (the GEMM main loops) ask for fewer, so a cold start builds them on more threads.
_PER_MODULE = re.compile(r"^//\s*instantiations-per-module:\s*(\d+)", re.MULTILINE)


def file_options(source: str) -> tuple[str, ...]:
    """The extra compiler options a .cu file asks for on its `// nvrtc-options:` lines."""
    return tuple(o for line in _OPTIONS.findall(source) for o in line.split())


def name_expressions(source: str) -> list[str]:
    """The instantiations a .cu file's `// instantiate:` lines name, each product expanded
    (the alternatives in braces, the last varying fastest)."""
    names = []
    for line in _INSTANTIATE.findall(source):
        for expr in (n.strip() for n in line.split(";")):
            parts = _ALTERNATIVES.split(expr)
            alternatives = [[a.strip() for a in p.split(",")] for p in parts[1::2]]
            for pick in itertools.product(*alternatives):
                name = "".join(t + a for t, a in zip(parts[0::2], pick + ("",)))
                if name:
                    names.append(name)
    return names


# The element families a file's modules split by: float32 (and the type-free kernels), double
# (the tests' float64 references), and the two 16-bit types. A run builds the families of the
# dtypes it computes in (``every_unit(families)``); any other kernel is built on first use.
PARTS = ("main", "double", "__half", "__nv_bfloat16")
FAMILY_OF_DTYPE = {"float32": "main", "float64": "double", "float16": "__half",
                   "bfloat16": "__nv_bfloat16"}
# Instantiations per module at most: a family with more is split in file order ("main",
# "main.2", ...), so the heavy families (the convolutions' main loops) build on several
# threads instead of holding up the rest.
CHUNK = 8


def part_of(name: str) -> str:
    """The element family (one of PARTS) of instantiation `name`: a 16-bit type named in it,
    else double where no float is (a float kernel may read double partial sums: main)."""
    for part in PARTS[2:]:
        if part in name:
            return part
    if re.search(r"\bdouble\b", name) and not re.search(r"\bfloat\b", name):
        return "double"
    return PARTS[0]


def _part_table(filename: str) -> dict[str, str]:
    """{instantiation: its module part} for kernels/`filename`: its family, and from the
    CHUNK-th (or the file's instantiations-per-module) instantiation of a family on, the family
    with a chunk number."""
    source, _ = source_and_options(filename)
    per_module = _per_module(source)
    table, seen = {}, dict.fromkeys(PARTS, 0)
    for name in name_expressions(source):
        family = part_of(name)
        chunk, seen[family] = seen[family] // per_module, seen[family] + 1
        table[name] = family if chunk == 0 else f"{family}.{chunk + 1}"
    return table


def parts(filename: str) -> list[str]:
    """The module parts of kernels/`filename`: families in PARTS order, each in chunks."""
    table = _part_table(filename)
    present = list(dict.fromkeys(table.values()))
    ordered = [p for family in PARTS for p in present if p.split(".")[0] == family]
    return ordered or [PARTS[0]]


def _headers_digest() -> str:
    headers = "".join(h.read_text() for h in sorted(kernel_dir().glob("*.cuh")))
    return hashlib.sha256(headers.encode()).hexdigest()


def source_and_options(filename: str) -> tuple[str, tuple[str, ...]]:
    """What NVRTC compiles for kernels/`filename`: the source and the compiler options."""
    source = (kernel_dir() / filename).read_text()
    # CuPy caches compiled code by source text and options, so fold the local headers'
    # text into the source: editing a header (common.cuh, gemm_tiles.cuh) then recompiles
    # the files that include it.
    source += f"\n// headers: {_headers_digest()}\n"
    options = (
        "--std=c++17",
        f"-I{cuda_include_dir()}",
        f"-I{kernel_dir()}",
    ) + file_options(source)
    return source, options


def cache_key(filename: str, arch: str, part: str = PARTS[0], names=None) -> str:
    """The identity of part `part` of kernels/`filename` built for GPU architecture `arch`
    (compute capability digits, "90"), or of the module holding exactly the instantiations
    `names`: a digest of its source, the headers, the options, `arch` and the part or names."""
    source, options = source_and_options(filename)
    held = f"part={part}" if names is None else "names=" + ";".join(sorted(names))
    text = "\0".join((filename, source, *options, f"arch={arch}", held))
    return hashlib.sha256(text.encode()).hexdigest()


_ARCH_OPTION = re.compile(r"^-(?:arch|-gpu-architecture)=sm_(\d+)a$")


def runs_on(filename: str, arch: str) -> bool:
    """False for a file that asks for an architecture-specific target (``-arch=sm_90a``)
    other than `arch`: its code runs on that architecture only."""
    _, options = source_and_options(filename)
    wanted = [m.group(1) for m in map(_ARCH_OPTION.match, options) if m]
    return all(w == arch for w in wanted)


def kernel_files(arch: str) -> list[str]:
    """Every kernels/*.cu that a GPU of architecture `arch` can run."""
    return [p.name for p in sorted(kernel_dir().glob("*.cu")) if runs_on(p.name, arch)]


def device_arch() -> str:
    """The current GPU's compute capability as digits ("90" for an H100 / H200)."""
    import cupy

    return str(cupy.cuda.Device().compute_capability)


# Modules built in this process, by cache_key; `builds` counts them (compiled by NVRTC or
# loaded from CuPy's disk cache): after runtime.prepare(), a training step builds none. `_home`
# names the module that holds each (file, instantiation) built so far.
_modules: dict[str, object] = {}
_home: dict[tuple[str, str], object] = {}
_locks: dict[str, threading.Lock] = {}
_table_lock = threading.Lock()
builds = 0


def module(filename: str, part: str = PARTS[0]):
    """The compiled module of part `part` of kernels/`filename` for the current GPU (built on
    first use)."""
    key = cache_key(filename, device_arch(), part)
    return _build(filename, _part_names(filename, part), key)


def _part_names(filename: str, part: str) -> list[str]:
    """The instantiations of kernels/`filename` that part `part` holds."""
    return [n for n, p in _part_table(filename).items() if p == part]


def module_of(filename: str, names) -> object:
    """A module of kernels/`filename` holding exactly the instantiations `names` (one
    family's, a traced run's: no more than it launches), built on first use."""
    names = sorted(names)
    return _build(filename, names, cache_key(filename, device_arch(), names=names))


def _build(filename: str, names, key: str):
    global builds
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _table_lock:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:  # one build per key, even when threads ask at once
        if key not in _modules:
            import cupy

            source, options = source_and_options(filename)
            mod = cupy.RawModule(code=source, options=options, name_expressions=list(names))
            mod.compile()
            with _table_lock:
                _modules[key] = mod
                for name in names:
                    _home.setdefault((filename, name), mod)
                builds += 1
        return _modules[key]


def part_holding(filename: str, name: str) -> str:
    """The module part of kernels/`filename` that instantiation `name` is built in."""
    return _part_table(filename).get(name, part_of(name))


def groups(filename: str, names) -> list[tuple[str, ...]]:
    """The instantiations `names` of kernels/`filename` as the modules to build them in: by
    element family, in file order, at most the file's instantiations-per-module each (so a
    traced run builds what it launches, on as many threads as its whole parts would)."""
    wanted, per_module = set(names), _per_module(source_and_options(filename)[0])
    families: dict[str, list[str]] = {}
    for name in _part_table(filename):
        if name in wanted:
            families.setdefault(part_of(name), []).append(name)
    return [tuple(held[i:i + per_module]) for held in families.values()
            for i in range(0, len(held), per_module)]


# The work around the model in every training step, which a trace of the model does not
# see: traced_units() builds these files whole for the run's dtypes (small files: any
# optimizer, the non-finite guard and loss scale, the loader's gathers)...
STEP_FILES = ("data.cu", "guard.cu", "optim.cu")
# ...and these kernels of the large ones ({t}: each 16-bit dtype of the run; a name its file
# does not instantiate is skipped): the gradients' zeroing, accumulation, scaling and casts,
# the cross-entropy loss and its accuracy count, the loader's row gather. Found by recording
# `python -m dptrain train`'s steps; a kernel missing here is built on its first launch
# (tests/backend/test_startup.py checks the train command's runs launch none).
STEP_KERNELS = {
    "elementwise.cu": ("fill_kernel<unsigned char>", "fill_kernel<unsigned short>",
                       "fill_kernel<unsigned int>", "fill_kernel<unsigned long long>",
                       "map1_kernel<float, Scale>", "map2_kernel<float, Add>",
                       "accumulate_kernel<float, {t}>", "convert_kernel<float, {t}>",
                       "convert_kernel<{t}, float>"),
    "reduce.cu": ("count_correct_kernel<float, long long>", "count_correct_kernel<{t}, long long>"),
    "softmax.cu": ("ce_rows_kernel<float, long long>", "ce_mean_kernel<float>",
                   "ce_bwd_kernel<float, long long>", "ce_rows_kernel<float, long long, {t}>",
                   "ce_bwd_kernel<float, long long, {t}>"),
    "transpose.cu": ("strided_copy_kernel<unsigned int>", "strided_copy_kernel<uint4>",
                     "take_rows_kernel<unsigned long long, long long>",
                     "transpose_many_kernel"),
}


def step_units(families=PARTS) -> list:
    """The build units of the step's own kernels, known before any trace: modules of the
    STEP_KERNELS (for the 16-bit `families`) and the STEP_FILES' parts of `families`."""
    half = [t for t in PARTS[2:] if t in families]  # the 16-bit families are their C types
    units = []
    for f, names in STEP_KERNELS.items():
        named = [m for n in names for m in ([n.format(t=t) for t in half] if "{t}" in n
                                             else [n])]
        units += [(f, group) for group in groups(f, named)]
    return units + [(f, part) for f in STEP_FILES for part in parts(f)
                    if part.split(".")[0] in families]


def traced_units(recorded, families=PARTS) -> list:
    """The build units of a traced run: step_units(families), then modules of exactly the
    (file, instantiation) pairs `recorded` that those do not hold (of a STEP_FILE, the part
    holding it)."""
    units = step_units(families)
    held = {(f, n) for f, unit in units for n in _unit_names((f, unit))}
    wanted = collections.defaultdict(set)
    for f, name in recorded:
        if (f, name) in held:
            continue
        if f in STEP_FILES:  # built whole, as step_units builds them: the part holding it
            units.append((f, part_holding(f, name)))
        else:
            wanted[f].add(name)
    return list(dict.fromkeys(units)) + [(f, group) for f, names in sorted(wanted.items())
                                         for group in groups(f, names)]


def alone(filename: str, name: str):
    """The build unit of instantiation `name` where its file builds one per module (the
    heavy main loops: known the moment a trace records it), else None."""
    return (filename, (name,)) if _one_per_module(kernel_dir(), filename) else None


@functools.lru_cache(maxsize=None)
def _one_per_module(directory: Path, filename: str) -> bool:
    # A trace asks for each kernel it records: read the file once, not its headers each time.
    return _per_module((directory / filename).read_text()) == 1


def _unit_names(unit) -> list[str]:
    """The instantiations a build unit holds: (file, part) or (file, (names...))."""
    filename, held = unit
    return _part_names(filename, held) if isinstance(held, str) else list(held)


def _build_unit(unit):
    filename, held = unit
    return module(filename, held) if isinstance(held, str) else module_of(filename, held)


def _label(unit) -> str:
    """A unit as the build report names it: its part, or its family and kernel count."""
    filename, held = unit
    return held if isinstance(held, str) else f"{part_of(held[0])}[{len(held)}]"


def _build_order(units) -> list:
    """The build units (file, part) or (file, names), most work first. The work is a unit's
    instantiations, each weighing CHUNK / its file's instantiations-per-module: a file that
    asks for fewer per module says each is heavier (gemm.cu's and the wgmma files' main
    loops, one per module, take 1-4 s each against about 1 s for eight elementwise maps).
    Ties go to the heavier instantiations."""
    per_module = {f: _per_module(source_and_options(f)[0]) for f in {f for f, _ in units}}
    return sorted(units, key=lambda u: (-len(_unit_names(u)) * CHUNK / per_module[u[0]],
                                        per_module[u[0]]))


def _per_module(source: str) -> int:
    """A file's instantiations-per-module (CHUNK unless its header asks for fewer)."""
    asked = _PER_MODULE.search(source)
    return max(1, int(asked.group(1))) if asked else CHUNK


class Builds:
    """Modules built on `workers` threads (default: $DPTRAIN_COMPILE_WORKERS, else one a
    core) while the caller goes on: ``submit(units)`` as they become known (a unit asked
    for again is not built again; each batch most work first), ``wait()`` for all of them.
    Units are (file, part), or (file, names) for a module of exactly those instantiations
    (see groups())."""

    def __init__(self, workers: int | None = None):
        import cupy

        self.device = cupy.cuda.Device().id
        env = switches.value("COMPILE_WORKERS", "")
        if not workers and env:
            if not env.isdigit() or int(env) < 1:
                raise ValueError(f"{switches.var('COMPILE_WORKERS')}={env!r}: expected a "
                                 "positive integer")
            workers = int(env)
        self.workers = workers or max(1, os.cpu_count() or 1)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.workers, "dptrain-nvrtc")
        self.futures, self.took = {}, {}
        self.before, self.start = builds, time.perf_counter()

    def submit(self, units) -> None:
        for unit in _build_order([u for u in dict.fromkeys(units) if u not in self.futures]):
            self.futures[unit] = self.pool.submit(self._build, unit)

    def _build(self, unit):
        # The current device is per thread in CUDA; setting it also makes its primary context
        # current here (CUDA >= 12), which loading the compiled module needs.
        import cupy

        cupy.cuda.runtime.setDevice(self.device)
        began = time.perf_counter()
        _build_unit(unit)
        self.took[unit] = time.perf_counter() - began

    def wait(self) -> dict:
        """Once every unit is built: {"files", "built" (modules), "seconds" (since this
        started), "workers", "slowest": [[file, part, seconds], ...] (the five longest)}.
        Re-raises the first compile error."""
        try:
            for future in list(self.futures.values()):
                future.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
        slowest = sorted(self.took.items(), key=lambda kv: -kv[1])[:5]
        return {"files": len({f for f, _ in self.futures}), "built": builds - self.before,
                "seconds": time.perf_counter() - self.start, "workers": self.workers,
                "slowest": [[u[0], _label(u), round(t, 3)] for u, t in slowest]}


# The builds begin() started before the run knew its model, taken over by the next take().
_early: Builds | None = None


def begin(families) -> None:
    """Start building the step's own kernels of `families` (step_units) in the background,
    before the model, its precision and its trace are known (the CPUs are idle meanwhile);
    the next take() hands on those builds. Called again, it adds what is new."""
    global _early
    if _early is None:
        _early = Builds()
    _early.submit(step_units(families))


def take() -> Builds:
    """The Builds begin() started, its units building on, else a new one."""
    global _early
    building, _early = _early or Builds(), None
    return building


def every_unit(families=PARTS) -> list:
    """The (file, part) build units of every kernel file the current GPU runs, for the
    `families` given."""
    return [(f, part) for f in kernel_files(device_arch()) for part in parts(f)
            if part.split(".")[0] in families]


@functools.lru_cache(maxsize=None)
def function(filename: str, name: str):
    """The kernel `name` (a plain name or a template instantiation) from kernels/`filename`:
    from the module built with it, else its part's (built now)."""
    mod = _home.get((filename, name)) or module(filename, part_holding(filename, name))
    return mod.get_function(name)
