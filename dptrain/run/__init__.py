"""One training run: the loop and what watches over it.

    config.py      TrainConfig: every option of `train`, declared once (type, default, help)
    train.py       train(): set-up, epochs, logging, evaluation, the files a run leaves
    step.py        Step: the capture-friendly step machinery (gather, forward, backward with
                   the exchange, guard, shard update, metric sums); TrainStep: train's loss
    parallel.py    DataParallel: a user's model on that machinery (the library API)
    compiled.py    a user's step function compiled: fixed input buffers, micro-batches,
                   label checks, capture, metrics
    clip.py        gradient clipping by global norm across the shards, on the device
    script.py      launch(main): a user's script ending bad input in one line, watched by
                   the watchdog and stopped by signals as `train` is
    evaluate.py    validation on the device, metrics gathered over the ranks
    amp.py         mixed precision: the precision policy and fp16 loss scaling
    nonfinite.py   the on-device guard against NaN / infinite losses and gradients
    metrics.py     metrics.jsonl, summaries, throughput, fresh log directories
    progress.py    the progress bar
    preflight.py   output paths checked before any work
    debug.py       step hooks for tests and debugging
    torch_twin.py  the same model and optimizer in PyTorch (for --torch and the benchmarks)

May import every package below it (backend, engine, nn, optim, dist, data, checkpoints);
never cli/ or bench/.
"""
