"""A safetensors checkpoint as one name -> tensor table, read lazily and in slices.

``path`` is a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json``
(Hugging Face's sharded layout: ``{"weight_map": {tensor name: file name}}``) or, without an
index, ``*.safetensors`` files. Tensors are read through ``safe_open(...).get_slice(name)``, so a
rank that asks for rows ``a:b`` reads those rows from disk and nothing else.
"""
from __future__ import annotations

import contextlib
import json
import pathlib

import torch
from safetensors import safe_open

__all__ = ["CheckpointFiles"]

INDEX = "model.safetensors.index.json"
# safetensors' dtype names (the header's "dtype" field) as torch dtypes
_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F16": torch.float16,
           "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


class CheckpointFiles(contextlib.AbstractContextManager):
    """``with CheckpointFiles(path) as files: files.read(name, rows, cols)``."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self._stack = contextlib.ExitStack()
        self._handles: dict[pathlib.Path, object] = {}
        self._file_of = self._index()

    def _index(self) -> dict[str, pathlib.Path]:
        if self.path.is_file():
            files = [self.path]
        elif (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            return {name: self.path / file for name, file in weight_map.items()}
        elif self.path.is_dir():
            files = sorted(self.path.glob("*.safetensors"))
        else:
            raise FileNotFoundError(f"load_checkpoint: {self.path} is neither a .safetensors file nor a directory")
        if not files:
            raise FileNotFoundError(f"load_checkpoint: no *.safetensors files (and no {INDEX}) in {self.path}")
        file_of: dict[str, pathlib.Path] = {}
        for file in files:
            for name in self._handle(file).keys():
                if name in file_of:
                    raise ValueError(f"load_checkpoint: tensor {name!r} is in both {file_of[name]} and {file}")
                file_of[name] = file
        return file_of

    def _handle(self, file: pathlib.Path):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        return self._handles[file]

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | str:
        """The stored dtype of ``name`` (safetensors' own name where torch has no equivalent)."""
        stored = self._slice(name).get_dtype()
        return _DTYPES.get(stored, stored)

    def _slice(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"load_checkpoint: the checkpoint has no tensor {name!r}")
        return self._handle(self._file_of[name]).get_slice(name)

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (on CPU), restricted to ``rows`` (dim 0) and ``cols`` (dim 1) when given."""
        if rows is None and cols is None:
            return self._handle(self._file_of[name]).get_tensor(name)
        sl = self._slice(name)
        r = slice(*rows) if rows is not None else slice(None)
        return sl[r] if cols is None else sl[r, slice(*cols)]
