"""Out-of-memory messages of every PyTorch era, allocator and vendor -> OOMFacts.

Users paste whatever they have: a traceback from an issue, a 10 GB cluster log, a web UI
dialog that collapsed every newline. So the scanner never assumes a message sits alone on
a clean line. It works in three steps:

1. Hits. A few literal needles ("out of memory", "Tried to allocate", "ALLOC_FAILED", ...)
   are looked up with `str.find`, which runs at memory speed; almost every line of a real
   log is rejected here without any regex work.
2. Anchor. Around a hit, the text is *squashed* (all whitespace removed) so a message that
   a console wrapped mid-word, or whose newlines were turned into spaces, reads the same
   as a clean one; there a table of message heads says where a known message starts.
3. Grammar. From the anchor, the lines that follow are joined after removing the prefix
   they share with the first line of the message ("[rank0]: ", "> ", "# ", timestamps),
   squashed again, and read clause by clause with the grammar of that message family.
   The message ends where no clause matches, so noise after it is never read as a field.

Numbers are kept as printed (rounded values, allocated > total, 2**64 limits): the
message is evidence and memdoctor must not "correct" it. Sizes use 1024 powers for every
unit, GB and MB included, as PyTorch itself does.

One module because the needles, the table of message heads and the per-family grammars are
one scanner: each family's clauses are only meaningful next to the anchor that selects them.
"""
from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import IO

from memdoctor.capture.logtext import strip_escapes, text_blocks
from memdoctor.limits import Allowance

__all__ = ["OOMFacts", "LogError", "KINDS", "parse_text", "scan_file", "scan_stream"]

KINDS = ("cuda_caching_allocator", "cublas", "cudnn", "cuda_driver", "cpu", "mps", "hip", "other")

_EXPECTED_KEYS = (
    "kind", "requested_bytes", "gpu_index", "total_capacity_bytes", "free_bytes",
    "allowed_bytes", "process_in_use_bytes", "other_processes",
    "allocated_by_pytorch_bytes", "reserved_unallocated_bytes", "reserved_total_bytes",
)

TEXT_LIMIT = 2000           # characters of a message kept in OOMFacts.text
TEXT_KEPT = 1000            # messages that keep their text; those after keep their numbers
FACTS_COST = 1024           # what one message's OOMFacts takes, its text aside
BLOCK = 4 << 20             # bytes read at a time by scan_file
_BEHIND = 600               # how far before a hit a message may start
_AHEAD = 512                # how far after a hit its anchor phrase may reach
_MARGIN = 64                # a needle this close to a window's end is looked at again
_CONTEXT = 400              # text before a message that may describe it (class, NCCL rank)
_SPAN = 8192                # the most raw text one message may cover (wrapped, prefixed)
_SQUASHED_ENOUGH = 3000     # a message never squashes to more than this
_CARRY = _BEHIND + _AHEAD + _SPAN   # tail kept between blocks so no message is cut


@dataclass
class OOMFacts:
    """What one out-of-memory message says, in bytes, exactly as printed.

    A field is None when the message does not show it. `line` is 1-based, counted in
    '\\n'-separated lines of the input. `text` is the message as found (line prefixes of
    continuation lines removed, cut at TEXT_LIMIT characters; empty after the first
    TEXT_KEPT messages of a log, so that a log of a million OOMs stays small). `extra` holds what only
    some formats carry: private_pool_allocated_bytes, allowed_is_unlimited,
    mps_other_allocations_bytes, mps_pool, device, subsystem, exception, ambiguous...
    """
    kind: str
    requested_bytes: int | None = None
    gpu_index: int | None = None
    total_capacity_bytes: int | None = None
    free_bytes: int | None = None
    allowed_bytes: int | None = None
    process_in_use_bytes: int | None = None
    other_processes: list[dict] | None = None
    allocated_by_pytorch_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    reserved_total_bytes: int | None = None
    line: int = 0
    text: str = ""
    extra: dict = field(default_factory=dict)

    def expected(self) -> dict:
        """The fields the labelled corpus records, so a parse compares with one `==`."""
        out = {key: getattr(self, key) for key in _EXPECTED_KEYS}
        if out["other_processes"] is not None:
            out["other_processes"] = [dict(p) for p in out["other_processes"]]
        return out


class LogError(Exception):
    """A log file that cannot be read (missing, a directory, no permission)."""


