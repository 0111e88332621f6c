"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), for
replaying a Run's allocations and frees and predicting what `max_memory_allocated()` and
`max_memory_reserved()` would say on a GPU.

What it mirrors (the native allocator, one device, one stream, no expandable segments):

- every request is rounded up to a multiple of 512 bytes (`round_size`, kMinBlockSize);
  a 0-byte request takes no memory at all (PyTorch returns a null pointer);
- requests of at most 1 MiB (kSmallSize) are served from the small pool, whose segments
  are 2 MiB (kSmallBuffer); larger ones from the large pool, whose segments are 20 MiB
  (kLargeBuffer) for requests under 10 MiB (kMinLargeAlloc) and the request rounded up to
  2 MiB (kRoundLarge) from 10 MiB on (`get_allocation_size`);
- a request takes the best-fitting free block of its pool: the smallest that is large
  enough, the lowest address among equals (`get_free_block`, a lower_bound on
  (size, address)); so equal blocks tie as on a GPU, new segments get the addresses the
  CUDA driver gives them (`DriverSpace`: the first side by side in the process's first
  chunk of addresses, then each in a slot of its size rounded up to 32 MiB, below the slots
  before it; a later segment takes the lowest place that fits);
- the block is split when what remains is worth keeping: >= 512 bytes in the small pool,
  > 1 MiB in the large pool (`should_split`); otherwise the whole block is handed out and
  counts as allocated, which is why `max_memory_allocated()` can exceed the bytes asked for;
- a free block is merged with free neighbours of its segment (`free_block`,
  `try_merge_blocks`); segments are never returned to the device unless an allocation
  fails: then cached blocks larger than max_split_size are released (only when
  max_split_size is set: `release_available_cached_blocks`), then every entirely free
  segment (`release_cached_blocks`, what `empty_cache()` does), and the allocation is
  retried once; if it still does not fit, that is the out-of-memory error;
- `max_split_size_mb` (PYTORCH_CUDA_ALLOC_CONF): blocks of at least that size are never
  split, a request below it never takes such a block, and a request at or above it takes
  a cached block only if that wastes less than max_non_split_rounding_size (default 20 MiB).

"allocated" is the sum of the sizes of the blocks handed out (rounded, and unsplit remains
included), as PyTorch's allocated_bytes stat; "reserved" is the sum of the segments.

Not modelled: several streams (a block freed on one stream is reused only by that stream),
expandable_segments, roundup_power2_divisions, garbage_collection_threshold, CUDA graphs'
private pools, and the device's own limit (only a given `capacity`).

The free-block pools are sorted Python lists searched with bisect: O(log n) comparisons per
request and an O(n) memmove per insert or removal, which for the few hundred free blocks a
training step leaves is faster than any pure-Python balanced tree.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * 1024

K_MIN_BLOCK_SIZE = 512          # kMinBlockSize: every request is rounded up to a multiple of this
K_SMALL_SIZE = 1 * MiB          # kSmallSize: largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB        # kSmallBuffer: the small pool's segment size
K_LARGE_BUFFER = 20 * MiB       # kLargeBuffer: segment for large requests under kMinLargeAlloc
K_MIN_LARGE_ALLOC = 10 * MiB    # kMinLargeAlloc: from here on a request gets its own segment
K_ROUND_LARGE = 2 * MiB         # kRoundLarge: those segments are rounded up to this
UNLIMITED = None


