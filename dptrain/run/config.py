"""TrainConfig: every option of a training run, declared once.

Each field carries its default and, in its metadata, what the command line needs: the help
text, the argument group, the choices, a bound on numbers ("positive", "non_negative") and a
metavar. `python -m dptrain train`'s parser and its `--config FILE.toml` keys are built from
these fields (dptrain.cli.train), and a test checks that the README names every flag. A
boolean whose default is True becomes a ``--no-NAME`` switch, one whose default is False a
``--NAME`` switch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from dptrain.data import DATASETS, fixed_size
from dptrain.data.augment import AUGMENTATIONS, CROP_FLIP, RESIZED_CROP, RRC_RATIO, RRC_SCALE
from dptrain.distributed.watchdog import DEFAULT_TIMEOUT
from dptrain.nn import MODELS
from dptrain.optim import OPTIMIZERS, LRSchedule
from dptrain.run import amp

DEFAULT_BATCH = 64  # images per step per process, unless --global-batch-size splits one

# A CPU run uses a subset so `make train` finishes in minutes; a GPU run the full default set.
DEVICE_DEFAULTS = {
    "cpu": dict(train_images=8000, val_images=2000, epochs=3),
    "cuda": dict(train_images=60000, val_images=10000, epochs=5),
}
_CPU, _GPU = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
PRECISIONS = ("auto", "tf32", "fp32", "bf16", "fp16")


def option(default, help, group, *, bound=None, choices=None, metavar=None, flag=None,
           const=None):
    """A TrainConfig field with what its command-line flag needs (``const``: the value of the
    flag given bare, which then takes an optional value)."""
    return field(default=default, metadata=dict(help=help, group=group, bound=bound,
                                                choices=choices, metavar=metavar, flag=flag,
                                                const=const))


DATA, OPTIM, DEVICE, OUTPUT, FAILURES, TESTING = (
    "model and data", "optimisation", "device", "output", "checkpoints and failures", "testing")


@dataclass
class TrainConfig:
    # model and data
    model: str = option(
        "cnn", f"network to train: {', '.join(sorted(MODELS))}, or FILE.py:FUNCTION / "
        "package.module:FUNCTION, a function of yours returning a dptrain.nn.Module (given "
        "image_shape, num_classes where it takes them)", DATA, bound="model",
        metavar="MODEL")
    hidden: tuple | None = option(
        None, "--model mlp: widths of the hidden layers (any number; default 512,256)", DATA,
        bound="widths", metavar="W1,W2,...")
    dataset: str = option(
        "synthetic", "dataset (synthetic: built-in 48x48 shapes, generated on the fly; "
        "imagefolder, mnist, cifar10, fer2013, packed: read from --data-dir)", DATA,
        choices=tuple(sorted(DATASETS)))
    data_dir: str | None = option(
        None, "the dataset's files (a folder of class folders, the MNIST/CIFAR-10 files, the "
        "FER-2013 CSV, a `data pack` output)", DATA, metavar="PATH")
    channels: int | None = option(None, "1: grayscale, 3: RGB (default: the dataset's own)",
                                  DATA, choices=(1, 3))
    image_size: int | None = option(
        None, "resize images to SxS (needed when an image folder mixes sizes); with --augment "
        f"{RESIZED_CROP}: the side of the crops the model reads, the images read as stored", DATA,
        bound="positive", metavar="S")
    val_fraction: float = option(
        0.1, "share held out for validation when the dataset has no test split", DATA,
        bound="non_negative")
    on_bad_image: str = option(
        "error", "an unreadable image file: stop with its name, or skip it (counted)", DATA,
        choices=("error", "skip"))
    augment: str | None = option(
        None, f"augment training batches on the device. {CROP_FLIP} (a bare --augment): random "
        "crop from the image padded by --augment-pad pixels, and horizontal flip, at the stored "
        f"size; {RESIZED_CROP}: torchvision's RandomResizedCrop (area share --rrc-scale, aspect "
        "--rrc-ratio), bilinear to --image-size SxS (default: the stored size), horizontal "
        "flip; evaluation then resizes (shorter side S*256/224) and centre-crops to SxS", DATA,
        choices=AUGMENTATIONS, metavar="KIND", const=CROP_FLIP)
    augment_pad: int = option(4, f"padding of the {CROP_FLIP} crop, pixels", DATA,
                              bound="non_negative", metavar="P")
    rrc_scale: tuple = option(
        RRC_SCALE, f"{RESIZED_CROP}: range of the crop's share of the image's area (default "
        "0.08,1)", DATA, bound="scale_range", metavar="MIN,MAX")
    rrc_ratio: tuple = option(
        RRC_RATIO, f"{RESIZED_CROP}: range of the crop's aspect ratio w/h, drawn log-uniformly "
        "(default 0.75,1.3333)", DATA, bound="ratio_range", metavar="MIN,MAX")
    data_on: str = option(
        "auto", "where the training images live: device (resident, gathered inside the step; an "
        "error if they do not fit), host (streamed: batches gathered ahead by --data-workers "
        "threads into pinned buffers and copied while the previous step runs), auto (device "
        "when they take at most half the free device memory, else host)", DATA,
        choices=("auto", "device", "host"))
    prefetch_depth: int = option(
        3, "--data-on host: batches in flight (gathered, copied, read by the step); at least 2",
        DATA, bound="positive", metavar="N")
    data_workers: int = option(2, "--data-on host: threads gathering batches", DATA,
                               bound="positive", metavar="N")
    train_images: int | None = option(
        None, f"training images (synthetic: default {_CPU['train_images']} on CPU, "
        f"{_GPU['train_images']} on GPU; datasets read from files: all)", DATA,
        bound="positive")
    val_images: int | None = option(
        None, f"validation images (synthetic: default {_CPU['val_images']} on CPU, "
        f"{_GPU['val_images']} on GPU; datasets read from files: all)", DATA, bound="positive")
    cache_dir: str | None = option(
        None, "where generated datasets are cached (default $DPTRAIN_CACHE or ~/.cache/dptrain)",
        DATA)
    # optimisation
    epochs: int | None = option(
        None, f"passes over the training set (default {_CPU['epochs']} on CPU, "
        f"{_GPU['epochs']} on GPU)", OPTIM, bound="positive")
    max_steps: int | None = option(None, "stop after this many steps, whatever the epochs",
                                   OPTIM, bound="positive")
    batch_size: int | None = option(
        None, f"images per step per process (default {DEFAULT_BATCH})", OPTIM, bound="positive")
    global_batch_size: int | None = option(
        None, "images per step over all processes (instead of --batch-size)", OPTIM,
        bound="positive")
    drop_last: bool = option(
        True, "pad the last ragged batch of an epoch with wrapped-around images instead of "
        "dropping it", OPTIM)
    optimizer: str = option("adamw", "sgd: momentum SGD; adamw: Adam with decoupled weight "
                            "decay", OPTIM, choices=tuple(sorted(OPTIMIZERS)))
    lr: float = option(2e-3, "peak learning rate", OPTIM, bound="positive")
    lr_schedule: str = option(
        "cosine", "decay after the warmup: constant (none), step (x0.1 every third of the run's "
        "steps, counted from the warmup's end) or cosine (to 0 at the last step)", OPTIM,
        choices=LRSchedule.KINDS)
    warmup_steps: int | None = option(
        None, f"steps of linear learning-rate warmup (default: "
        f"{LRSchedule.AUTO_WARMUP_FRACTION:.0%} of the run, at most "
        f"{LRSchedule.AUTO_WARMUP_MAX} steps)", OPTIM, bound="non_negative")
    momentum: float = option(0.9, "SGD momentum", OPTIM, bound="non_negative")
    nesterov: bool = option(False, "Nesterov momentum (SGD)", OPTIM)
    weight_decay: float = option(
        5e-4, "weight decay (decoupled for adamw, added to the gradient for sgd)", OPTIM,
        bound="non_negative")
    seed: int = option(0, "seeds data order, dataset and init", OPTIM, bound="non_negative")
    # device
    device: str = option("auto", "auto: the GPU when CuPy and a GPU are present, else the CPU",
                         DEVICE, choices=("auto", "cpu", "cuda"))
    sync_bn: bool = option(
        False, "batch normalisation uses the statistics of all ranks' batches (all-reduced "
        "inside the step) instead of each rank's own", DEVICE)
    bucket_mb: float | str = option(
        4.0, "gradient bucket size for the reduce-scatter (MB), or auto: the sizes (a smaller "
        "first bucket, then the body's) whose simulated exposed reduce-scatter time is least, "
        "from the measured link and backward time (dptrain.distributed.buckets)", DEVICE,
        bound="positive_or_auto", metavar="MB|auto")
    grad_exchange: str = option(
        "fp32", "dtype of the gradients' reduce-scatter: fp32, or bf16 (a 16-bit copy of each "
        "bucket, half the bytes, its mean widened into the fp32 gradient shard; on the CPU "
        "bfloat16 is emulated bit for bit)", DEVICE, choices=("fp32", "bf16"))
    cuda_graph: bool = option(
        True, "GPU: run every step eagerly instead of replaying a captured graph", DEVICE)
    precision: str = option(
        "auto", "tf32/fp32: fp32 activations, matrix products on TF32 tensor cores or in full "
        "fp32; bf16/fp16: mixed precision, 16-bit activations with fp32 weights, optimizer and "
        "gradient exchange (bf16 on a GPU only; fp16 with dynamic loss scaling; layers "
        "without 16-bit kernels compute in fp32 between casts). auto: bf16 on a GPU with bf16 "
        "tensor cores for a model whose every layer has a 16-bit kernel (every built-in model: "
        f"{', '.join(sorted(MODELS))}; a model of yours where its layers have them), else "
        "TF32 where the GPU has it, else fp32",
        DEVICE, choices=PRECISIONS)
    loss_scale: float = option(
        amp.INIT_SCALE, "fp16: the initial loss scale; halved on every step whose gradients "
        "overflow (that step is skipped on all ranks)", DEVICE, bound="positive", metavar="S")
    loss_scale_interval: int = option(
        amp.INTERVAL, "fp16: the loss scale doubles after N steps without an overflow", DEVICE,
        bound="positive", metavar="N")
    # output
    log_dir: str | None = option(
        None, "write metrics.jsonl, summary.json and config.json here; a directory that holds "
        "files already is left alone and DIR-1, DIR-2, ... used instead", OUTPUT)
    overwrite: bool = option(False, "write into an existing --log-dir, replacing its files",
                             OUTPUT)
    save: str | None = option(None, "final weights (.npz)", OUTPUT, metavar="PATH")
    load: str | None = option(None, "initial weights (.npz)", OUTPUT, metavar="PATH")
    eval_every: int = option(0, "validate every N steps (0: at the end of each epoch)", OUTPUT,
                             bound="non_negative")
    log_every: int = option(20, "log every N steps", OUTPUT, bound="positive")
    progress: bool = option(True, "no progress bar", OUTPUT)
    torch: bool = option(
        False, "then train the same model in PyTorch from the same initial weights on the same "
        "batches, into LOGDIR/torch/metrics.jsonl (needs torch)", OUTPUT)
    skip_nonfinite: int = option(
        0, "skip up to N steps whose loss or gradient is NaN or infinite (their update is not "
        "applied); 0: stop at the first with exit code 3", OUTPUT, bound="non_negative",
        metavar="N")
    # checkpoints and failures
    checkpoint_dir: str | None = option(
        None, "write exact-resume checkpoints here (model, optimizer, step, RNG states); "
        "SIGINT/SIGTERM then stop after a step and write one", FAILURES, metavar="DIR")
    checkpoint_every: int = option(
        0, "write a checkpoint every N steps (0: only when stopped by a signal)", FAILURES,
        bound="non_negative", metavar="N")
    keep_checkpoints: int = option(3, "keep the newest K checkpoints", FAILURES,
                                   bound="positive", metavar="K")
    resume: str | None = option(
        None, "continue a run: auto = the newest usable checkpoint in --checkpoint-dir (a "
        "fresh start if none), or a checkpoint directory", FAILURES, metavar="auto|PATH")
    collective_timeout: float = option(
        DEFAULT_TIMEOUT, "abort the job, naming the ranks that did not arrive, when a "
        "collective or a step has not finished after this long (0: never)", FAILURES,
        bound="non_negative", metavar="SECONDS")
    # testing
    verify_replicas: bool = option(
        False, "check after every step that all ranks hold identical parameters (slow; for "
        "testing)", TESTING)


def data_options(cfg, absolute: bool = False) -> dict:
    """How `cfg` reads its dataset, beyond its name, size and seed (get_dataset's options):
    the training loop, the --torch twin and the weights' metadata all take them from here.
    `absolute`: the data directory as an absolute path (what a weights file records, so
    `eval --load` finds the data from any working directory)."""
    data_dir = cfg.data_dir
    if absolute and data_dir is not None:
        data_dir = os.path.abspath(data_dir)
    # random-resized-crop reads the stored images and resamples them to --image-size itself
    stored = cfg.image_size if cfg.augment != RESIZED_CROP else None
    return dict(data_dir=data_dir, channels=cfg.channels, image_size=stored,
                val_fraction=cfg.val_fraction, on_bad_image=cfg.on_bad_image)


def options():
    """The fields of TrainConfig, in declaration order (the order of `train --help`)."""
    return fields(TrainConfig)


def flag(f) -> str:
    """The command-line flag of field `f`: --name, or --no-name for a switch that is on by
    default."""
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def defaults_for(cfg: TrainConfig, device: str) -> TrainConfig:
    """Fill what the device decides: sizes and epochs (synthetic data only for the sizes: a
    dataset read from files is used whole unless asked otherwise)."""
    for key, value in DEVICE_DEFAULTS[device].items():
        if key.endswith("_images") and fixed_size(cfg.dataset):
            continue
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    return cfg