# --------------------------------------------------------------------------- sizes
# Squashed text has no spaces, so a size is digits glued to its unit. Digit runs are
# bounded: a fuzzed "1" * 5000 must not reach int() or float() (limits, inf).
_NUM = r"\d{1,30}(?:\.\d{1,30})?"
_UNIT = r"bytes|[KMGTPE]i?B|B"
_SIZE = rf"({_NUM})({_UNIT})"
_SIZE_NC = rf"{_NUM}(?:{_UNIT})"
_SCALE = {"bytes": 1, "B": 1}
for _i, _p in enumerate("KMGTPE", start=1):
    _SCALE[_p + "B"] = _SCALE[_p + "iB"] = 1024 ** _i


def _size(number: str, unit: str) -> int:
    """Bytes as the message printed them: round(14.08 * 1024**3), integers kept exact."""
    if "." not in number:
        return int(number) * _SCALE[unit]
    return round(float(number) * _SCALE[unit])


def _sz(match: re.Match, group: int = 1) -> int:
    return _size(match.group(group), match.group(group + 1))


# ------------------------------------------------------------------ hits and anchors
# Each family has several needles, so a console that wraps a line in the middle of one
# still leaves another whole.
_NEEDLES = (
    "out of memory", "OutOfMemory", "OUT_OF_MEMORY", "ried to allocate", "larger than 4GB",
    "exceed allowed", "MPS backend", "DefaultCPUAllocator", "posix_memalign", "_STATUS_",
    "ALLOC_FAILED", "NOT_INITIALIZED", "valid cuDNN", "CUDA error", "THCudaCheck",
    "error (2)", "Cuda failure", "CUDA calloc", "CUresult",
)

# Where a known message starts, in squashed text: per family, (head, rest) pairs where
# `head` is plain text. Two regexes are built from the table: _HEADS, a flat alternation
# of the heads that re scans fast (every branch starts with a literal), to find where a
# message may start; and _START, matched only there, to say which family it is. The
# order matters where heads overlap: the first family that matches wins.
_ANCHORS = [
    ("simulated", [(d + "outofmemory(memdoctorbudget,simulated).", "") for d in ("CUDA", "CPU")]),
    ("alloc", [(d + "outofmemory.", "(?=Triedtoallocate)") for d in ("CUDA", "HIP", "XPU")]),
    ("headless", [("Triedtoallocate", rf"(?={_SIZE_NC}(?:\(GPU\d|\.?GPU\d+hasatotal))")]),
    ("xpu_4gb", [("CurrentplatformcanNOTallocatememoryblockwithsizelargerthan4GB!", "")]),
    # Only right after an exception class (checked on the raw text): "CUDA out of
    # memory" alone is also what people write in hints and prose.
    ("bare", [(d + "outofmemory", r"\.?") for d in ("CUDA", "HIP", "XPU")]),
    ("malloc_async", [("Allocationondevice", r"\d{1,6}wouldexceedallowedmemory")]),
    ("mps", [("MPSbackendoutofmemory", "")]),
    ("cpu", [("DefaultCPUAllocator:", "(?:can'tallocatememory|notenoughmemory)"),
             ("posix_memalign(&data,gAlignment,nbytes)==0.12vs0", "")]),
    ("cublas", [(h + "CUBLAS_STATUS_", "(?:ALLOC_FAILED|NOT_INITIALIZED)")
                for h in ("CUDAerror:", "")]),
    ("cudnn", [(h + "CUDNN_STATUS_", "(?:ALLOC_FAILED|NOT_INITIALIZED)")
               for h in ("cuDNNerror:", "ErrorinCuDNN:", "")]
              + [("UnabletofindavalidcuDNNalgorithm", "")]),
    ("driver", [(h + "outofmemory", "") for h in (
                   "CUDAerror:", "HIPerror:", "CUDAdrivererror:", "HIPdrivererror:",
                   "cudaruntimeerror(2):", "TritonError[CUDA]:")]
               + [("THCudaCheckFAILfile=", r".{0,400}?line=\d{1,9}error=2:outofmemory"),
                  ("CUDA_ERROR_OUT_OF_MEMORY", ""), ("hipErrorOutOfMemory", "")]),
    ("nccl", [("Cudafailure", r"\d{0,3}'outofmemory'"), ("FailedtoCUDAcalloc", r"\d{1,30}bytes")]),
    ("curesult", [("CUresulterror", r"(?:result=)?2(?!\d)")]),
]
_START = re.compile("|".join(
    f"(?P<{family}>" + "|".join(re.escape(head) + rest for head, rest in forms) + ")"
    for family, forms in _ANCHORS))
