import json, glob, statistics, sys, os
rows = {}
for f in sorted(glob.glob('' + os.path.join(os.path.dirname(os.path.abspath(__file__)), '*_r*.reshard.json') + '')):
    tag = os.path.basename(f).split('.')[0]; tree, rnd = tag.split('_')
    d = json.load(open(f))
    out = {}
    for p, c in d['common_case'].items():
        out[p] = (c['ucp_over_dcp'], c['ucp_cpu_over_dcp'])
    for p, r in d['restart']['pairs'].items():
        out[p] = (r['wall_ratio'], r['cpu_ratio'])
    saves = {s: d['saves'][s]['ucp']['save_s'] / d['saves'][s]['dcp']['save_s'] for s in d['saves']}
    rows.setdefault(tree, {})[rnd] = (out, saves, d['load_avg']['start'][0])
for tree in ('base', 'new'):
    print(tree)
    for rnd, (out, saves, la) in sorted(rows.get(tree, {}).items()):
        print(' ', rnd, f'load {la:.2f}', ' '.join(f'{p} {w:.2f}/{c:.2f}' for p, (w, c) in out.items()), '| saves', ' '.join(f'{s} {v:.2f}' for s, v in saves.items()))
    pairs = sorted({p for out, _, _ in rows.get(tree, {}).values() for p in out})
    for p in pairs:
        ws = [o[p][0] for o, _, _ in rows[tree].values()]; cs = [o[p][1] for o, _, _ in rows[tree].values()]
        print(f'   {p:12s} wall median {statistics.median(ws):.2f} range {min(ws):.2f}-{max(ws):.2f}  cpu median {statistics.median(cs):.2f} range {min(cs):.2f}-{max(cs):.2f}')
    for s in ('dp4', 'dp2tp2'):
        v = [sv[s] for _, sv, _ in rows[tree].values()]
        print(f'   save {s:8s} median {statistics.median(v):.2f} range {min(v):.2f}-{max(v):.2f}')
