"""Probe what this torch's allocator history records: trace entry fields, memory metadata,
and whether a TorchDispatchMode sees ops that autograd runs on its device thread."""
import json, os, torch
from torch.utils._python_dispatch import TorchDispatchMode

out = {"torch": torch.__version__, "has_set_metadata": hasattr(torch._C, "_cuda_setMemoryMetadata")}
torch.cuda.memory._record_memory_history(max_entries=100000)
if out["has_set_metadata"]:
    torch.cuda.memory._set_memory_metadata("phase-A")
a = torch.randn(1024, 1024, device="cuda", requires_grad=True)
if out["has_set_metadata"]:
    torch.cuda.memory._set_memory_metadata("phase-B")
b = (a @ a).relu().sum()
seen = []
class M(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append((str(func), torch._C._current_graph_task_id()))
        return func(*args, **(kwargs or {}))
with M():
    b.backward()
del a, b
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
trace = snap["device_traces"][0]
out["trace_len"] = len(trace)
out["trace_keys"] = sorted({k for e in trace for k in e})
out["actions"] = sorted({e["action"] for e in trace})
out["first_entries"] = [{k: v for k, v in e.items() if k != "frames"} for e in trace[:6]]
out["snapshot_keys"] = sorted(snap)
out["segment_keys"] = sorted(snap["segments"][0]) if snap["segments"] else []
out["dispatch_in_backward"] = seen[:8]
out["memory_allocated"] = torch.cuda.memory_allocated()
print(json.dumps(out, indent=1, default=str))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "allocator_probe.json"), "w"), indent=1, default=str)
