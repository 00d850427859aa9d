"""What keeps a node's memory at the copies it needs (docs/memory.md): large tensors in shared memory before
hivemind forks its processes, and freed memory handed back to the system.

hivemind starts its DHT and averagers as processes forked from the node's. A child shares the pages the node had at
the fork until one side writes them; the node then gets a copy of each page it writes or frees and reuses, and the
child keeps the old one. The node writes every large tensor it held at the fork (parameters, optimizer state,
gradients) and frees others, so each child ended up with a private copy of them: 0.7 to 1 GiB per child for GPT-2
small. Tensors in shared memory are not copied on write (both sides map the same pages), and pages handed back to
the system before the fork are not inherited at all.

glibc keeps freed blocks below its mmap threshold in its heap, and raises that threshold (to 32 MiB) each time a
larger block is freed: every tensor of GPT-2 small but the embeddings then stayed in the heap once freed, and a
transient copy of the model stayed resident for good. `cap_mmap_threshold` pins it, so blocks of 1 MiB or more are
mapped and unmapped on their own, while the node builds its state and hivemind forks.

A training loop is the other way round: each pass frees the activations and gradients of the last and allocates the
same sizes again. Mapped on their own, every pass faults in fresh pages for all of them (GPT-2 small's plain PyTorch
loop ran at two thirds of its speed so). `reuse_freed_blocks`, once the node joined, gives glibc the threshold its own
rule ends at (32 MiB), so a pass reuses the blocks of the last, and the heap's free pages go back to the system
after every served step and every 30 s (`trim`) instead of at every free.

A buffer that every use overwrites whole first (a low-comm node's gradient buffers between its updates) need hold no
memory meanwhile: `release` hands its pages back in place. The tensor keeps its object and address, and every process
that maps the same shared memory (hivemind's averager holds the node's gradient buffers) reads zeros there, which
take no page until touched again (tmpfs gives a page on a read of a hole as well as on a write: a released buffer
must not be read before it is written).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
from typing import Iterable, Optional

import numpy as np
import torch

MMAP_THRESHOLD_BYTES = 1 << 20  # blocks at least this large are their own mappings, returned to the system on free
TRAINING_MMAP_THRESHOLD_BYTES = 32 << 20  # where glibc's dynamic threshold ends (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_MADV_REMOVE = 9  # madvise's advice number (linux/mman.h): free the range and its backing store (a hole in tmpfs)


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    """glibc, loaded once (find_library runs ldconfig: milliseconds, on every release and trim otherwise)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") and hasattr(libc, "madvise")):
        return None  # glibc only
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def trim() -> bool:
    """Hand the heap's free pages back to the system (glibc's malloc_trim); False where there is no glibc."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def cap_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold (see the module docstring); False where there is no glibc."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def reuse_freed_blocks(nbytes: int = TRAINING_MMAP_THRESHOLD_BYTES) -> bool:
    """For the training loop (see the module docstring): freed blocks below `nbytes` stay in the heap for the next
    pass, and the heap's top is handed back only past twice that (glibc's own pairing of the two, which setting the
    threshold by hand turns off). False where there is no glibc."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes))
                and libc.mallopt(_M_TRIM_THRESHOLD, 2 * int(nbytes)))


def share(tensors: Iterable[torch.Tensor]) -> None:
    """Move CPU tensors into shared memory, in place (their storage moves; views and the objects stay valid). A
    tensor of zeros holds no memory there until touched (`release`): an optimizer's moments are zeros until its
    first real step (hivemind makes them with a step on zero gradients), 2P for AdamW."""
    with torch.no_grad():
        for t in tensors:
            if t.device.type == "cpu" and not t.is_shared():
                zeros = t.numel() * t.element_size() >= MMAP_THRESHOLD_BYTES and not t.any()
                t.share_memory_()
                if zeros:
                    release([t])


def shared_zeros(elements: int) -> torch.Tensor:
    """A flat float32 tensor of zeros in shared memory, made there, that holds no memory until touched (read or
    written) (a joiner's gradient buffers and moments hold none while it downloads), with no private copy on the
    way. torch allocates a new shared file whole (posix_fallocate, so that a full /dev/shm fails here rather than
    with SIGBUS later): its pages are handed back at once (`release`). They are tmpfs pages that no process maps
    yet, so a process's PSS never showed them; MemAvailable did."""
    n = int(elements)
    storage = torch.UntypedStorage._new_shared(4 * n)  # torch's own shared-memory allocation (share_memory_ uses it)
    zeros = torch.empty(0).set_(storage, 0, (n,), (1,))
    release([zeros])
    return zeros


def lazy_zeros(like: torch.Tensor) -> torch.Tensor:
    """A float32 tensor of zeros shaped like `like`, in private memory that takes no page until written (reads map
    the kernel's one zero page): numpy's calloc, which glibc serves from fresh pages of the system without writing
    them for blocks above the mmap threshold (`cap_mmap_threshold`). torch.zeros writes every page."""
    return torch.from_numpy(np.zeros(like.numel(), np.float32)).view(like.shape)


def release(tensors: Iterable[torch.Tensor]) -> int:
    """Make each tensor read zeros, handing its memory back where it can; returns the bytes handed back.

    A contiguous CPU tensor in shared memory (torch's, a file in /dev/shm: tmpfs) loses the pages that lie wholly
    inside its bytes (madvise MADV_REMOVE: a hole in the file, in every process that maps it) and has the bytes of
    its first and last partial page zeroed. Any other tensor (private memory, a view with gaps, a GPU tensor, a system
    without glibc) is zeroed where it is and keeps its memory: 0 bytes for it."""
    libc = _libc()
    page = mmap.PAGESIZE
    released = 0
    with torch.no_grad():
        for t in tensors:
            flat = t.view(-1) if t.is_contiguous() else None
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            first, last = -(-start // page) * page, end // page * page  # the whole pages inside [start, end)
            if (libc is None or flat is None or t.device.type != "cpu" or not t.is_shared() or last <= first
                    or (first - start) % t.element_size() or libc.madvise(first, last - first, _MADV_REMOVE) != 0):
                t.zero_()
                continue
            released += last - first
            flat[: (first - start) // t.element_size()].zero_()
            flat[(last - start) // t.element_size():].zero_()
    return released


def shared_files(pid: int) -> dict[tuple[int, int], int]:
    """The shared-memory files (/dev/shm, memfd) process `pid` maps: (device, inode) -> the bytes of memory each
    holds, its allocated blocks, whether or not any process has them mapped in (which a process's PSS misses).
    Linux, /proc/PID/map_files (root, or the process's own user); empty for a process that is gone."""
    files: dict[tuple[int, int], int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            spans = [line.split(None, 1)[0] for line in f if "/dev/shm/" in line or "/memfd:" in line]
    except OSError:
        return files
    for span in spans:
        try:
            st = os.stat(f"/proc/{pid}/map_files/{span}")
        except OSError:
            continue  # unmapped meanwhile
        files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return files
