"""Where do replayed live bytes and memory_allocated() disagree? Prints each mismatched
phase boundary with its mark and the nearby events."""
import json, subprocess, sys
import torch, transformers
from memdoctor.attribution import live_curve
from memdoctor.capture.session import Tracer

torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 50257, (2, 256), device="cuda")
with Tracer(models=[model], optimizers=[opt], source="allocator") as t:
    for _ in range(2):
        model(ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
run = t.run
curve = live_curve(run)
for i, s in enumerate(run.meta["phase_samples"]):
    got = curve[s["seq"]] if s["seq"] >= 0 else 0
    m = run.marks[i] if i < len(run.marks) else None
    flag = "" if got == s["allocated"] else f"  MISMATCH {got - s['allocated']}"
    print(i, s["seq"], m.phase if m else None, m.step if m else None, m.module if m else None, s["allocated"], got, flag)
    if flag:
        lo, hi = max(s["seq"] - 3, 0), min(s["seq"] + 4, len(curve))
        for q in range(lo, hi):
            b = run.blocks.get(run.event_blocks[q])
            print("     ", q, run.actions[q], run.event_bytes[q], curve[q], b.name[:50] if b else "", b.phase if b else "")
print("trace entries", run.meta.get("snapshot", {}).get("trace_entries"), "peak alloc", run.meta["peak_allocated"])
for name in ("s03_long_sequence_attention.py", "s09_growing_sequences_bank.py"):
    exp = json.load(open("../shared/scenarios/expected.json"))[name]
    p = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", f"../shared/scenarios/{name}", "--json",
                        "--budget", exp["budget"]["cuda"]], capture_output=True, text=True)
    d = json.loads(p.stdout)
    print(name, json.dumps(d["ooms"][0], default=str)[:1500], d["breakdown"], [f["rule"] for f in d["findings"]])
