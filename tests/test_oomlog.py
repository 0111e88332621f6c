"""The OOM-message parser reads every labelled real message exactly, finds messages in
noisy, prefixed, wrapped and collapsed logs, streams large files and never crashes on
garbage."""
from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memdoctor.capture.oomlog import KINDS, LogError, OOMFacts, parse_text, scan_file, scan_stream
from tests.support.paths import SHARED, shared_path

GiB, MiB = 2**30, 2**20
CORPUS = ("oom_messages", "messages.jsonl")
# Records whose text holds the same OOM more than once (their notes say so).
SEVERAL = {"oom-059": 2, "oom-099": 2}


def _records():
    path = SHARED.joinpath(*CORPUS)
    if not path.exists():
        return [pytest.param(None, id="corpus-missing")]
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [pytest.param(r, id=r["id"]) for r in records]


# ------------------------------------------------------------------ labelled corpus
def test_corpus_is_complete():
    path = shared_path(*CORPUS)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(lines) >= 88


@pytest.mark.parametrize("record", _records())
def test_corpus_record(record):
    shared_path(*CORPUS)                    # skips here, fails in CI, when the corpus is absent
    found = parse_text(record["text"])
    assert len(found) == SEVERAL.get(record["id"], 1), [f.text[:80] for f in found]
    for facts in found:
        assert facts.expected() == record["expected"]
    first = found[0]
    assert set(first.expected()) == set(record["expected"])
    for key, value in (record.get("extra") or {}).items():
        assert first.extra.get(key) == value, key
    assert first.extra.get("ambiguous", False) == bool(record.get("ambiguous_oom"))
    assert first.kind in KINDS
    assert first.text and first.line >= 1
    assert first.text.splitlines()[0].strip() in record["text"].split("\n")[first.line - 1]


def _console(text: str, width: int, prefix: str) -> str:
    """`text` as a console that prefixes every line and breaks it at `width`, mid-word."""
    out = []
    for line in text.split("\n"):
        for i in range(0, max(len(line), 1), width):
            out.append(prefix.format(len(out) % 10) + line[i:i + width])
    return "\n".join(out)


# A message whose own lines carry '# ' markers cannot be told apart once every newline
# became a space: the markers end up inside its sentences.
NOT_COLLAPSIBLE = {"oom-049"}


@pytest.mark.parametrize("record", _records())
def test_corpus_record_through_a_console(record):
    """The same labels after a log pipeline mangles the text: torchrun / timestamp line
    prefixes, hard wraps at common terminal widths, CRLF, newlines collapsed to spaces."""
    shared_path(*CORPUS)
    text = record["text"]
    variants = {f"{w}{p!r}": _console(text, w, p)
                for w in (80, 133) for p in ("[rank1]: ", "2024-05-01T12:00:0{}Z ")}
    variants["crlf"] = text.replace("\n", "\r\n")
    if record["id"] not in NOT_COLLAPSIBLE:
        variants["collapsed"] = " ".join(text.split())
    for name, mangled in variants.items():
        found = parse_text(mangled)
        assert found and found[0].expected() == record["expected"], name


# ------------------------------------------------------------------ own fixtures
NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 1 has a "
       "total capacity of 23.64 GiB of which 1.19 GiB is free. Process 4242 has 3.00 GiB memory "
       "in use. Including non-PyTorch memory, this process has 19.44 GiB memory in use. Of the "
       "allocated memory 17.82 GiB is allocated by PyTorch, and 1.15 GiB is reserved by PyTorch "
       "but unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
       "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
       "#environment-variables)")
NEW_FACTS = {
    "kind": "cuda_caching_allocator", "requested_bytes": round(2.5 * GiB), "gpu_index": 1,
    "total_capacity_bytes": round(23.64 * GiB), "free_bytes": round(1.19 * GiB),
    "allowed_bytes": None, "process_in_use_bytes": round(19.44 * GiB),
    "other_processes": [{"pid": 4242, "bytes": 3 * GiB}],
    "allocated_by_pytorch_bytes": round(17.82 * GiB),
    "reserved_unallocated_bytes": round(1.15 * GiB), "reserved_total_bytes": None,
}
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total "
       "capacity; 6.12 GiB already allocated; 2.44 MiB free; 6.31 GiB reserved in total by "
       "PyTorch)")
DRIVER = ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
          "reported at some other API call, so the stacktrace below might be incorrect.\n"
          "For debugging consider passing CUDA_LAUNCH_BLOCKING=1")
