#!/bin/bash
# A/B of two commits' benchmarks, alternating order per round: run.sh A_wt B_wt rounds
set -u
A=$1; B=$2; R=${3:-2}
PY=/work/main/.venv/bin/python
for r in $(seq 1 $R); do
  if (( r % 2 )); then order="$A $B"; else order="$B $A"; fi
  for wt in $order; do
    tag=$(basename $wt)_r$r
    echo "== $tag reshard $(date +%T) $(cut -d' ' -f1 /proc/loadavg)"
    (cd $wt && $PY benchmarks/bench_reshard.py --pairs dp1-dp1,dp4-dp4,dp2tp2-dp3 --formats dcp,ucp --repeats 5 --size-mb 300 --probe-mb 0 --out /tmp/ab34b/$tag.reshard.json) > /tmp/ab34b/$tag.reshard.txt 2>&1
    echo "== $tag save $(date +%T)"
    (cd $wt && $PY benchmarks/bench_save.py --size-mb 300 --repeats 5 --ucp-threads 1 --dcp-threads 1 --writers 1) > /tmp/ab34b/$tag.save.txt 2>&1
  done
done
echo done $(date +%T)
