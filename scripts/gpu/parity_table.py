"""parity_table.py JSONL...: parity.sh's table from its JSON lines (of
one call or several): O0's seed-to-seed spread, and for every other run
the validation loss paired with O0 of the same seed; beside it, unpaired,
the run's mean over its seeds against O0's mean over the same seeds
(where a run's trajectory, not its seed, sets most of its loss, pairing
removes little and the two agree). Runs of another protocol (run options
lr=, warmup=, batch=, steps=) are paired only with O0 of the same
protocol, a table each.
"""
import json, statistics, sys


KEYS = ('lr=', 'warmup=', 'batch=', 'steps=')


def options(run):
    """The run's options (LEVEL:COMPUTE:OPTS, OPTS joined by +)."""
    opts = run.split(':', 2)[2] if run.count(':') >= 2 else ''
    return [o for o in opts.split('+') if o]


def protocol(run):
    """The run's protocol options (key=value), sorted and joined by +."""
    return '+'.join(sorted(o for o in options(run) if o.startswith(KEYS)))


def is_base(run):
    """O0 with no option but its protocol's: what the others pair with."""
    return run.startswith('O0:') and all(o.startswith(KEYS) for o in options(run))


rows = sorted((json.loads(l) for f in sys.argv[1:] for l in open(f)), key=lambda r: r['seed'])
for proto in dict.fromkeys(protocol(r['run']) for r in rows):
    mine = [r for r in rows if protocol(r['run']) == proto]
    base = {r['seed']: r['val_loss'] for r in mine if is_base(r['run'])}
    if not base:
        print(f"PARITY protocol {proto or 'default'}: no O0 run")
        continue
    print(f"PARITY protocol {proto or 'default'}:")
    if len(base) > 1:
        b = list(base.values())
        print(f"PARITY O0: mean {statistics.mean(b):.4f}, seed-to-seed spread (stdev / mean) "
              f"{100 * statistics.stdev(b) / statistics.mean(b):.2f} %")
    print(f"| run | vs O0 by seed {min(base)}-{max(base)} (%) | mean | s.e. | within 0.5% and 2 s.e. "
          "| unpaired: mean (s.e.) |")
    print("|---|---|---|---|---|---|")
    for run in dict.fromkeys(r['run'] for r in mine if not is_base(r['run'])):
        d = [100 * (r['val_loss'] / base[r['seed']] - 1) for r in mine if r['run'] == run and r['seed'] in base]
        if len(d) < 2:
            continue
        m, se = statistics.mean(d), statistics.stdev(d) / len(d) ** 0.5
        ok = abs(m) <= 0.5 and abs(m) <= 2 * se
        v = [r['val_loss'] for r in mine if r['run'] == run and r['seed'] in base]
        o = [base[r['seed']] for r in mine if r['run'] == run and r['seed'] in base]
        um = 100 * (statistics.mean(v) / statistics.mean(o) - 1)
        use = 100 * (statistics.variance(v) / len(v) + statistics.variance(o) / len(o)) ** 0.5 / statistics.mean(o)
        print(f"| {run} | {', '.join(f'{x:+.2f}' for x in d)} | {m:+.2f} | {se:.2f} | {'yes' if ok else 'no'} "
              f"| {um:+.2f} ({use:.2f}) |")
