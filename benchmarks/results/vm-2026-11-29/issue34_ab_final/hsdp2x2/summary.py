"""hsdp2x2 alone, 6 alternating rounds of 7 paired repeats per tree: ucp/dcp and once/dcp per
round (median of its repeats), and their medians over the rounds. python3 summary.py"""
import glob, json, os, statistics
here = os.path.dirname(os.path.abspath(__file__))
rows = {}
for f in sorted(glob.glob(os.path.join(here, '*_r*.read_once.json'))):
    tree, rnd = os.path.basename(f).split('.')[0].split('_')
    w = json.load(open(f))['local']['targets']['hsdp2x2']['ways']
    rows.setdefault(tree, []).append((rnd, w['ucp']['s'] / w['dcp']['s'], w['once']['s'] / w['dcp']['s']))
for tree in ('base', 'new'):
    v = rows[tree]
    print(tree, ' '.join(f'{r}: {u:.2f}/{o:.2f}' for r, u, o in v))
    print(f'  ucp/dcp median {statistics.median(x[1] for x in v):.2f}, once/dcp median '
          f'{statistics.median(x[2] for x in v):.2f}')