_HEADS = re.compile("|".join(sorted({re.escape(head) for _, forms in _ANCHORS for head, _ in forms})))

_RUNS = re.compile(r"\S+")
_EXCEPTION_TAIL = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception))\s*:\s*$")
# What belongs to the message although it precedes the anchor: the exception class, and
# c10's "[enforce fail at alloc_cpu.cpp:75] err == 0. " before DefaultCPUAllocator.
_HEAD_TAIL = re.compile(r"(?:([A-Za-z_][\w.]*(?:Error|Exception))\s*:\s*)?"
                        r"(\[enforce fail at [^\]\n]{1,300}\][^\[\]\n]{0,60})?$")
_DIGITS_TO_ZERO = str.maketrans("123456789", "000000000")
_PREFIX_BOUNDARY = frozenset(" \t:]>|#)")


class _Squashed:
    """Text with whitespace removed, and the way back to raw offsets.

    Squashing runs in C (str.split); the offset map of a piece is only built when a
    position inside it is asked for, which happens a few times per message."""

    def __init__(self, pieces: list[tuple[int, str]], budget: int | None = None):
        self.pieces, self.starts, parts = [], [], []
        n = 0
        for raw_start, text in pieces:
            squashed = "".join(text.split())
            self.pieces.append((raw_start, text))
            self.starts.append(n)
            parts.append(squashed)
            n += len(squashed)
            if budget is not None and n >= budget:
                break
        self.text = "".join(parts)

    def to_raw(self, k: int) -> int:
        i = bisect.bisect_right(self.starts, k) - 1
        raw_start, text = self.pieces[i]
        left = k - self.starts[i]
        for run in _RUNS.finditer(text):
            size = run.end() - run.start()
            if left < size:
                return raw_start + run.start() + left
            left -= size
        return raw_start + len(text)


def _shape(text: str) -> str:
    """The start of a line with every digit made 0, so timestamps compare equal."""
    return text[:200].translate(_DIGITS_TO_ZERO)


def _shared_prefix(reference: str, line: str, shape: str) -> int:
    """Length of the line prefix ("[rank0]: ", "> ", "# ", a timestamp) that `line` (whose
    _shape is `shape`) shares with `reference`, an already shaped text. The cut falls on
    a separator, so a word that merely starts alike is kept."""
    lo, hi = 0, min(len(reference), len(shape))
    if hi and reference[0] != shape[0]:
        return 0
    while lo < hi:                              # longest n with equal first n characters
        mid = (lo + hi + 1) // 2
        if reference[:mid] == shape[:mid]:
            lo = mid
        else:
            hi = mid - 1
    n = lo
    while n and line[n - 1] not in _PREFIX_BOUNDARY:
        n -= 1
    return n if line[:n].strip() else 0


# ------------------------------------------------------------------------ grammars
def _clauses(sq: str, pos: int, clauses, facts: OOMFacts) -> int:
    """Read known clauses, in any order, until none matches; return where it stopped."""
    moved = True
    while moved:
        moved = False
        for rx, apply in clauses:
            m = rx.match(sq, pos)
            if m:
                apply(facts, m)
                pos = m.end()
                moved = True
                break
    return pos


def _setter(name: str, group: int = 1):
    def apply(facts: OOMFacts, m: re.Match) -> None:
        setattr(facts, name, _sz(m, group))
    return apply


def _extra_setter(key: str, group: int = 1):
    def apply(facts: OOMFacts, m: re.Match) -> None:
        facts.extra[key] = _sz(m, group)
    return apply


def _ignore(facts: OOMFacts, m: re.Match) -> None:
    pass


def _other_process(facts: OOMFacts, m: re.Match) -> None:
    if facts.other_processes is None:
        facts.other_processes = []
    facts.other_processes.append({"pid": int(m.group(1)), "bytes": _sz(m, 2)})


