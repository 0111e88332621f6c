"""The user's line: the first Python frame outside torch, memdoctor, the standard library
and installed packages, found cheaply per allocation and kept in the Run's source table."""
from __future__ import annotations

import os
import re
import sys
import sysconfig


_getframe = sys._getframe
_ANOTHER_STDLIB = re.compile(r"/lib/python\d[\d.]*/")


def _library_prefixes() -> tuple[str, ...]:
    """Folders whose code is not the user's: this Python's standard library and package
    folders, torch's and memdoctor's own."""
    import torch
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # memdoctor/
    folders = {os.path.dirname(torch.__file__), package}
    paths = sysconfig.get_paths()
    folders.update(p for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := paths.get(key)))
    out = set()
    for folder in folders:
        for form in (folder, os.path.realpath(folder)):
            out.add(form.replace("\\", "/").rstrip("/") + "/")
    return tuple(sorted(out))


_PREFIXES: tuple[str, ...] | None = None


def is_user_file(filename: str) -> bool:
    """Code the user wrote: not torch, memdoctor, the standard library or an installed
    package (of this Python or, for a snapshot from elsewhere, by the shape of its path),
    and not frozen or generated code ("<frozen runpy>", "<string>")."""
    global _PREFIXES
    if not filename or filename[0] == "<":
        return False
    f = filename.replace("\\", "/")
    if "-packages/" in f or "/torch/" in f or _ANOTHER_STDLIB.search(f):
        return False
    if _PREFIXES is None:
        _PREFIXES = _library_prefixes()
    return not f.startswith(_PREFIXES)


class SourceTable:
    """Adds [file, line, function] rows to a source table (Run.sources), each line once."""

    def __init__(self, rows: list[list]):
        self.rows = rows
        self._index: dict[tuple[str, int], int] = {
            (file, line): i for i, (file, line, _f) in enumerate(self.rows)}

    def index(self, file: str, line: int, function: str = "") -> int:
        """The row of this line, added if new."""
        key = (file, line)
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self.rows)
            self.rows.append([file, line, function])
        return i


class UserFrames(SourceTable):
    """The user's line of the Python stack at a moment, as a source index.

    Whether a file is the user's is decided once per file name (a string's hash is cached,
    a code object's is not), so a walk costs one dict lookup per frame until the first
    user frame."""

    def __init__(self, rows: list[list]):
        super().__init__(rows)
        self._user: dict[str, str] = {}         # file name -> its absolute path, "" if not the user's

    def here(self, depth: int = 1) -> int:
        """The source index of the innermost user frame of the stack from `depth` frames
        up (1: the caller) outwards; -1 if none."""
        try:
            f = _getframe(depth)
        except ValueError:              # fewer frames than that
            return -1
        user = self._user
        while f is not None:
            code = f.f_code
            name = code.co_filename
            path = user.get(name)
            if path is None:
                path = user[name] = os.path.abspath(name) if is_user_file(name) else ""
            if path:
                return self.index(path, f.f_lineno, code.co_name)
            f = f.f_back
        return -1


def first_user_frame(frame) -> tuple[str, int, str] | None:
    """(absolute file, line, function) of the innermost user frame from `frame` outwards."""
    while frame is not None:
        code = frame.f_code
        if _is_user_cached(code.co_filename):
            return os.path.abspath(code.co_filename), frame.f_lineno, code.co_name
        frame = frame.f_back
    return None


def note_oom_line(run, tb) -> None:
    """An OOM whose line is not known yet (a real one, raised by PyTorch) takes the
    innermost user frame of its traceback."""
    if not run.ooms or run.ooms[0].source >= 0 or tb is None:
        return
    found = None
    while tb is not None:
        if _is_user_cached(tb.tb_frame.f_code.co_filename):
            found = (os.path.abspath(tb.tb_frame.f_code.co_filename), tb.tb_lineno, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if found is not None:
        run.ooms[0].source = SourceTable(run.sources).index(*found)


def user_line_of_thread(thread_id: int) -> tuple[str, int, str] | None:
    """The user's line where this thread is now, else where thread `thread_id` is (the
    autograd engine runs CUDA's backward on a thread of its own, with no Python frames:
    the line is then the `loss.backward()` the training thread waits in)."""
    found = first_user_frame(_getframe(1))
    if found is None:
        found = first_user_frame(sys._current_frames().get(thread_id))
    return found


def snapshot_source(table: SourceTable, frames: list) -> int:
    """The source index of the innermost user frame of a snapshot's stack (dicts with
    filename, line, name; innermost first; the C++ frames of stacks="all" are skipped);
    -1 when no frame is the user's."""
    for f in frames:
        filename = f.get("filename") if type(f) is dict else None
        if type(filename) is str and filename.endswith(".py") and _is_user_cached(filename):
            line, name = f.get("line"), f.get("name")
            return table.index(filename, line if type(line) is int else 0, name if type(name) is str else "")
    return -1


_user_files: dict[str, bool] = {}


def _is_user_cached(filename: str) -> bool:
    mine = _user_files.get(filename)
    if mine is None:
        mine = _user_files[filename] = is_user_file(filename)
    return mine


def model_being_built(frame=None, tb=None) -> dict | None:
    """What the stack was doing to a model at an OOM, read from the frames from `frame`
    outwards, or from a traceback's (a CUDA OOM is known only once it has unwound): building
    it (the outermost `nn.Module.__init__` running) or moving it (`Module._apply`, behind
    `.to()`, `.cuda()`, `.half()`): {"module": its class, "how": "built" or "moved"}; None
    where neither ran (an OOM in a step)."""
    import torch
    apply, module, found = torch.nn.Module._apply.__code__, torch.nn.Module, None
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for f in frames:
        code = f.f_code
        if code is apply or code.co_name == "__init__":
            owner = f.f_locals.get("self")
            if isinstance(owner, module) and (found is None or frame_depth(f) < found[0]):
                found = (frame_depth(f), {"module": type(owner).__name__,
                                          "how": "moved" if code is apply else "built"})
    return found[1] if found else None


def frame_depth(frame) -> int:
    """How many frames are outside `frame`: the outermost is 0."""
    depth = 0
    while frame.f_back is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def note_oom_building(run, tb) -> None:
    """An OOM raised while a model was built or moved (memdoctor.diagnosis's model-states
    names it): noted from its traceback where the OOM was recorded without its stack."""
    if run.ooms and "oom_building" not in run.meta and tb is not None:
        building = model_being_built(tb=tb)
        if building:
            run.meta["oom_building"] = building
