"""A loaded model's memory moved into 2 MiB pages (Linux's transparent huge pages), where it lies.

    from gpt2.huge_pages import collapse_into_huge_pages, collapsing_what_loads
    moved = collapse_into_huge_pages()   # bytes now in 2 MiB pages; 0 where the system offers none
    with collapsing_what_loads() as collapsed:   # only what becomes resident inside the block
        model = load_it()                        # collapsed.bytes: what moved

    GPT2_HUGE_PAGES=0 gpt2 generate ...  # leave every page as it is

A decode step streams every weight once: GPT-2 124M's 250 MB in bf16, some 61,000 pages of 4 KB. On an
AMD EPYC Zen 4 the compiled step ran 6-8% faster with them in 2 MiB pages, at every precision
(benchmarks/ab_huge_pages.py; BENCHMARKS.md, "The Zen 4 again"). The kernels' libraries allocate the
weights themselves (fbgemm's packings in glibc's heap, oneDNN's and torch's through torch's allocator),
and where the system's THP mode is `madvise` (as on these VMs) Linux gives huge pages only to memory
that asked for them, which none does.

MADV_COLLAPSE (Linux 6.1) moves memory that is already resident into huge pages, whatever allocated it.
Each 2 MiB-aligned chunk of the process's private anonymous memory that is at least MIN_RESIDENT
resident (mincore) is collapsed; a sparser one is left alone, as collapsing fills in its missing pages
(its resident size would grow). A later free inside a chunk splits it again (glibc's malloc_trim
returns free pages), so this runs once a model is loaded and trimmed (quantize.load_for_inference),
and again when a compiled step's package has loaded (engine.py), each time on the chunks that became
resident during that load only (collapsing_what_loads): the rest of the process is not copied again.

Nothing happens outside Linux, where the kernel has no MADV_COLLAPSE or THP is `never` (madvise answers
EINVAL: stopped at the first), or under GPT2_HUGE_PAGES=0.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import sys
from types import SimpleNamespace
from typing import Iterable

MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1
HUGE_PAGE = 2 << 20  # x86-64's PMD size
MIN_RESIDENT = 7 / 8  # of a chunk's pages: collapsing grows its resident size by at most 1/8
_RESIDENT_BIT = bytes(value & 1 for value in range(256))  # mincore's byte per page: bit 0, the rest reserved


def enabled() -> bool:
    """Linux, and not turned off (GPT2_HUGE_PAGES=0); read at each call, so a process may change it."""
    return sys.platform.startswith("linux") and os.environ.get("GPT2_HUGE_PAGES", "1") != "0"


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


def anonymous_ranges() -> list[tuple[int, int]]:
    """(start, end) of the process's private, writable, anonymous mappings: glibc's heap, mmap'd blocks."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            name = fields[5] if len(fields) > 5 else ""
            if fields[1].startswith("rw") and fields[1][3] == "p" and name in ("", "[heap]"):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def resident_chunks() -> list[int]:
    """The 2 MiB-aligned chunks of anonymous_ranges() at least MIN_RESIDENT resident (their start addresses);
    none where mincore is not available."""
    libc = _libc()
    if libc is None:
        return []
    ranges = anonymous_ranges()
    resident = ctypes.create_string_buffer(HUGE_PAGE // os.sysconf("SC_PAGE_SIZE"))
    most_missing = int((1 - MIN_RESIDENT) * len(resident.raw))
    chunks = []
    for start, end in ranges:
        for chunk in range(-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE, HUGE_PAGE):
            # mincore fails where the range was unmapped since the maps were read
            if libc.mincore(chunk, HUGE_PAGE, resident) == 0 and \
                    resident.raw.translate(_RESIDENT_BIT).count(0) <= most_missing:
                chunks.append(chunk)
    return chunks


def collapse_into_huge_pages(chunks: Iterable[int] | None = None) -> int:
    """Collapse each of chunks (2 MiB-aligned addresses; default: every resident_chunks()) into a huge page.
    Returns the bytes collapsed, those already in huge pages among them."""
    libc = _libc() if enabled() else None
    if libc is None:
        return 0
    try:
        chunks = resident_chunks() if chunks is None else chunks
    except OSError:
        return 0
    collapsed = 0
    for chunk in chunks:
        if libc.madvise(chunk, HUGE_PAGE, MADV_COLLAPSE) == 0:
            collapsed += HUGE_PAGE
        elif ctypes.get_errno() == errno.EINVAL:
            return collapsed  # no MADV_COLLAPSE in this kernel, or THP `never`: no chunk will do
        # else EAGAIN / ENOMEM (no free huge page now): that chunk stays in 4 KB pages
    return collapsed


@contextlib.contextmanager
def collapsing_what_loads(on: bool = True):
    """Collapse into huge pages the chunks that become resident inside the block (what a load brought in),
    none of the rest of the process's memory, whose copying a later load would pay again. Yields a
    namespace whose `bytes` holds the bytes collapsed once the block has run."""
    done = SimpleNamespace(bytes=0)
    try:
        before = set(resident_chunks()) if on and enabled() else None
    except OSError:
        before = None
    yield done
    if before is not None:
        done.bytes = collapse_into_huge_pages([chunk for chunk in resident_chunks() if chunk not in before])