def _gpu_total_free(facts: OOMFacts, m: re.Match) -> None:
    facts.gpu_index = int(m.group(1))
    facts.total_capacity_bytes = _sz(m, 2)
    if m.group(4) is not None:
        facts.free_bytes = _sz(m, 4)


def _budget(facts: OOMFacts, m: re.Match) -> None:
    facts.allowed_bytes = _sz(m, 1)
    facts.free_bytes = _sz(m, 3)


def _c(pattern: str) -> re.Pattern:
    return re.compile(pattern)


# Sentences PyTorch and CUDA append after the numbers; read so the message ends after them.
_HINTS = [(_c(p), _ignore) for p in (
    r"Ifreserved.{0,160}?toavoidfragmentation\.",
    r"SeedocumentationforMemoryManagement"
    r"(?:andPYTORCH_(?:CUDA_|HIP_)?ALLOC_CONF\.?|\(https?://[^)]{0,200}\)\.?)?",
    r"Pleaseuse`empty_cache`toreleaseallunoccupiedcachedmemory\.",
    r"(?:CUDA|HIP)kernelerrorsmightbeasynchronouslyreportedatsomeotherAPIcall,"
    r"(?:so)?thestacktracebelowmightbeincorrect\.",
    r"Fordebuggingconsiderpassing[A-Z_]{1,40}=1\.?",
    r"Compilewith`TORCH_USE_(?:CUDA|HIP)_DSA`toenabledevice-sideassertions\.",
    r"Searchfor`\w{1,60}'in.{0,200}?formoreinformation\.",
)]

_TRIED = _c(rf"Triedtoallocate(?:(morethan1EBmemory)|{_SIZE})\.?")

# PyTorch >= 2.1: sentences.
_NEW_CLAUSES = [
    (_c(rf"\.?GPU(\d{{1,6}})hasatotalcapac(?:i)?tyof{_SIZE}(?:ofwhich{_SIZE}isfree\.?)?"),
     _gpu_total_free),
    (_c(rf"Process(\d{{1,12}})has{_SIZE}memoryinuse\.?"), _other_process),
    (_c(rf"Includingnon-PyTorchmemory,thisprocesshas{_SIZE}memoryinuse\.?"),
     _setter("process_in_use_bytes")),
    (_c(rf"{_SIZE}allowed;?"), _setter("allowed_bytes")),
    (_c(rf"Oftheallocatedmemory{_SIZE}isallocatedbyPyTorch,?"),
     _setter("allocated_by_pytorch_bytes")),
    (_c(rf"with{_SIZE}allocatedinprivatepools(?:\([^)]{{0,40}}\))?,?"),
     _extra_setter("private_pool_allocated_bytes")),
    (_c(rf"and{_SIZE}isreservedbyPyTorchbutunallocated\.?"),
     _setter("reserved_unallocated_bytes")),
    (_c(rf"Budgetof{_SIZE}ofwhich{_SIZE}isfree\.?"), _budget),
] + _HINTS

# PyTorch < 2.1: "(GPU 0; 11.17 GiB total capacity; 10.90 GiB already allocated; ...)".
_OLD_OPEN = _c(r"\(GPU(\d{1,6});")
_OLD_CLAUSE = _c(rf"{_SIZE}([A-Za-z]{{1,40}})(;|\))?")
_OLD_LABELS = {
    "totalcapacity": "total_capacity_bytes",
    "alreadyallocated": "allocated_by_pytorch_bytes",
    "free": "free_bytes",
    "cached": "reserved_unallocated_bytes",   # printed reserved minus allocated
    "reservedintotalbyPyTorch": "reserved_total_bytes",
    "allowed": "allowed_bytes",
}


def _old_parens(sq: str, pos: int, facts: OOMFacts) -> int:
    m = _OLD_OPEN.match(sq, pos)
    if not m:
        return pos
    facts.gpu_index = int(m.group(1))
    pos = m.end()
    while (m := _OLD_CLAUSE.match(sq, pos)):
        name = _OLD_LABELS.get(m.group(3))
        if name:
            setattr(facts, name, _sz(m))
        pos = m.end()
        if m.group(4) != ";":
            break
    return pos


def _read_tried(sq: str, pos: int, facts: OOMFacts) -> int:
    m = _TRIED.match(sq, pos)
    if not m:
        return pos
    if m.group(1):
        facts.extra["requested_at_least_bytes"] = 1 << 60   # "more than 1EB": no number
    else:
        facts.requested_bytes = _sz(m, 2)
    return m.end()


