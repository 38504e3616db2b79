#!/bin/bash
# A/B of the read-once benchmark on two trees, alternating order per round: ro.sh A_tree B_tree rounds
set -u
A=$1; B=$2; R=${3:-2}
PY=/work/main/.venv/bin/python
for r in $(seq 1 $R); do
  if (( r % 2 )); then order="$A $B"; else order="$B $A"; fi
  for wt in $order; do
    tag=$(basename $wt)_r$r
    echo "== $tag read_once $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $wt && $PY benchmarks/bench_read_once.py --no-s3 --ways dcp,ucp,once --repeats 5 --out /tmp/ab/$tag.read_once.json) > /tmp/ab/$tag.read_once.txt 2>&1
    echo "   rc=$? $(date +%T)"
  done
done
echo done $(date +%T)