def round_size(nbytes: int) -> int:
    """The allocator's rounding of a request (kMinBlockSize multiples, at least 512)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'ed for a (rounded) request no cached block can serve."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF settings the model honours."""
    max_split_size: int | None = UNLIMITED
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    ignored: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str | None) -> "AllocatorConfig":
        """Read a PYTORCH_CUDA_ALLOC_CONF string ("max_split_size_mb:128,..."); options the
        model does not implement are listed in `ignored`."""
        conf = cls()
        for item in (text or "").split(","):
            item = item.strip()
            if not item:
                continue
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "max_split_size_mb":
                mb = int(value)
                # PyTorch refuses values below kLargeBuffer / 1 MiB (20)
                conf.max_split_size = max(mb, K_LARGE_BUFFER // MiB) * MiB
            elif key == "max_non_split_rounding_mb":
                conf.max_non_split_rounding_size = int(value) * MiB
            elif key == "backend" and value == "native":
                pass
            elif key == "expandable_segments" and value.lower() in ("false", "0"):
                pass
            else:
                conf.ignored.append(item)
        return conf


class ModelOOM(Exception):
    """The modelled allocator could not serve a request within its capacity."""

    def __init__(self, requested: int, allocated: int, reserved: int, capacity: int):
        self.requested, self.allocated, self.reserved, self.capacity = requested, allocated, reserved, capacity
        super().__init__(f"modelled out of memory: tried to allocate {requested} bytes with "
                         f"{allocated} allocated, {reserved} reserved of {capacity}")


SLOT = 32 * MiB                 # the driver maps each new segment in a slot of a multiple of this
FIRST_CHUNK = 414 * MiB         # what the driver's first 512 MiB of a process leaves for segments
FIRST_CHUNK_LARGEST = 256 * MiB  # segments above this never go there


class DriverSpace:
    """The device addresses the CUDA driver gives new segments, as measured on the H200
    (benchmarks/zoo/zoo_traces.py records them). A process's first 512 MiB of addresses hold
    its first segments, side by side upwards from the bottom, less the top 98 MiB the driver
    and libraries take first (`first_chunk`; a segment over 256 MiB never goes there). Below
    it each segment takes a slot of its size rounded up to 32 MiB, each slot below the ones
    before. A new segment takes the lowest place that fits: the unused top of a slot (a 16 or
    20 MiB segment leaves 16 or 12 MiB), the first chunk's free space, else a new slot.

    The address order matters because the allocator breaks ties between equal free blocks by
    address: whichever segment is split first decides which whole one is left for a later
    request, and that can change the reserved peak by a sixth (DeBERTa-v2).

    What it leaves out: memory mapped by anything besides the caching allocator, which takes
    addresses between segments: the kernels the driver loads at their first use (about 10 MiB,
    and 64-74 MiB at the first matrix multiply) leave the first chunk with holes that decide
    which later segments still fit there (HuBERT checkpointed at batch 4 reserves 5% more on
    the H200 than with the chunk whole). The rule is read from recorded traces
    (benchmarks/placement_replay.py replays them: the GPU's reserved bytes on 32 of 36);
    `first_chunk=0` gives the slots alone and `slot=None` each segment right below the last,
    plainer rules that reserve the GPU's bytes on fewer (`placements`)."""

    def __init__(self, top: int = 1 << 48, slot: int | None = SLOT, first_chunk: int = FIRST_CHUNK):
        self.bottom = top - first_chunk
        self.slot = slot
        self.first_chunk = first_chunk
        self.spare: list[tuple[int, int]] = []      # (address, bytes) unused in slots, sorted
        self.chunk_start = self.bottom
        self.chunk: list[tuple[int, int]] = [(self.bottom, first_chunk)] if first_chunk else []

    def place(self, size: int) -> int:
        for places in self._lowest_first(size):
            for i, (addr, free) in enumerate(places):
                if free >= size:
                    if free > size:
                        places[i] = (addr + size, free - size)
                    else:
                        del places[i]
                    return addr
        if self.slot is None:                       # right below the last, never adjacent
            self.bottom -= size + K_ROUND_LARGE
            return self.bottom
        slot = self.slot * ((size + self.slot - 1) // self.slot)
        self.bottom -= slot
        if slot > size:
            bisect.insort(self.spare, (self.bottom + size, slot - size))
        return self.bottom

    def _lowest_first(self, size: int) -> list[list[tuple[int, int]]]:
        """The lists of free places to search in address order: the slots' tops lie below
        the first chunk."""
        return [self.spare, self.chunk] if size <= FIRST_CHUNK_LARGEST else [self.spare]

    def release(self, addr: int, size: int) -> None:
        bisect.insort(self.chunk if addr >= self.chunk_start else self.spare, (addr, size))


def placements() -> dict[str, DriverSpace]:
    """The driver's rule and two plainer ones, by name, as benchmarks/placement_replay.py
    compares them on recorded traces: its slots alone, and each segment right below the last."""
    return {"driver": DriverSpace(), "slots": DriverSpace(first_chunk=0), "packed": DriverSpace(slot=None, first_chunk=0)}


class Block:
    __slots__ = ("addr", "size", "requested", "small", "prev", "next", "allocated", "seg_addr")

    def __init__(self, addr: int, size: int, small: bool, seg_addr: int):
        self.addr = addr
        self.size = size
        self.requested = 0
        self.small = small
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.seg_addr = seg_addr

    @property
    def whole_segment(self) -> bool:
        return self.prev is None and self.next is None

    def __repr__(self) -> str:
        state = "used" if self.allocated else "free"
        return f"<Block {state} {self.size} @{self.addr:#x}>"


class _Pool:
    """Free blocks sorted by (size, address), as the allocator's std::set<Block*>."""
    __slots__ = ("keys", "blocks", "small")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        bisect.insort(self.keys, (block.size, block.addr))
        self.blocks[block.addr] = block

    def remove(self, block: Block) -> None:
        key = (block.size, block.addr)
        i = bisect.bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            del self.keys[i]
        del self.blocks[block.addr]

    def lower_bound(self, size: int) -> Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        if i == len(self.keys):
            return None
        return self.blocks[self.keys[i][1]]

    def __len__(self) -> int:
        return len(self.keys)


class CachingAllocatorModel:
    """Replay allocations and frees; read allocated/reserved and their peaks.

    `capacity` (bytes, None: unlimited) plays the device memory, or the limit set by
    `torch.cuda.set_per_process_memory_fraction`: a segment that would take reserved past
    it fails, cached segments are released and the request retried, then ModelOOM.
    """

    def __init__(self, capacity: int | None = None, config: AllocatorConfig | None = None,
                 driver: DriverSpace | None = None):
        self.capacity = capacity
        self.config = config or AllocatorConfig()
        self.small_pool = _Pool(True)
        self.large_pool = _Pool(False)
        self.segments: dict[int, int] = {}      # segment address -> size
        self.driver = driver or DriverSpace()   # where the next segments go
        self.addresses: list[int] = []  # where given (a GPU's recorded segments), the next ones' addresses
        self.allocated = 0
        self.reserved = 0
        self.requested = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_requested = 0
        self.num_allocs = 0
        self.num_segment_allocs = 0
        self.num_segment_frees = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # ---- public -----------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block | None:
        """Allocate `nbytes`; None for a 0-byte request. Raises ModelOOM."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        pool = self.small_pool if small else self.large_pool
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_segment(pool, size, nbytes)
        block = self._split(pool, block, size)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        self.requested += nbytes
        self.num_allocs += 1
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return block

    def free(self, block: Block | None) -> None:
        if block is None:
            return
        if not block.allocated:
            raise ValueError(f"double free of {block!r}")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        block.requested = 0
        pool = self.small_pool if block.small else self.large_pool
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:      # absorb the free block before it
            pool.remove(prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated:        # and the free block after it
            pool.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        pool.add(block)

    def map_outside(self, nbytes: int) -> None:
        """Memory the driver maps besides the allocator's segments (a library's handle): it
        takes the addresses the next segments would have had (DriverSpace), and no bytes of
        allocated or reserved."""
        if not self.addresses:
            self.driver.place(nbytes)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): return every entirely free segment."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested

    @property
    def cached_free(self) -> int:
        """Reserved but not allocated ("reserved but unallocated" in an OOM message)."""
        return self.reserved - self.allocated

    def stats(self) -> dict[str, int]:
        return {
            "allocated_bytes": self.allocated, "reserved_bytes": self.reserved,
            "requested_bytes": self.requested,
            "peak_allocated_bytes": self.peak_allocated, "peak_reserved_bytes": self.peak_reserved,
            "peak_requested_bytes": self.peak_requested,
            "segments": len(self.segments), "num_allocs": self.num_allocs,
            "num_segment_allocs": self.num_segment_allocs, "num_segment_frees": self.num_segment_frees,
            "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
            "free_blocks_small": len(self.small_pool), "free_blocks_large": len(self.large_pool),
        }

    # ---- the allocator's steps -----------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> Block | None:
        block = pool.lower_bound(size)
        if block is None:
            return None
        mss = self.config.max_split_size
        if mss is not None:
            if size < mss and block.size >= mss:
                return None     # do not hand an oversize block to a small request
            if size >= mss and block.size >= size + self.config.max_non_split_rounding_size:
                return None     # nor one that would waste too much
        pool.remove(block)
        return block

    def _alloc_segment(self, pool: _Pool, size: int, nbytes: int) -> Block:
        seg = allocation_size(size)
        if self._fits(seg):
            return self._new_segment(pool, seg)
        self.num_alloc_retries += 1
        if self._release_available_cached_blocks(pool, size) and self._fits(seg):
            return self._new_segment(pool, seg)
        self._release_cached_blocks()
        if self._fits(seg):
            return self._new_segment(pool, seg)
        self.num_ooms += 1
        raise ModelOOM(nbytes, self.allocated, self.reserved, self.capacity)

    def _fits(self, seg: int) -> bool:
        return self.capacity is None or self.reserved + seg <= self.capacity

    def _new_segment(self, pool: _Pool, seg: int) -> Block:
        addr = self.addresses.pop() if self.addresses else self.driver.place(seg)
        self.segments[addr] = seg
        self.reserved += seg
        self.num_segment_allocs += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return Block(addr, seg, pool.small, addr)

    def _split(self, pool: _Pool, block: Block, size: int) -> Block:
        remaining = block.size - size
        if pool.small:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            mss = self.config.max_split_size
            split = (mss is None or size < mss) and remaining > K_SMALL_SIZE
        if not split:
            return block
        rest = Block(block.addr + size, remaining, block.small, block.seg_addr)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        pool.add(rest)
        return block

    def _release_segment(self, pool: _Pool, block: Block) -> None:
        pool.remove(block)
        del self.segments[block.seg_addr]
        self.driver.release(block.seg_addr, block.size)
        self.reserved -= block.size
        self.num_segment_frees += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Only with max_split_size set: free one cached oversize block that is large
        enough, else oversize blocks from the largest down until enough is freed."""
        mss = self.config.max_split_size
        if mss is None:
            return False
        key = max(size, mss)
        i = bisect.bisect_left(pool.keys, (key, -1))
        while i < len(pool.keys):       # the smallest cached block that is large enough
            block = pool.blocks[pool.keys[i][1]]
            if block.whole_segment:
                self._release_segment(pool, block)
                return True
            i += 1
        released = 0                    # else oversize blocks, largest first, until enough
        for size_, addr in reversed(pool.keys[:]):
            if released >= key or size_ < mss:
                break
            block = pool.blocks[addr]
            if block.whole_segment:
                released += block.size
                self._release_segment(pool, block)
        return released >= key

    def _release_cached_blocks(self) -> None:
        for pool in (self.large_pool, self.small_pool):
            for block in [b for b in pool.blocks.values() if b.whole_segment]:
                self._release_segment(pool, block)


def replay_trace(events, segment_addresses: list[int] | None = None,
                 driver: DriverSpace | None = None) -> CachingAllocatorModel:
    """Replay [action, n, bytes] events (1: allocate `bytes` as allocation n, 0: free
    allocation n) through a fresh model; what tests and benchmarks feed it from a GPU's
    recorded allocator trace. `segment_addresses`: the addresses the GPU's driver gave its
    segments, in order, for the model's (the driver's order decides between equal free
    blocks; without them, where `driver`, by default DriverSpace's slots, puts them)."""
    model = CachingAllocatorModel(driver=driver)
    model.addresses = list(reversed(segment_addresses or []))
    blocks = {}
    for action, n, size in events:
        if action == 1:
            blocks[n] = model.malloc(size)
        else:
            model.free(blocks.pop(n))
    return model
