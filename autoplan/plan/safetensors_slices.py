"""Safetensors files read with plain file reads: headers (checked), and slices for DCP's reader.

torch's ``HuggingFaceStorageReader`` reads each request through ``safe_open(...).get_slice``,
which maps the whole file: a column slice (a row-parallel projection's shard) touches every page
of the tensor, and those pages count in the rank's resident memory, so each rank's peak RSS
while loading approached the whole checkpoint. Here a request is cut into its contiguous runs
(one run for a row slice, one per row for a column slice) and each run is ``pread`` into the
result: a rank touches exactly the bytes it keeps. DCP's planning, resharding and dtype cast are
unchanged (the subclass replaces only how bytes reach the request's tensor).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.futures import Future

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class SafetensorsFile:
    """One safetensors file's header, and slices of its tensors read with ``os.pread``."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.header, self.base = self._checked_header()
        except BaseException:
            os.close(self.fd)
            raise

    def _checked_header(self) -> tuple[dict, int]:
        """The header, checked the way safetensors checks it on open: a JSON table whose tensors
        have known dtypes and lie inside the file (a truncated file fails here, not at a read)."""
        size = os.fstat(self.fd).st_size
        raw = os.pread(self.fd, 8, 0)
        if len(raw) < 8:
            raise ValueError(f"{self.path}: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise ValueError(f"{self.path}: a header of {n} bytes in a file of {size}")
        header = json.loads(os.pread(self.fd, n, 8))
        data = size - 8 - n
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info.get("dtype") not in DTYPES:
                raise ValueError(f"{self.path}: {key} has dtype {info.get('dtype')!r}, not one of {sorted(DTYPES)}")
            begin, end = info["data_offsets"]
            want = math.prod(info["shape"]) * torch.empty((), dtype=DTYPES[info["dtype"]]).element_size()
            if end > data or end - begin != want:
                raise ValueError(f"{self.path}: {key} needs bytes {begin}..{end} of {data} "
                                 f"(truncated, or not a safetensors file)")
        return header, 8 + n

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor's name -> (shape, dtype)."""
        return {k: (tuple(v["shape"]), DTYPES[v["dtype"]]) for k, v in self.header.items() if k != "__metadata__"}

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, key: str, offsets, lengths) -> torch.Tensor:
        """The box ``offsets`` .. ``offsets + lengths`` of tensor ``key``."""
        info = self.header[key]
        dtype, shape = DTYPES[info["dtype"]], list(info["shape"])
        item = torch.empty((), dtype=dtype).element_size()
        start = self.base + int(info["data_offsets"][0])
        offsets, lengths = list(offsets), list(lengths)
        if not shape:
            return torch.frombuffer(bytearray(os.pread(self.fd, item, start)), dtype=dtype).reshape(())
        # the first dim from which the box covers every later dim whole: each run is contiguous
        j = len(shape) - 1
        while j > 0 and offsets[j] == 0 and lengths[j] == shape[j]:
            j -= 1
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        run = lengths[j] * strides[j]
        out = bytearray(math.prod(lengths) * item)
        view = memoryview(out)
        pos = 0
        for idx in itertools.product(*(range(offsets[i], offsets[i] + lengths[i]) for i in range(j))):
            first = sum(i * s for i, s in zip(idx, strides)) + offsets[j] * strides[j]
            n = os.preadv(self.fd, [view[pos:pos + run * item]], start + first * item)
            if n != run * item:
                raise OSError(f"{self.path}: {key} ends early (read {n} of {run * item} bytes)")
            pos += run * item
        return torch.frombuffer(out, dtype=dtype).reshape(lengths) if out else torch.empty(lengths, dtype=dtype)


class SlicedHFReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader with requests served by :class:`SafetensorsFile` (see module doc)."""

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with SafetensorsFile(name) as f:
                for req in items:
                    part = f.read(req.storage_index.fqn, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if tuple(target.shape) != tuple(part.shape):
                        raise AssertionError(f"{name}: {req.storage_index.fqn}: request of {tuple(part.shape)} for a "
                                             f"target of {tuple(target.shape)}")
                    target.copy_(part)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