def _parse_alloc(sq: str, m: re.Match, pre: str):
    """The caching allocator of CUDA, HIP and XPU, in the old (parenthesised) or the new
    (sentences) layout, whole or with its head or tail cut off."""
    group, head = m.lastgroup, m.group()
    if group == "xpu_4gb":
        facts = OOMFacts("other", extra={"device": "xpu",
                                         "single_allocation_limit_bytes": 4 << 30})
    elif group == "headless":
        facts = OOMFacts("cuda_caching_allocator")
    else:
        device = head[:head.index("outofmemory")]
        facts = OOMFacts({"CUDA": "cuda_caching_allocator", "HIP": "hip"}.get(device, "other"))
        if device == "XPU":
            facts.extra["device"] = "xpu"
    pos = m.start() if group == "headless" else m.end()
    pos = _read_tried(sq, pos, facts)
    after_old = _old_parens(sq, pos, facts)
    if after_old != pos:
        return facts, _clauses(sq, after_old, _HINTS, facts)
    return facts, _clauses(sq, pos, _NEW_CLAUSES, facts)


def _parse_simulated(sq: str, m: re.Match, pre: str):
    facts = OOMFacts("cpu" if m.group().startswith("CPU") else "cuda_caching_allocator",
                     extra={"simulated": True})
    pos = _read_tried(sq, m.end(), facts)
    return facts, _clauses(sq, pos, _NEW_CLAUSES, facts)


_ASYNC_HEAD = _c(r"Allocationondevice(\d{1,6})wouldexceedallowedmemory\.?(?:\(outofmemory\))?")
_ASYNC_CLAUSES = [
    (_c(rf"Currentlyallocated:{_SIZE}"), _setter("allocated_by_pytorch_bytes")),
    (_c(rf"Requested:{_SIZE}"), _setter("requested_bytes")),
    (_c(rf"Devicelimit:{_SIZE}"), _setter("total_capacity_bytes")),
    (_c(rf"Free\(accordingtoCUDA\):{_SIZE}"), _setter("free_bytes")),
    (_c(rf"PyTorchlimit\(setbyuser-suppliedmemoryfraction\):{_SIZE}"), _setter("allowed_bytes")),
]


def _parse_malloc_async(sq: str, m: re.Match, pre: str):
    """cudaMallocAsync backend: 'label : value' lines; an unset limit prints SIZE_MAX."""
    head = _ASYNC_HEAD.match(sq, m.start())
    facts = OOMFacts("cuda_caching_allocator", gpu_index=int(head.group(1)))
    end = _clauses(sq, head.end(), _ASYNC_CLAUSES, facts)
    if facts.allowed_bytes is not None and facts.allowed_bytes >= 1 << 63:
        facts.extra["allowed_is_unlimited"] = True
    return facts, end


def _mps_pool(facts: OOMFacts, m: re.Match) -> None:
    facts.requested_bytes = _sz(m)
    if m.group(3):
        facts.extra["mps_pool"] = m.group(3)


_MPS_CLAUSES = [
    (_c(rf"\(?MPSallocated:{_SIZE},?"), _setter("allocated_by_pytorch_bytes")),
    (_c(rf"otherallocations:{_SIZE},?"), _extra_setter("mps_other_allocations_bytes")),
    (_c(rf"maxallowed:{_SIZE}\)?\.?"), _setter("allowed_bytes")),
    (_c(rf"Triedtoallocate{_SIZE}(?:on(\w{{1,20}}?)pool)?\.?"), _mps_pool),
    (_c(r"UsePYTORCH_MPS_HIGH_WATERMARK_RATIO=0\.0"
        r"(?:todisableupperlimitformemoryallocations(?:\(maycausesystemfailure\)\.?)?)?"), _ignore),
]


def _parse_mps(sq: str, m: re.Match, pre: str):
    """MPS prints GB/MB but divides by 1024 powers, so they read as GiB/MiB."""
    facts = OOMFacts("mps")
    return facts, _clauses(sq, m.end(), _MPS_CLAUSES, facts)


def _cpu_request(facts: OOMFacts, m: re.Match) -> None:
    facts.requested_bytes = int(m.group(1))


def _errno(facts: OOMFacts, m: re.Match) -> None:
    facts.extra["errno"] = int(m.group(1))