TRACEBACK = """Traceback (most recent call last):
  File "/home/me/train.py", line 88, in <module>
    loss = model(batch).loss
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1511, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
"""


def _prefixed(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.split("\n"))


def test_three_ooms_among_traceback_noise_in_order():
    log = "\n".join([
        "[rank1]: step 10 loss 2.31 memory allocated 17.2 GiB",
        _prefixed(TRACEBACK, "[rank1]: "),
        "[rank1]: " + NEW,                                          # line 8
        "[rank1]: retrying with a smaller batch",
        _prefixed(TRACEBACK, "[rank1]: "),
        "[rank1]: " + OLD,                                          # line 16
        "[rank0]: W1130 04:55:00 NCCL watchdog: all good",
        _prefixed(DRIVER, "[rank1]: "),                             # line 18
        "[rank1]: exiting",
    ])
    found = parse_text(log)
    assert [f.line for f in found] == [8, 16, 18]
    assert found[0].expected() == NEW_FACTS
    assert found[0].extra["exception"] == "torch.OutOfMemoryError"
    assert found[1].expected()["reserved_total_bytes"] == round(6.31 * GiB)
    assert found[1].gpu_index == 0 and found[1].requested_bytes == 20 * MiB
    assert found[2].kind == "cuda_driver"
    assert found[2].text.startswith("RuntimeError: CUDA error: out of memory")
    assert "[rank1]" not in found[2].text                 # continuation prefixes removed


@pytest.mark.parametrize("width", [40, 61, 80, 120])
@pytest.mark.parametrize("prefix", ["", "[rank1]: ", "> ", "2024-05-01T12:00:0{}Z ", "0: "])
def test_hard_wrapped_message(width, prefix):
    """A console that breaks lines at a fixed column, mid-word, each line with a prefix."""
    chunks = [NEW[i:i + width] for i in range(0, len(NEW), width)]
    wrapped = "\n".join(prefix.format(i % 10) + chunk for i, chunk in enumerate(chunks))
    found = parse_text("epoch 3\n" + wrapped + "\nwandb: run summary")
    assert len(found) == 1
    assert found[0].expected() == NEW_FACTS
    assert found[0].line == 2


def test_word_wrapped_message_with_trailing_spaces():
    lines = textwrap.wrap(OLD, 50)
    found = parse_text("\n".join("# " + line + "  " for line in lines))
    assert len(found) == 1
    assert found[0].expected()["allocated_by_pytorch_bytes"] == round(6.12 * GiB)
    assert found[0].expected()["reserved_total_bytes"] == round(6.31 * GiB)


def test_space_collapsed_and_glued():
    collapsed = " ".join((TRACEBACK + NEW).split())
    found = parse_text("prefix-text" + collapsed + "trailing-text" + OLD + "!!")
    assert [f.expected()["kind"] for f in found] == ["cuda_caching_allocator"] * 2
    assert found[0].expected() == NEW_FACTS
    assert found[1].requested_bytes == 20 * MiB


def test_repeated_identical_lines_are_each_found():
    assert len(parse_text("\n".join([NEW] * 3))) == 3
    assert len(parse_text("RuntimeError: CUDA error: out of memory\n" * 4)) == 4
    assert len(parse_text(NEW + NEW)) == 2


def test_prose_mentioning_oom_is_not_an_oom():
    text = ("If you hit CUDA out of memory, lower --batch-size.\n"
            "We ran out of memory last week; see docs.\n"
            "except torch.cuda.OutOfMemoryError:\n"
            "    pass\n")
    assert parse_text(text) == []


def test_numbers_are_reported_as_printed():
    """Contradictory numbers are evidence (WDDM spill, corrupted sizes): never corrected."""
    text = ("CUDA out of memory. Tried to allocate 99.00 GiB (GPU 0; 8.00 GiB total capacity; "
            "17.20 GiB already allocated; 0 bytes free; 19.15 GiB reserved in total by PyTorch)")
    facts = parse_text(text)[0]
    assert facts.requested_bytes == 99 * GiB > facts.total_capacity_bytes
    assert facts.allocated_by_pytorch_bytes == round(17.2 * GiB) > facts.total_capacity_bytes
    assert facts.free_bytes == 0
    unlimited = ("torch.OutOfMemoryError: Allocation on device 2 would exceed allowed memory. "
                 "(out of memory)\nCurrently allocated     : 0 bytes\nRequested               : "
                 "0 bytes\nDevice limit            : 80.00 GiB\nFree (according to CUDA): 1.00 "
                 "MiB\nPyTorch limit (set by user-supplied memory fraction)\n"
                 "                        : 17179869184.00 GiB")
    facts = parse_text(unlimited)[0]
    assert facts.allowed_bytes == 2**64 and facts.extra["allowed_is_unlimited"] is True
    assert facts.requested_bytes == 0 and facts.allocated_by_pytorch_bytes == 0
    assert facts.gpu_index == 2


