#!/usr/bin/env bash
# usage (on a GPU machine, from the repository root): bash benchmarks/new_rules_on_cuda.sh
# The new rules' scenarios on the GPU, each script run with torch's default device set to
# cuda: traced as written and fixed, then diagnosed under a budget halfway between the two.
export PYTHONPATH=$PWD
cat > /tmp/on_cuda.py <<'PY'
import runpy, sys, torch
torch.set_default_device("cuda")
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
PY
peak() { python3 -m memdoctor trace /tmp/on_cuda.py --json -- "$@" 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['peak_bytes'])"; }
case_() {  # "script args" "fixed args"
  s=tests/scenarios/$1
  bug=$(peak $s $2); fix=$(peak $s $3); budget=$(( (bug + fix) / 2 ))
  echo "## $1 [$2] traced $bug, fixed [$3] traced $fix; memdoctor diagnose --budget $budget"
  python3 -m memdoctor diagnose /tmp/on_cuda.py --budget $budget --json -- $s $2 2>/dev/null | python3 -c "
import json,sys
d=json.load(sys.stdin); o=d['ooms'][0] if d['ooms'] else {}
print('   oom', d['oom'], o.get('phase'), o.get('step'))
for f in d['findings'][:3]:
    print('  ', f['rule'], f['accounts_for_bytes'], [(r['title'], r['predicted_peak_bytes']) for r in f['remedies']][:2])"
}
case_ retain_graph_stray.py "" fixed
case_ frozen_network_requires_grad.py loss-net "loss-net fixed"
case_ frozen_network_requires_grad.py teacher "teacher fixed"
case_ leak_in_two_steps.py "" fixed
case_ contrastive_two_towers.py "" "gradcache 4"
case_ swa_predict_without_no_grad.py "" fixed
case_ accumulate_grads_zeroed_in_place.py "" none