_CPU_CLAUSES = [
    (_c(r":?youtriedtoallocate(\d{1,30})bytes\.?"), _cpu_request),
    (_c(r"Errorcode(\d{1,4})(?:\([^)]{0,80}\))?"), _errno),
    (_c(r"BuynewRAM!"), _ignore),
]


def _parse_cpu(sq: str, m: re.Match, pre: str):
    facts = OOMFacts("cpu")
    if m.group().startswith("posix_memalign"):
        facts.extra["errno"] = 12
        return facts, m.end()
    return facts, _clauses(sq, m.end(), _CPU_CLAUSES, facts)


_CUBLAS_TAIL = _c(r"whencalling`[^`]{0,80}`")
_CUDNN_TAIL = _c(r"torunconvolution|\(\w{1,80}\)")


def _parse_cublas(sq: str, m: re.Match, pre: str):
    facts = OOMFacts("cublas")
    if "NOT_INITIALIZED" in m.group():
        facts.extra["ambiguous"] = True     # cublasCreate without memory reports this too
    tail = _CUBLAS_TAIL.match(sq, m.end())
    return facts, tail.end() if tail else m.end()


def _parse_cudnn(sq: str, m: re.Match, pre: str):
    facts = OOMFacts("cudnn")
    if "ALLOC_FAILED" not in m.group():
        facts.extra["ambiguous"] = True     # often a lack of workspace memory, not always
    tail = _CUDNN_TAIL.match(sq, m.end())
    return facts, tail.end() if tail else m.end()


_THC_TAIL = _c(r"at.{1,300}?\.cuh?:\d{1,9}")


def _parse_driver(sq: str, m: re.Match, pre: str):
    head = m.group()
    facts = OOMFacts("hip" if head.startswith(("HIP", "hip")) else "cuda_driver")
    end = m.end()
    if head.startswith("cudaruntime"):
        tail = _THC_TAIL.match(sq, end)
        end = tail.end() if tail else end
    return facts, _clauses(sq, end, _HINTS, facts)


_NCCL_ORIGIN = _c(r"(?:^|\s)(\S+?:\d{1,12}:\d{1,12}) \[(\d{1,6})\]")


def _parse_nccl(sq: str, m: re.Match, pre: str):
    """NCCL_DEBUG lines: 'host:pid:tid [cuda device] ... NCCL WARN ...'. Both anchors are
    NCCL's own wording (its CUDACHECK and calloc helpers)."""
    facts = OOMFacts("other", extra={"subsystem": "nccl"})
    origins = _NCCL_ORIGIN.findall(pre)
    if origins:                                 # the last: a wrapped line has it above
        facts.extra["origin"], gpu = origins[-1]
        facts.gpu_index = int(gpu)
    head = m.group()
    if head.startswith("Failed"):
        facts.requested_bytes = int(head[len("FailedtoCUDAcalloc"):-len("bytes")])
    return facts, m.end()


_CU_SOURCE = _c(r"\[(\w{1,80})\.(?:cpp|cu|cc|c)\]")
_CU_TAIL = _c(r"file=.{0,300}?line=\d{1,9}(?:\(\d{1,9}\))?")


def _parse_curesult(sq: str, m: re.Match, pre: str):
    """A driver-API CUresult 2 (CUDA_ERROR_OUT_OF_MEMORY) from an extension."""
    facts = OOMFacts("other", extra={"cuda_error": "CUDA_ERROR_OUT_OF_MEMORY"})
    sources = _CU_SOURCE.findall(pre)
    if sources:
        facts.extra["subsystem"] = sources[-1]
    tail = _CU_TAIL.match(sq, m.end())
    return facts, tail.end() if tail else m.end()


_PARSERS = {
    "simulated": _parse_simulated, "alloc": _parse_alloc, "headless": _parse_alloc,
    "xpu_4gb": _parse_alloc, "bare": _parse_alloc, "malloc_async": _parse_malloc_async,
    "mps": _parse_mps, "cpu": _parse_cpu, "cublas": _parse_cublas, "cudnn": _parse_cudnn,
    "driver": _parse_driver, "nccl": _parse_nccl, "curesult": _parse_curesult,
}


