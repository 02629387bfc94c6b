#!/usr/bin/env python3
"""Checks a restored backup against the history of the writes made while it was taken.

Issue 28's "Done when", for `scripts/bench-backup.sh`: restored from a backup taken under
YCSB-A, the store must hold exactly the source's state at a consistent cut. The writes come from
`dpukv-bench --history FILE` (one line per write: `<key hex> <tag> <invoked us> <completed us>
<ok|err>`; every value written is `<record>:<tag>` padded with `x`, the load's tag 0); the
restored state from `dpukv scan` (`key<TAB>value` lines); the backup's window from the moments
its request was sent (S) and answered (E), in microseconds since the Unix epoch.

What a restored state must satisfy (docs/backup.md §2):
1. its keys are the source's (YCSB-A only updates);
2. every value was written by some write of the history invoked before E, or is the key's value
   when the history began — nothing from after the backup, nothing made up;
3. it is a cut closed under real-time order: with T the later of S and the latest invocation of
   any write it holds, no key's write in it was superseded by a write acknowledged before T (a
   write invoked after it completed). A state holding w must hold every write acknowledged
   before w was invoked; every write acknowledged before the backup was asked for is held.
A write that failed (outcome unknown) may be held, and never counts as superseding.

Usage: check-backup-history.py --history FILE --dump FILE --started US --finished US
       --before FILE   (the source's state when the history began: `dpukv scan` lines)
       check-backup-history.py --self-test
Prints one JSON line; exit 1 on a violation.
"""
import argparse
import json
import sys


def parse_history(lines):
    """key hex -> list of writes (tag, invoked, completed, ok); tag -> (key hex, write)."""
    by_key, by_tag = {}, {}
    for n, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 5 or parts[4] not in ("ok", "err"):
            raise ValueError(f"history line {n}: {line!r}")
        key, tag, inv, comp, ok = parts[0], int(parts[1]), int(parts[2]), int(parts[3]), parts[4] == "ok"
        w = (tag, inv, comp, ok)
        by_key.setdefault(key, []).append(w)
        if tag in by_tag:
            raise ValueError(f"history line {n}: tag {tag} written twice")
        by_tag[tag] = (key, w)
    return by_key, by_tag


def value_tag(value):
    """The tag of a value `<record>:<tag>xxx...`, or None."""
    try:
        _, rest = value.split(b":", 1)
    except ValueError:
        return None
    digits = rest.split(b"x", 1)[0]
    return int(digits) if digits.isdigit() else None


def check(by_key, by_tag, state, started, finished, before, limit=10):
    """state, before: key hex -> value bytes. Returns (summary dict, violations list)."""
    bad = []
    keys = before.keys()
    missing = sorted(set(keys) - set(state))
    extra = sorted(set(state) - set(keys))
    for k in missing[:limit]:
        bad.append(f"key {bytes.fromhex(k)!r} missing")
    for k in extra[:limit]:
        bad.append(f"key {bytes.fromhex(k)!r} not in the source")
    if len(missing) + len(extra) > 2 * limit:
        bad.append(f"{len(missing)} keys missing, {len(extra)} extra")
    late = 0
    held = {}  # key -> the write it holds: (tag, invoked, completed, ok); the load is (0, 0, 0, True)
    for k, v in state.items():
        tag = value_tag(v)
        found = by_tag.get(tag) if tag is not None else None
        if found is None or found[0] != k:
            # Not a write of the history: the key's value when the history began, or made up.
            if before.get(k) == v:
                held[k] = (0, 0, 0, True)
            else:
                bad.append(f"key {bytes.fromhex(k)!r}: value {v[:40]!r} is neither a write of the history nor its value before")
            continue
        w = found[1]
        if w[1] >= finished:
            late += 1
            if late <= limit:
                bad.append(f"key {bytes.fromhex(k)!r}: holds write {tag}, invoked {w[1] - finished} us after the backup ended")
        held[k] = w
    if late > limit:
        bad.append(f"{late} keys hold a write invoked after the backup ended (the latest {max(w[1] for w in held.values()) - finished} us after)")
    latest = max((w[1] for w in held.values()), default=0)
    cut = max(started, latest)
    superseded = 0
    for k, w in held.items():
        for later in by_key.get(k, ()):
            # Acknowledged before the cut, and begun after the held write was acknowledged.
            if later[3] and later[2] < cut and later[1] > w[2]:
                superseded += 1
                if superseded <= limit:
                    bad.append(
                        f"key {bytes.fromhex(k)!r}: holds write {w[0]} but write {later[0]}, invoked after it "
                        f"completed, was acknowledged {cut - later[2]} us before the cut"
                    )
                break
    if superseded > limit:
        bad.append(f"{superseded} keys hold a write superseded before the cut")
    from_history = sum(1 for w in held.values() if w[0] != 0)
    summary = {
        "keys": len(state),
        "writes_in_history": len(by_tag),
        "keys_holding_a_history_write": from_history,
        "keys_holding_their_value_before": len(held) - from_history,
        "cut_after_request_us": cut - started,
        "ok": not bad,
    }
    return summary, bad


