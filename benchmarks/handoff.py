"""Hand-off of a prompt's KV from a prefill engine to a decode engine through shared memory, against
memcpy of the same bytes (issue 25's "hand-off ms and GB/s against the measured memcpy bandwidth").

Two engines of one artifact (a prefill and a decode worker's, in one process: the copies and page
mappings are what they are across processes). The prompt (``--tokens`` long) is prefilled once into
the prefill engine's row 0; then each round, alternating, times:

- hand-off: ``export_kv`` straight into shared memory (``SegmentAllocator``, what the scheduler's
  ``block_alloc`` does) hashing each layer as it copies it, ``put``, ``take`` (check the
  fingerprint), ``import_kv`` into the decode engine's row 0 checking the checksum as it copies,
  and ``release`` (what the workers do): the whole path and each part, once into an arena slot
  (pages populated once and reused: what a worker does) and once into a new segment of its own
  (new pages each time: the cost the arena avoids); and "arena 2-pass", the path before the
  checksum was fused into the copies: ``put`` hashes the block and ``take`` checks it, each in a
  pass of its own;
- lent (one copy, what a prefill worker does by default): the prefill engine's cache is in shared
  memory (``kv_shared=True``); "export" hashes the row in place (``export_kv(view=True)``, one read
  pass, no copy) and lends it, ``put`` makes the ref, ``take`` maps the cache segment (once) and
  gives the row's strided view, ``import_kv`` copies it into the decode engine's row checking the
  checksum as it copies, ``release`` frees the row;
- memcpy: ``np.copyto`` of the same number of bytes into a preallocated (warm) array, and into a
  new one (``np.copy``: fresh pages, as a new segment has); and "row copy": the one strided copy
  of the row from the prefill cache into the decode cache, nothing else (no checksum, no ref): the
  floor of any one-copy hand-off between these caches (ordinary 4 KiB pages on both sides, where
  numpy's arrays of the memcpy lines may get transparent huge pages);

and prints medians, GB/s (block bytes / seconds), the ratios, and the prefill the hand-off saves.
``--ray`` adds the Ray roles' path (a local one-CPU Ray instance): ``export_kv`` into a new array,
``ray.put`` into the object store, ``ray.get`` (a zero-copy view on this node), ``import_kv``.

    .venv/bin/kvforge compile /work/smollm2/hf -o /work/tmp-onecopy/smollm2 --max-seq 2048
    .venv/bin/python benchmarks/handoff.py /work/tmp-onecopy/smollm2 --tokens 1200 --rounds 20
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from pathlib import Path

import numpy as np

from kvforge.runtime import Engine
from kvforge.runtime.kv import shm
from kvforge.runtime.kv.digest import Digest

TEXT = (
    "The decoder reads the prompt once and keeps, for every layer, the keys and values of every "
    "position in a cache; each new token then attends to that cache instead of the whole prompt. "
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--tokens", type=int, default=1200, help="prompt length (1,000-1,500 in issue 25)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ray", action="store_true", help="also time the hand-off through Ray's object store")
    args = ap.parse_args()

    pre = Engine.load(args.artifact, threads=args.threads, prefix_cache=0, kv_shared=True)  # lends row 0
    dec = Engine.load(args.artifact, threads=args.threads, prefix_cache=0)
    ids = (pre.tokenizer.encode(TEXT * (args.tokens // 20 + 1)) * 2)[: args.tokens]
    t0 = time.perf_counter()
    pre.prefill([ids])
    prefill_s = time.perf_counter() - t0
    nbytes = pre.kv_nbytes(len(ids))
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    warm = np.empty_like(src)
    arena = shm.SegmentAllocator(arena_bytes=nbytes + shm.SLOT_HEADER)  # populated once, reused
    own = shm.SegmentAllocator(arena_bytes=0)  # a new segment (new pages) per hand-off
    parts = ("export", "put", "take", "import")
    times: dict[str, list[float]] = collections.defaultdict(list)
    if args.ray:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    for _ in range(args.rounds):
        if args.ray:
            t = [time.perf_counter()]
            block = pre.export_kv(0, ids)
            t.append(time.perf_counter())
            ref = ray.put(block.data)
            t.append(time.perf_counter())
            data = ray.get(ref)
            t.append(time.perf_counter())
            dec.import_kv(block.__class__(block.fingerprint, 0, block.token_ids, data), 0)
            t.append(time.perf_counter())
            del block, data, ref
            for key, a, b in zip(("export", "put", "get", "import"), t, t[1:]):
                times[f"ray {key}"].append(b - a)
            times["ray handoff"].append(t[-1] - t[0])
        t = [time.perf_counter()]
        digest = Digest()
        block = pre.export_kv(0, ids, digest=digest, view=True)  # no copy: hashed in place
        lent = _handoff(block, digest.value())
        lent.on_release = pre.cache.segment.lend(0, block.data)
        t.append(time.perf_counter())
        ref = pre.cache.segment.put(lent)
        t.append(time.perf_counter())
        handoff = shm.take(ref, dec.kv_fingerprint, verify=False)
        t.append(time.perf_counter())
        dec.import_kv(handoff.block, 0, checksum=handoff.checksum)  # the one copy, checked as it copies
        handoff.release()  # the row is the prefill engine's again
        t.append(time.perf_counter())
        assert not pre.cache.segment.lent(0)
        del block, lent, handoff
        for key, a, b in zip(parts, t, t[1:]):
            times[f"lent {key}"].append(b - a)
        times["lent handoff"].append(t[-1] - t[0])
        for mode, alloc, fused in (("arena", arena, True), ("arena 2-pass", arena, False), ("own", own, True)):
            t = [time.perf_counter()]
            digest = Digest() if fused else None  # fused: hashed layer by layer as it is copied
            block = pre.export_kv(0, ids, out=alloc(nbytes), digest=digest)
            t.append(time.perf_counter())
            ref = alloc.put(_handoff(block, digest and digest.value()))  # 2-pass: hashes the block here
            t.append(time.perf_counter())
            handoff = shm.take(ref, dec.kv_fingerprint, verify=not fused)  # 2-pass: checks it here
            t.append(time.perf_counter())
            dec.import_kv(handoff.block, 0, checksum=handoff.checksum)  # fused: checked as it copies
            handoff.release()  # what the scheduler does once imported: the arena slot is free again
            t.append(time.perf_counter())
            del block, handoff  # an own segment (unlinked at take) is unmapped
            for key, a, b in zip(parts, t, t[1:]):
                times[f"{mode} {key}"].append(b - a)
            times[f"{mode} handoff"].append(t[-1] - t[0])
        t0 = time.perf_counter()
        np.copyto(warm, src)
        t1 = time.perf_counter()
        fresh = np.copy(src)
        t2 = time.perf_counter()
        dec.cache.buffer[:, :, 0, :, : len(ids)] = pre.cache.buffer[:, :, 0, :, : len(ids)]
        t3 = time.perf_counter()
        del fresh
        times["memcpy (warm dst)"].append(t1 - t0)
        times["memcpy (new dst)"].append(t2 - t1)
        times["row copy (no hash)"].append(t3 - t2)
    arena.close()
    pre.close()  # unlinks its cache's segment
    dec.close()
    if args.ray:
        ray.shutdown()
    assert not shm.segments(os.getpid()), "a segment was left behind"

    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    print(f"artifact {args.artifact}, prompt {len(ids)} tokens, block {nbytes / 1e6:.1f} MB, {args.rounds} rounds")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"checksum: {ref.checksum.partition(':')[0]}; load average (1, 5, 15 min) {load}")
    for key in med:
        print(f"  {key:24s} {med[key] * 1e3:8.2f} ms  {gbs[key]:6.2f} GB/s")
    for mode in ("lent", "arena", "arena 2-pass", "own", *(["ray"] if args.ray else [])):
        warm_ratio = gbs[f"{mode} handoff"] / gbs["memcpy (warm dst)"]
        new_ratio = gbs[f"{mode} handoff"] / gbs["memcpy (new dst)"]
        row_ratio = gbs[f"{mode} handoff"] / gbs["row copy (no hash)"]
        # the same ratio round by round (each round times every path and memcpy back to back), then
        # its median: steadier than the ratio of medians when the machine's load drifts
        paired = statistics.median(m / h for m, h in zip(times["memcpy (warm dst)"], times[f"{mode} handoff"]))
        print(
            f"hand-off ({mode}) / memcpy bandwidth: {warm_ratio:.0%} (warm dst; {paired:.0%} median of rounds), "
            f"{new_ratio:.0%} (new dst); / row copy: {row_ratio:.0%}"
        )
    print(
        f"prefill of the same prompt on {args.threads} thread(s): {prefill_s * 1e3:.0f} ms "
        f"({prefill_s / med['lent handoff']:.0f}x the lent hand-off, "
        f"{prefill_s / med['arena handoff']:.0f}x the arena's)"
    )


def _handoff(block, checksum):
    """A hand-off around ``block`` (the other fields as a greedy request's; only the block's bytes
    matter for the timing)."""
    from kvforge.runtime.kv.handoff import Handoff

    return Handoff(list(block.token_ids), 16, {}, None, 0, None, {}, block, checksum=checksum)


if __name__ == "__main__":
    main()