# ------------------------------------------------------------------------ scanning
def _line_start(text: str, pos: int, lowest: int) -> int:
    """Start of the line holding `pos`, looking back no further than `lowest`."""
    lowest = max(0, lowest)
    return max(text.rfind("\n", lowest, pos) + 1, lowest)


def _after_exception(text: str, anchor: int) -> bool:
    return _EXCEPTION_TAIL.search(text[max(0, anchor - _CONTEXT):anchor]) is not None


def _pieces(text: str, start: int, stop: int, zone: str | None) -> list[tuple[int, str]]:
    """The lines of text[start:stop] as (raw offset, text). Every line but the first loses
    the prefix it shares with `zone` (the text before the message on its first line), or,
    when `zone` is None, with the line above it."""
    pieces, at = [], start
    reference = None if zone is None else _shape(zone)
    while at < stop:
        nl = text.find("\n", at, stop)
        line_end = stop if nl < 0 else nl
        line = text[at:line_end]
        shape = _shape(line) if zone is None or reference else ""
        cut = _shared_prefix(reference, line, shape) if reference and at > start else 0
        pieces.append((at + cut, line[cut:]))
        if zone is None:
            reference = shape
        at = line_end + 1
    return pieces


def _message_text(text: str, head: int, anchor: int, pieces, end: int) -> str:
    parts, size = [text[head:anchor]], anchor - head
    for start, piece in pieces:
        if start >= end or size >= TEXT_LIMIT:
            break
        if len(parts) > 1:
            parts.append("\n")
        kept = piece[:max(0, end - start)]
        parts.append(kept)
        size += len(kept) + 1
    return "".join(parts)[:TEXT_LIMIT].strip()


class _Scanner:
    """Finds OOM messages in text that arrives in blocks, so a log is never held whole.

    Between blocks only a tail of _CARRY characters is kept: hits closer than that to the
    end wait for the next block, so no message is read from half a window."""

    def __init__(self, allowance: Allowance | None = None) -> None:
        self.allowance = allowance
        self.text = ""
        self.line0 = 1              # line number of self.text[0]
        self.cursor = 0             # end of the last message; nothing starts before it
        self.hits_from = 0          # hits before this offset were already looked at
        self.found: list[OOMFacts] = []
        self._count_at = (0, 1)     # (offset, line) for incremental line counting
        self._nccl_open: OOMFacts | None = None

    def feed(self, block: str, final: bool = False) -> None:
        text = self.text + block if self.text else block
        limit = len(text) if final else len(text) - _CARRY
        if limit > self.hits_from:
            self._scan(text, limit)
            self.hits_from = limit
        if final:
            self.text = ""
            return
        keep = max(0, self.hits_from - _BEHIND - _CONTEXT)
        self.line0 += text.count("\n", 0, keep)
        self.text = text[keep:]
        self.cursor = max(0, self.cursor - keep)
        self.hits_from -= keep
        self._count_at = (0, self.line0)

    def _scan(self, text: str, limit: int) -> None:
        hits = set()
        for needle in _NEEDLES:
            at = text.find(needle, self.hits_from, limit + len(needle) - 1)
            while at >= 0:
                hits.add(at)
                at = text.find(needle, at + 1, limit + len(needle) - 1)
        checked = self.hits_from
        for hit in sorted(hits):
            if hit >= checked and hit >= self.cursor:
                checked = self._look(text, hit)

    def _look(self, text: str, hit: int) -> int:
        """Read every message that starts near `hit`; return the offset checked up to.

        Line prefixes are only guessed (from the line above), and a guess can eat the
        start of a message when two lines begin alike, so anchors are looked for in the
        text read both with and without the prefixes."""
        lowest = max(0, hit - _BEHIND)
        first_line = text.find("\n", lowest, hit) + 1 if lowest else 0
        start = max(self.cursor, first_line or lowest)
        end = min(len(text), hit + _AHEAD)
        anchors = {}
        for pieces in (_pieces(text, start, end, None), [(start, text[start:end])]):
            window = _Squashed(pieces)
            k = 0
            while (h := _HEADS.search(window.text, k)):
                k = h.start() + 1
                m = _START.match(window.text, h.start())
                if m:
                    anchors.setdefault(window.to_raw(m.start()), m.lastgroup)
        for anchor in sorted(anchors):
            if anchor < self.cursor:            # inside the message just read
                continue
            if anchors[anchor] == "bare" and not _after_exception(text, anchor):
                continue
            self._message(text, anchor)
        return max(self.cursor, end - _MARGIN)

    def _message(self, text: str, anchor: int) -> None:
        line_start = _line_start(text, anchor, anchor - _CONTEXT)
        pre = text[line_start:anchor]
        head = anchor
        lead = _HEAD_TAIL.search(pre)
        if lead and lead.start() < len(pre):
            head = anchor - (len(pre) - lead.start())

        # Continuation lines lose the prefix they share with the text before the message;
        # should that break the anchor, prefixes guessed line by line, then none, are tried.
        stop = min(len(text), anchor + _SPAN)
        for zone in (text[max(line_start, head - 200):head], None, ""):
            pieces = _pieces(text, anchor, stop, zone)
            message = _Squashed(pieces, budget=_SQUASHED_ENOUGH)
            m = _START.match(message.text)
            if m:
                break
        else:
            self.cursor = anchor + 1
            return
        facts, k = _PARSERS[m.lastgroup](message.text, m, text[max(0, anchor - _CONTEXT):anchor])
        end = message.to_raw(k - 1) + 1

        if lead and lead.group(1):
            facts.extra["exception"] = lead.group(1)
        facts.line = self._line_of(text, head)
        facts.text = _message_text(text, head, anchor, pieces, end)
        self.cursor = end
        self._emit(facts)

    def _line_of(self, text: str, pos: int) -> int:
        at, line = self._count_at
        if pos >= at:
            line += text.count("\n", at, pos)
        else:
            line -= text.count("\n", pos, at)
        self._count_at = (pos, line)
        return line

    def _emit(self, facts: OOMFacts) -> None:
        """NCCL prints the failure and, a few lines on, the size it failed to get: one OOM."""
        prior = self._nccl_open
        self._nccl_open = None
        nccl = facts.extra.get("subsystem") == "nccl"
        is_calloc = nccl and facts.requested_bytes is not None
        if (prior is not None and is_calloc and prior.requested_bytes is None
                and prior.extra.get("origin") == facts.extra.get("origin")
                and facts.line - prior.line <= 10):
            prior.requested_bytes = facts.requested_bytes
            prior.text = (prior.text + "\n" + facts.text)[:TEXT_LIMIT]
            return
        if len(self.found) >= TEXT_KEPT:
            facts.text = ""
        if self.allowance is not None:
            self.allowance.charge(FACTS_COST + 2 * len(facts.text))
        self.found.append(facts)
        if nccl and not is_calloc:
            self._nccl_open = facts


