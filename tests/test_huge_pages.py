"""huge_pages.py: resident anonymous memory collapses into 2 MiB pages, sparse memory is left as it was,
the bytes stay the same, a load's block collapses only what it brought in, and GPT2_HUGE_PAGES=0 leaves
everything alone. The kernel's own account
(/proc/self/smaps: AnonHugePages, Rss) is the reference."""

import ctypes
import mmap
import sys
from pathlib import Path

import pytest

from gpt2.huge_pages import HUGE_PAGE, MIN_RESIDENT, collapse_into_huge_pages, collapsing_what_loads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's transparent huge pages")


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


def _smaps_of(address: int) -> dict[str, int]:
    """The kB fields of the mapping holding address, from /proc/self/smaps."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(a, 16) for a in head[0].split("-"))
            inside = start <= address < end
        elif inside and len(head) == 3 and head[2] == "kB":
            fields[head[0].rstrip(":")] = int(head[1])
    return fields


def _region(chunks: int):
    """A private anonymous mapping holding `chunks` whole 2 MiB-aligned chunks: (mapping, first chunk's offset)."""
    region = mmap.mmap(-1, (chunks + 1) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    return region, -start % HUGE_PAGE


def _touch(region, offset: int, pages: range) -> None:
    for page in pages:
        region[offset + page * 4096] = (page % 251) + 1


@pytest.fixture
def collapsing():
    if _thp_mode() in ("never", "absent"):
        pytest.skip(f"transparent huge pages are {_thp_mode()} here")
    region, offset = _region(1)
    _touch(region, offset, range(HUGE_PAGE // 4096))
    address = ctypes.addressof(ctypes.c_char.from_buffer(region)) + offset
    if collapse_into_huge_pages([address]) == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1), or no free huge page")
    region.close()


def test_resident_memory_collapses_into_huge_pages_with_its_bytes_unchanged(collapsing):
    region, offset = _region(4)
    _touch(region, offset, range(4 * HUGE_PAGE // 4096))
    before = bytes(region[offset: offset + 4 * HUGE_PAGE])
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert _smaps_of(address)["AnonHugePages"] < 4 * HUGE_PAGE // 1024 or _thp_mode() == "always"
    moved = collapse_into_huge_pages()
    assert moved >= 4 * HUGE_PAGE
    assert _smaps_of(address)["AnonHugePages"] >= 4 * HUGE_PAGE // 1024
    assert bytes(region[offset: offset + 4 * HUGE_PAGE]) == before


def test_sparse_memory_is_left_in_small_pages(collapsing):
    if _thp_mode() == "always":
        pytest.skip("THP `always` faults whole huge pages in: nothing stays sparse")
    region, offset = _region(2)
    pages = HUGE_PAGE // 4096
    missing = int((1 - MIN_RESIDENT) * pages) + 1  # one page more than a collapse may fill in
    _touch(region, offset, range(pages - missing))
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    rss = _smaps_of(address)["Rss"]
    collapse_into_huge_pages()
    assert _smaps_of(address)["Rss"] == rss
    assert _smaps_of(address)["AnonHugePages"] == 0


def test_gpt2_huge_pages_0_leaves_every_page(collapsing, monkeypatch):
    monkeypatch.setenv("GPT2_HUGE_PAGES", "0")
    region, offset = _region(2)
    _touch(region, offset, range(2 * HUGE_PAGE // 4096))
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    huge = _smaps_of(address)["AnonHugePages"]
    assert collapse_into_huge_pages() == 0
    assert _smaps_of(address)["AnonHugePages"] == huge


def test_a_load_collapses_only_the_memory_it_brought_in(collapsing):
    if _thp_mode() == "always":
        pytest.skip("THP `always` faults whole huge pages in: the memory before the block is huge already")
    earlier, offset = _region(2)
    earlier.madvise(mmap.MADV_DONTFORK)  # its own VMA flags: the kernel does not merge the next mapping into it
    _touch(earlier, offset, range(2 * HUGE_PAGE // 4096))
    earlier_address = ctypes.addressof(ctypes.c_char.from_buffer(earlier))
    with collapsing_what_loads() as collapsed:
        loaded, loaded_offset = _region(2)
        _touch(loaded, loaded_offset, range(2 * HUGE_PAGE // 4096))
    loaded_address = ctypes.addressof(ctypes.c_char.from_buffer(loaded))
    assert collapsed.bytes >= 2 * HUGE_PAGE
    assert _smaps_of(loaded_address)["AnonHugePages"] >= 2 * HUGE_PAGE // 1024
    assert _smaps_of(earlier_address)["AnonHugePages"] == 0
