"""Giving back the memory-mapped checkpoint pages a conversion has finished reading.

``from_pretrained`` opens safetensors files memory-mapped (a private file mapping) and hands the loader slices; an
unconverted tensor stays a zero-copy view of the map, so a vanilla load never faults its weight pages in. A
converted tensor (a fused ``qkv_proj``, per-expert weights) is new memory by nature, and reading its sources faults
their pages into the process, where they would stay (counted in its RSS) for as long as any tensor of the file is
alive, on top of the converted copy. Once a group is converted and none of its outputs shares memory with a source,
:func:`release_pages` tells the kernel the process no longer needs those pages (``madvise(MADV_DONTNEED)``): a file
page comes back from the page cache, unchanged, if it is ever read again.

Only Linux, and only the pages lying wholly inside a source tensor's own bytes (a page shared with a neighbouring
tensor of the file is kept, and so is the rest of a storage the tensor may be a view of). ``MADV_DONTNEED`` would zero anonymous memory, which is why callers pass only tensors that nothing
else uses any more (the sources of a finished group); elsewhere this module does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

__all__ = ["release_pages", "shares_memory"]

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` of a tensor's storage."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storages of two tensors overlap (views of one another, or of one buffer)."""
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1


def release_pages(sources, outputs) -> int:
    """Drop from the process the pages of ``sources`` (CPU tensors nothing else uses) that no tensor of ``outputs``
    shares. Returns the number of bytes released (0 off Linux, or when an output is a view of a source).
    """
    if _madvise is None:
        return 0
    sources = [t for t in sources if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    outputs = [t for t in outputs if isinstance(t, torch.Tensor)]
    if any(shares_memory(s, o) for s in sources for o in outputs):
        return 0
    released = 0
    for tensor in sources:
        if not tensor.is_contiguous():
            continue
        start = tensor.data_ptr()  # the tensor's own bytes, never the rest of a storage it may share with others
        end = start + tensor.numel() * tensor.element_size()
        first = -(-start // _PAGE) * _PAGE  # round up: the page holding the head may hold the previous tensor
        last = end // _PAGE * _PAGE
        if last > first and _madvise(first, last - first, _MADV_DONTNEED) == 0:
            released += last - first
    return released
