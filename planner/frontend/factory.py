"""A user's model: ``path/to/file.py:factory`` returning ``(model, example_inputs)``."""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import sys
from typing import Callable

import torch
import torch.nn as nn

from planner.frontend.bundle import ModelBundle
from planner.frontend.frontend_errors import ModelError

__all__ = ["load_factory", "check_module_names"]

_NAME_PART = re.compile(r"^[A-Za-z0-9_]+$")


def check_module_names(model: nn.Module, where: str) -> None:
    """Refuse module, parameter and buffer names that are not plain ``[A-Za-z0-9_]`` words.

    Names end up in code that torch.export and our compiler generate; a name with quotes,
    newlines or other punctuation could change that code, so it is an error, not rewritten.
    """
    names = [n for n, _ in model.named_modules() if n]
    names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    for full in names:
        for part in full.split("."):
            if not _NAME_PART.match(part) or keyword.iskeyword(part):
                raise ModelError(
                    f"{where}: the model has a submodule or parameter named {part!r} (in {full!r}); "
                    "names may contain only letters, digits and '_' and may not be Python keywords, so "
                    "that they are safe in generated code. Rename it (e.g. the key of an nn.ModuleDict)."
                )


def load_factory(spec: str, device="cpu") -> ModelBundle:
    """Load ``path/to/file.py:factory``; the factory returns ``(model, example_inputs)``."""
    path, _, fn_name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ModelError(f"Model file {path!r} does not exist (from spec {spec!r}).")
    if not fn_name.isidentifier():
        raise ModelError(f"{fn_name!r} in spec {spec!r} is not a Python function name.")
    mod_name = "planner_user_model_" + str(abs(hash(os.path.abspath(path))))
    try:
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"no module loader for {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file failed to import: report their error, not ours
        raise ModelError(f"Importing {path} failed: {type(e).__name__}: {e}") from e
    factory: Callable | None = getattr(module, fn_name, None)
    if not callable(factory):
        raise ModelError(f"{path} defines no function {fn_name!r}.")
    try:
        out = factory()
    except Exception as e:
        raise ModelError(f"{path}:{fn_name}() raised {type(e).__name__}: {e}") from e
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module)):
        raise ModelError(f"{path}:{fn_name}() must return (model, example_inputs); got {type(out).__name__}.")
    model, inputs = out
    check_module_names(model, f"{path}:{fn_name}()")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(tensor, torch.Tensor) for tensor in inputs):
        raise ModelError(f"{path}:{fn_name}(): example_inputs must be a tensor or a tuple of tensors.")
    inputs = tuple(inputs)
    seq = inputs[0].shape[1] if inputs[0].dim() >= 2 else 1
    return ModelBundle(spec, model, inputs, vocab=0, seq_len=seq, kind="file")
