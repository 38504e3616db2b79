"""Read-once A/B: per tree, per target, the median over rounds of once/dcp and ucp/dcp cold load
time (each run's median of 5 paired repeats), and once's storage bytes over unique bytes.
python3 ro_summary.py [FOLDER]: the runs in FOLDER (default: this script's own folder)."""
import glob, json, os, statistics, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = {}
for f in sorted(glob.glob(os.path.join(here, '*_r*.read_once.json'))):
    tree, rnd = os.path.basename(f).split('.')[0].split('_')
    d = json.load(open(f))
    for t, v in d['local']['targets'].items():
        w = v['ways']
        rows.setdefault(tree, {}).setdefault(t, []).append(
            (w['once']['s'] / w['dcp']['s'], w['ucp']['s'] / w['dcp']['s'], w['once']['bytes_over_unique'],
             w['once']['cpu_s'] / w['dcp']['cpu_s']))
for tree in ('base', 'new'):
    print(tree)
    for t, vals in rows[tree].items():
        o = [v[0] for v in vals]; u = [v[1] for v in vals]; b = [v[2] for v in vals]; c = [v[3] for v in vals]
        print(f'  {t:10s} once/dcp {statistics.median(o):.2f} ({min(o):.2f}-{max(o):.2f})  '
              f'ucp/dcp {statistics.median(u):.2f} ({min(u):.2f}-{max(u):.2f})  '
              f'once cpu/dcp {statistics.median(c):.2f}  once bytes/unique {max(b):.3f}  runs {len(vals)}')
