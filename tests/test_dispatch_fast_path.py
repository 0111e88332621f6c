"""The dispatch source records an op's single plain-tensor output on a short path
(DispatchSource.__torch_dispatch__ calls the op's C++ callable and Recorder.add_output);
every other output goes through DispatchSource._record. Both must record the same run:
here a small training loop (views, in-place ops, backward, a foreach optimizer, a
parameterless transform, outputs that are tuples) is traced once as it is and once with
the short path switched off, and the two runs' events, blocks and marks are compared."""
from __future__ import annotations

import torch
from torch import nn

from memdoctor.capture import dispatch as dispatch_mod
from memdoctor.capture.session import Tracer


class _Scale(nn.Module):
    def forward(self, x):
        return (x - 0.5) / 0.25


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Scale()
        self.fc1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.ln(torch.relu(self.fc1(self.norm(x))))
        a, b = h.chunk(2, dim=1)                 # a list of views
        h = torch.cat([a, b.transpose(0, 1).transpose(0, 1)], dim=1)
        h.add_(1.0)                              # in place
        return self.fc2(h)


def _trace_loop() -> Tracer:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    history = []
    with Tracer(source="dispatch") as tracer:
        for _ in range(3):
            x = torch.rand(8, 16)
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,)))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            history.append(loss.detach())
        with torch.no_grad():
            model(torch.rand(2, 16)).max(dim=1)  # a tuple of outputs
    return tracer


def _record(tracer: Tracer) -> dict:
    run = tracer.run
    blocks = run.blocks
    events = [(a, blocks[b].name if b >= 0 else None, n) for a, b, n in
              zip(run.actions, run.event_blocks, run.event_bytes)]
    rows = [(b.name, b.nbytes, b.phase, b.category, b.module, b.step, b.alloc_seq, b.free_seq,
             list(b.shape), b.dtype, b.device, None if b.source < 0 else tuple(run.sources[b.source][:2]))
            for b in blocks.values()]
    marks = [(m.seq, m.phase, m.step, m.module) for m in run.marks]
    return {"events": events, "blocks": rows, "marks": marks,
            "kept_by": run.meta.get("kept_by"), "peak": run.meta.get("peak_live_bytes")}


class _NoShortPath(dict):
    """A table of ops that never keeps one: every output takes DispatchSource._record."""

    def __setitem__(self, key, value):
        pass


def test_short_path_records_what_the_general_path_records(monkeypatch):
    short = _record(_trace_loop())
    original_init = dispatch_mod.DispatchSource.__init__

    def general_only(self, recorder):
        original_init(self, recorder)
        self._plain = _NoShortPath()

    monkeypatch.setattr(dispatch_mod.DispatchSource, "__init__", general_only)
    general = _record(_trace_loop())
    assert len(short["events"]) > 200 and any(p == "backward" for _, _, p, *_ in short["blocks"])
    assert any(r[11] is not None for r in short["blocks"]), "no source line was recorded"
    assert short["events"] == general["events"]
    assert short["blocks"] == general["blocks"]
    assert short["marks"] == general["marks"]
    assert short["kept_by"] == general["kept_by"]
    assert short["peak"] == general["peak"]


def test_short_path_is_taken(monkeypatch):
    """The comparison above means something only if the short path runs: most ops here
    take it (their op is in the table once seen)."""
    seen = []
    original_init = dispatch_mod.DispatchSource.__init__

    def keep(self, recorder):
        original_init(self, recorder)
        seen.append(self)

    monkeypatch.setattr(dispatch_mod.DispatchSource, "__init__", keep)
    _trace_loop()
    assert len(seen[0]._plain) >= 10