def test_other_processes_none_when_absent_and_in_order_when_present():
    assert parse_text(OLD)[0].other_processes is None
    two = NEW.replace("Process 4242 has 3.00 GiB memory in use.",
                      "Process 7 has 1.00 MiB memory in use. Process 9 has 2.00 KiB memory in use.")
    assert parse_text(two)[0].other_processes == [{"pid": 7, "bytes": MiB}, {"pid": 9, "bytes": 2048}]


def test_nccl_failure_and_calloc_size_are_one_oom():
    log = ("gpu7:100:200 [5] NCCL INFO Channel 00 : 5[5000] -> 6[6000] via P2P/IPC\n"
           "gpu7:100:200 [5] include/alloc.h:103 NCCL WARN Cuda failure 2 'out of memory'\n"
           "\n"
           "gpu7:100:200 [5] include/alloc.h:110 NCCL WARN Failed to CUDA calloc 4096 bytes\n"
           "gpu7:100:200 [5] NCCL INFO init.cc:123 -> 1\n")
    found = parse_text(log)
    assert len(found) == 1
    assert (found[0].kind, found[0].gpu_index, found[0].requested_bytes) == ("other", 5, 4096)
    assert found[0].extra["subsystem"] == "nccl" and found[0].line == 2


def test_simulated_budget_message():
    text = ("torch.OutOfMemoryError: CUDA out of memory (memdoctor budget, simulated). Tried to "
            "allocate 64.00 MiB. Budget of 1.00 GiB of which 10.00 MiB is free. Of the allocated "
            "memory 1014.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but "
            "unallocated.")
    facts = parse_text(text)[0]
    assert facts.extra["simulated"] is True
    assert (facts.requested_bytes, facts.allowed_bytes, facts.free_bytes) == (64 * MiB, GiB, 10 * MiB)
    assert facts.allocated_by_pytorch_bytes == 1014 * MiB


def test_text_is_capped():
    facts = parse_text("RuntimeError: " + " " * 5000 + "CUDA error: out of memory")[0]
    assert len(facts.text) <= 2000


# ------------------------------------------------------------------ files and streams
def test_scan_file_with_binary_garbage(tmp_path):
    rng = random.Random(7)
    garbage = bytes(rng.randrange(256) for _ in range(20_000))
    path = tmp_path / "job.err"
    path.write_bytes(b"\xff\xfe\x00junk\x00\n" + garbage + b"\n" + NEW.encode() + b"\n"
                     + b"\x80\x81 invalid utf-8 \xc3\x28\n" + OLD.encode("utf-8") + b"\n"
                     + garbage + b"\n" + DRIVER.encode() + b"\xff")
    found = scan_file(path)
    assert [f.kind for f in found] == ["cuda_caching_allocator"] * 2 + ["cuda_driver"]
    assert found[0].expected() == NEW_FACTS
    lines = path.read_bytes().split(b"\n")
    for facts in found:
        assert facts.text.split("\n")[0].encode() in lines[facts.line - 1]


@pytest.mark.parametrize("block_size", [1, 4096, 1 << 20])
def test_scan_file_utf16_log(tmp_path, block_size):
    """What a Windows PowerShell `>` redirect writes."""
    path = tmp_path / "train.log"
    path.write_text("starting\n" + OLD + "\n", encoding="utf-16")
    found = scan_file(path, block_size)
    assert len(found) == 1 and found[0].line == 2 and found[0].requested_bytes == 20 * MiB


def test_scan_file_reads_lines_of_any_length(tmp_path):
    """A message after megabytes without a newline (a progress bar, NUL bytes) is found."""
    path = tmp_path / "progress.log"
    with open(path, "w") as f:
        f.write("x" * (3 * MiB) + NEW + "\n")
        f.write("\x00" * (2 * MiB) + OLD + "\n")
    found = scan_file(path, block_size=64 * 1024)
    assert [f.line for f in found] == [1, 2]
    assert found[0].expected() == NEW_FACTS


