#!/bin/bash
# A/B of two trees' benchmarks, alternating order per round: run.sh A_tree B_tree rounds
set -u
A=$1; B=$2; R=${3:-2}; S=${4:-1}
PY=/work/main/.venv/bin/python
for r in $(seq $S $R); do
  if (( r % 2 )); then order="$A $B"; else order="$B $A"; fi
  for wt in $order; do
    tag=$(basename $wt)_r$r
    echo "== $tag reshard $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $wt && $PY benchmarks/bench_reshard.py --pairs fsdp2-1,fsdp2-dp4,dp2tp2-tp4,dp4-dp3 --formats dcp,ucp --repeats 5 --save-repeats 3 --size-mb 300 --probe-mb 0 --out /tmp/ab/$tag.reshard.json) > /tmp/ab/$tag.reshard.txt 2>&1
    echo "   rc=$? $(date +%T)"
  done
done
echo done $(date +%T)