def read_dump(path):
    state = {}
    with open(path, "rb") as f:
        for line in f:
            line = line.rstrip(b"\n")
            if not line:
                continue
            k, _, v = line.partition(b"\t")
            state[k.hex()] = v
    return state


def self_test():
    """The checker finds what it is for: each broken state below must fail, the good one pass."""
    k1, k2 = b"user1".hex(), b"user2".hex()
    hist = [
        f"{k1} 11 100 200 ok",  # k1 := 11, acknowledged at 200
        f"{k2} 21 300 400 ok",  # k2 := 21, invoked after 11 was acknowledged
        f"{k1} 12 500 600 ok",  # k1 := 12
        f"{k2} 22 700 800 err",  # outcome unknown
    ]
    by_key, by_tag = parse_history(hist)
    val = lambda rec, tag: f"{rec}:{tag}".encode() + b"x" * 10
    before = {k1: val(1, 0), k2: val(2, 5)}

    def run(state, s, e):
        return check(by_key, by_tag, state, s, e, before)[1]

    # A backup asked at 450, answered at 650: {11, 21} (cut before 12) and {12, 21} are cuts.
    assert not run({k1: val(1, 11), k2: val(2, 21)}, 450, 650)
    assert not run({k1: val(1, 12), k2: val(2, 21)}, 450, 650)
    # The unknown write may be held (and says nothing about what came before it beyond its start).
    assert not run({k1: val(1, 12), k2: val(2, 22)}, 450, 900)
    # 21 held without 11, which was acknowledged before 21 was invoked: not prefix-closed.
    assert run({k1: val(1, 0), k2: val(2, 21)}, 150, 650)
    # Missing a write acknowledged before the backup was asked for.
    assert run({k1: val(1, 11), k2: val(2, 5)}, 450, 650)
    # Before the history's first acknowledgement: the state it began with.
    assert not run({k1: val(1, 0), k2: val(2, 5)}, 50, 650)
    # A value of a tag the history never wrote, other than the one before.
    assert run({k1: val(1, 0), k2: val(2, 6)}, 50, 650)
    # A write invoked after the backup ended.
    assert run({k1: val(1, 12), k2: val(2, 21)}, 450, 480)
    # A value no write made, a tag written to another key, a key lost, a key made up.
    assert run({k1: b"garbage", k2: val(2, 21)}, 450, 650)
    assert run({k1: val(1, 21), k2: val(2, 21)}, 450, 650)
    assert run({k2: val(2, 21)}, 450, 650)
    assert run({k1: val(1, 11), k2: val(2, 21), b"user3".hex(): val(3, 0)}, 450, 650)
    print(json.dumps({"self_test": "ok"}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", action="append", default=[])
    ap.add_argument("--dump")
    ap.add_argument("--started", type=int)
    ap.add_argument("--finished", type=int)
    ap.add_argument("--before")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return 0
    if not (a.history and a.dump and a.before and a.started is not None and a.finished is not None):
        ap.error("--history, --dump, --before, --started and --finished are needed")
    lines = []
    for h in a.history:
        with open(h) as f:
            lines.extend(f)
    by_key, by_tag = parse_history(lines)
    summary, bad = check(by_key, by_tag, read_dump(a.dump), a.started, a.finished, read_dump(a.before))
    summary["violations"] = bad
    print(json.dumps(summary))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