def test_colour_codes_inside_a_message_are_read_through():
    coloured = NEW.replace("Tried to allocate", "\x1b[31;1mTried to allocate\x1b[0m").replace(
        " GiB", "\x1b[1m GiB\x1b[22m", 1)
    assert "\x1b" in coloured
    for block_size in (1, 7, 4096):
        found = scan_stream(io.StringIO("\x1b]0;title\x07noise\n" + coloured + "\n"), block_size)
        assert [f.expected() for f in found] == [NEW_FACTS] and found[0].line == 2
        assert "\x1b" not in found[0].text


@pytest.mark.parametrize("block_size", [1, 3, 100, 4096, 65536])
def test_blocks_do_not_change_the_result(block_size):
    rng = random.Random(block_size)
    parts = []
    for step in range(300):
        parts.append(f"[rank{step % 4}]: step {step} loss {rng.random():.3f}\n")
        if step % 41 == 3:
            parts.append(rng.choice([NEW, OLD, DRIVER]) + "\n")
        if step % 97 == 5:
            parts.append(_prefixed(NEW[:150] + "\n" + NEW[150:], "[rank2]: ") + "\n")
    text = "".join(parts)
    whole = [(f.line, f.expected(), f.text) for f in parse_text(text)]
    streamed = [(f.line, f.expected(), f.text)
                for f in scan_stream(io.BytesIO(text.encode()), block_size)]
    assert streamed == whole and len(whole) >= 10


def test_unreadable_files_raise_logerror(tmp_path):
    for path in (tmp_path / "missing.log", tmp_path):
        with pytest.raises(LogError) as err:
            scan_file(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads everything")
def test_permission_denied_is_logerror(tmp_path):
    path = tmp_path / "secret.log"
    path.write_text(OLD)
    path.chmod(0)
    with pytest.raises(LogError, match="ermission"):
        scan_file(path)


def test_large_log_finds_every_oom(tmp_path):
    """~50 MB of training-loop noise with an OOM every ~5 MB. How fast is measured by
    benchmarks/oomlog_scan.py."""
    noise = "".join(f"2024-05-01 12:00:{i % 60:02d},{i % 1000:03d} INFO [rank{i % 8}] step {i} "
                    f"loss 1.{i % 97:02d} lr 3e-4 grad_norm 0.9 mem 17.2 GiB tok/s 41234\n"
                    for i in range(50_000))
    path = tmp_path / "big.log"
    with open(path, "w") as f:
        size = 0
        while size < 50_000_000:
            f.write(noise)
            f.write("[rank3]: " + NEW + "\n")
            size += len(noise) + len(NEW) + 10
    found = scan_file(path)
    assert len(found) == size // (len(noise) + len(NEW) + 10)
    assert all(f.expected() == NEW_FACTS for f in found)


def test_import_is_standard_library_only():
    """The CLI imports this module to read logs; it must not pay for importing torch."""
    code = "import sys, memdoctor.capture.oomlog; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ fuzz
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000))
def test_arbitrary_text_never_raises(text):
    for facts in parse_text(text):
        assert isinstance(facts, OOMFacts) and facts.kind in KINDS


FRAGMENTS = [NEW, OLD, DRIVER, TRACEBACK, "CUDA out of memory.", "Tried to allocate ",
             "99999999999999999999999999999999999999 GiB", "1" * 5000, "(GPU 0; ", "GPU 3 has a ",
             "total capacity of ", "MPS backend out of memory (", "Allocation on device 0 would "
             "exceed allowed memory. (out of memory)", "Currently allocated : ", "17179869184.00 GiB",
             "Process 12 has ", " memory in use. ", "NCCL WARN Cuda failure 'out of memory'",
             "Failed to CUDA calloc 12 bytes", "CUresult error result=2", "you tried to allocate ",
             "\n", "\r\n", " ", "[rank0]: ", "> ", ";", ")", ".", "\x00", "\ufffd", "é"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=20)), max_size=40),
       st.integers(1, 5000))
def test_mangled_messages_never_raise_and_stream_alike(parts, block_size):
    text = "".join(parts)
    whole = [(f.line, f.expected()) for f in parse_text(text)]
    streamed = [(f.line, f.expected()) for f in scan_stream(io.StringIO(text), block_size)]
    assert streamed == whole


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.integers(1, 6000))
def test_arbitrary_bytes_never_raise(data, block_size):
    for facts in scan_stream(io.BytesIO(data), block_size):
        assert facts.kind in KINDS