def parse_text(text: str) -> list[OOMFacts]:
    """Every out-of-memory message in `text`, in order of appearance."""
    scanner = _Scanner()
    scanner.feed(strip_escapes(text), final=True)
    return scanner.found


def requested_bytes(message: str) -> int | None:
    """The size an OOM message says was asked for ("Tried to allocate ..."), or None."""
    for facts in parse_text(message):
        if facts.requested_bytes is not None:
            return facts.requested_bytes
    return None


def scan_stream(stream: IO, block_size: int = BLOCK, allowance: Allowance | None = None) -> list[OOMFacts]:
    """Every OOM message in an open file (bytes or text), read block by block. The
    messages found are charged to `allowance` (default: the limit for reading files)."""
    scanner = _Scanner(allowance or Allowance("the log"))
    for block in text_blocks(stream, block_size):
        scanner.feed(block)
    scanner.feed("", final=True)
    return scanner.found


def scan_file(path: str | os.PathLike, block_size: int = BLOCK) -> list[OOMFacts]:
    """Every OOM message in the log at `path`, in order; memory stays bounded by the block
    size and the limit for reading files (memdoctor.limits: the messages found count
    against it, ReadLimitError past it) whatever the file's size. Raises LogError when
    the file cannot be read."""
    allowance = Allowance(f"log {os.fspath(path)!r}")
    allowance.charge(8 * block_size)        # the block, decoded, and the text kept around it
    try:
        stream = open(path, "rb")
    except (OSError, ValueError) as exc:     # ValueError: a path with a NUL byte
        raise LogError(f"cannot read log {path}: {_reason(exc)}") from None
    with stream:
        try:
            return scan_stream(stream, block_size, allowance)
        except OSError as exc:
            raise LogError(f"cannot read log {path}: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0] or type(exc).__name__
