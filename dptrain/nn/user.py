"""Models of the user's own, named on the command line as ``FILE.py:FUNCTION`` or
``package.module:FUNCTION``: a function that returns a Module, so `python -m dptrain train`
(checkpoints, resume, evaluation, plots, mpirun) trains it like a built-in model."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from pathlib import Path

from dptrain.nn.module import Module

# what build_model offers a user's function, each passed only where it takes that name
OFFERED = ("image_shape", "num_classes", "hidden")


def is_user_model(name: str) -> bool:
    return ":" in name


def load_builder(spec: str):
    """The function `spec` names; ValueError in one line for a missing file, module or
    function."""
    target, _, fn_name = spec.rpartition(":")
    if not target or not fn_name.isidentifier():
        raise ValueError(f"--model {spec}: expected FILE.py:FUNCTION or package.module:FUNCTION")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"--model {spec}: no file {target}")
        # one module name per file, so the same file loads once however often it is named
        name = "dptrain_user_model_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ValueError(f"--model {spec}: cannot import {target} ({exc})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--model {spec}: {target} has no function {fn_name}")
    return fn


def build_user_model(spec: str, image_shape, num_classes: int, hidden=None) -> Module:
    """``FUNCTION(image_shape=..., num_classes=..., hidden=...)``, each argument given only
    where the function takes it (or takes **kwargs); the result must be a Module."""
    fn = load_builder(spec)
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    values = dict(image_shape=tuple(image_shape), num_classes=num_classes, hidden=hidden)
    if hidden is None:
        values.pop("hidden")
    elif "hidden" not in params and not takes_any:
        raise ValueError(f"--hidden: {spec} takes no hidden argument")
    model = fn(**{k: v for k, v in values.items() if takes_any or k in params})
    if not isinstance(model, Module):
        raise ValueError(f"--model {spec}: returned {type(model).__name__}, not a "
                         f"dptrain.nn.Module")
    return model
