"""The weights of an ``hf:PATH`` model directory, read lazily slice by slice.

``planner train`` gives every rank ``directory_state(path, sizes)`` as the original model's state:
a read-only mapping from the wrapped model's names (``inner.<HF name>``) to tensors that opens the
directory's safetensors files but reads nothing until asked. ``runtime.stages.compiled_stages.load_weights``
asks it for whole tensors (``state[name]``) or, for a tensor-parallel shard, for the rows/columns
of that shard only (``state.get_slice(name)[...]``, safetensors' slice API), so no rank reads the
weights of another stage or another tp rank's piece. The runtime never imports this module (nor
safetensors): it only duck-types ``get_slice``.

Buffers that the files do not hold (e.g. rotary ``inv_freq``) come from a skeleton of the model
built with its parameters on the meta device and its buffers real. Tied weights (an LM head that
is the embedding) resolve to whichever name the files hold. ``check_weights`` compares the file
headers with the model's parameter shapes (no tensor data is read) and raises a ``ModelError``
naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open

from planner.frontend.frontend_errors import ModelError
from planner.frontend.hf import INDEX_FILE, SINGLE_FILE, build_hf_dir, weight_files

__all__ = ["params_on_meta", "DirectoryWeights", "directory_state", "check_weights", "PREFIX"]

PREFIX = "inner."
"""Names in compiled stages are the wrapped model's: ``HFLossModel.inner`` + the HF name."""


@contextlib.contextmanager
def params_on_meta():
    """Build modules with every parameter moved to the meta device as it is registered (buffers
    stay real): a skeleton holding names, shapes, ties and computed buffers, one parameter alive at
    a time."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def _skeleton(path: str, sizes: dict) -> nn.Module:
    return build_hf_dir(path, sizes, weights=True, context=params_on_meta()).model


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter name -> all names of that parameter (tied weights share one list)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {n: names for names in groups.values() for n in names}


class DirectoryWeights(Mapping):
    """Read-only ``name -> tensor`` of a model directory (names with the ``inner.`` prefix).

    ``state[name]`` reads one whole tensor; ``get_slice(name)[idx]`` reads only ``idx`` (a tuple
    of slices), ``get_slice(name).get_shape()`` its full shape. Names absent from the files are
    served from ``buffers`` (the skeleton's computed buffers).
    """

    def __init__(self, files: dict[str, str], aliases: dict[str, list[str]], buffers: dict[str, torch.Tensor]):
        self._files = files
        self._buffers = buffers
        self._key: dict[str, str] = {}
        for name, names in aliases.items():
            found = next((n[len(PREFIX) :] for n in names if n[len(PREFIX) :] in files), None)
            if found is not None:
                self._key[name] = found
        self._handles: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def get_slice(self, name: str):
        """safetensors' lazy slice of ``name`` (``KeyError`` for a buffer: read it whole)."""
        key = self._key[name]
        return self._handle(self._files[key]).get_slice(key)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._key:
            key = self._key[name]
            return self._handle(self._files[key]).get_tensor(key)
        return self._buffers[name]

    def __contains__(self, name) -> bool:
        return name in self._key or name in self._buffers

    def __iter__(self) -> Iterator[str]:
        yield from self._key
        yield from (buffer for buffer in self._buffers if buffer not in self._key)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def check_weights(path: str, sizes: dict, model: nn.Module | None = None) -> dict[str, str]:
    """Check that the directory's files hold every parameter of its model with the right shape
    (headers only); return ``weight_files(path)``. ``ModelError`` names the file and the tensor."""
    files = weight_files(path)
    if not files:
        return files
    model = model if model is not None else build_hf_dir(path, sizes, weights=True, device="meta").model
    seen: set[int] = set()
    handles: dict[str, Any] = {}  # safetensors' open files
    for name, names in _aliases(model).items():
        param = model.get_parameter(name)
        if id(param) in seen:
            continue
        seen.add(id(param))
        hf_names = [n[len(PREFIX) :] for n in names]
        key = next((n for n in hf_names if n in files), None)
        if key is None:
            where = (
                os.path.join(path, INDEX_FILE)
                if os.path.isfile(os.path.join(path, INDEX_FILE))
                else os.path.join(path, SINGLE_FILE)
            )
            raise ModelError(
                f"{where} has no tensor {hf_names[0]!r} (shape {tuple(param.shape)}), which the "
                f"model of {os.path.join(path, 'config.json')} needs. Save the weights and the "
                "config together (save_pretrained), or remove the weight files to train from "
                "a fresh initialization."
            )
        file = files[key]
        try:
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            shape = tuple(handles[file].get_slice(key).get_shape())
        except Exception as e:  # noqa: BLE001 - a missing shard file, a corrupt header
            raise ModelError(
                f"cannot read tensor {key!r} from {file} ({e}); save the model again with save_pretrained."
            ) from None
        if shape != tuple(param.shape):
            raise ModelError(
                f"{file}: tensor {key!r} has shape {shape}, but the model of "
                f"{os.path.join(path, 'config.json')} needs {tuple(param.shape)}. The weights "
                "and the config disagree: save them together (save_pretrained), and do not "
                "override sizes of a model with weights."
            )
    return files


def directory_state(path: str, sizes: dict) -> Mapping[str, torch.Tensor] | None:
    """The lazy state of ``hf:PATH`` for the runtime, or ``None`` when it holds no weights."""
    if not weight_files(path):
        return None
    model = _skeleton(path, sizes)
    files = check_weights(path, sizes, model)
    buffers = {n: buffer for n, buffer in model.named_buffers(remove_duplicate=False)}
    return DirectoryWeights(files, _aliases(model), buffers)
