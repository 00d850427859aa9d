"""Ingest speed of DGRD packets: decode + validate + accumulate, per mode, on GPT-2-small shapes.

Compares ``bridge.dgrd`` (whole-array numpy) with a straightforward per-entry Python decoder
(``struct.unpack_from`` in a loop, then ``acc[i] += w * v`` per entry) in the same run. The
per-entry decoder runs on a slice of the packet (a few tensors) and its rate is scaled; the table
says which slice.

    python bench/bench_ingest.py [--density 0.01] [--dense-elements 10_000_000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import struct
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bridge import dgrd  # noqa: E402


def gpt2_small_elements(vocab=50257, d_model=768, n_layer=12, d_ff=3072, n_pos=1024):
    """(name, elements) in GPT2LMHeadModel.named_parameters() order, tied lm_head listed once."""
    out = [("transformer.wte.weight", vocab * d_model), ("transformer.wpe.weight", n_pos * d_model)]
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        out += [(p + "ln_1.weight", d_model), (p + "ln_1.bias", d_model),
                (p + "attn.c_attn.weight", d_model * 3 * d_model), (p + "attn.c_attn.bias", 3 * d_model),
                (p + "attn.c_proj.weight", d_model * d_model), (p + "attn.c_proj.bias", d_model),
                (p + "ln_2.weight", d_model), (p + "ln_2.bias", d_model),
                (p + "mlp.c_fc.weight", d_model * d_ff), (p + "mlp.c_fc.bias", d_ff),
                (p + "mlp.c_proj.weight", d_ff * d_model), (p + "mlp.c_proj.bias", d_model)]
    out += [("transformer.ln_f.weight", d_model), ("transformer.ln_f.bias", d_model)]
    return out


# ---------------------------------------------------------------------------------------------
# the baseline: what one writes without numpy


def naive_ingest(data: bytes, elements, accumulators, weight: float) -> int:
    """Per-entry decode with the same checks, then per-entry apply. Returns entries on the wire."""
    magic, version, flags, _step, id_len = struct.unpack_from("<4sHHII", data, 0)
    if magic != b"DGRD" or version != 1 or flags not in (0, 1) or not 1 <= id_len <= 256:
        raise ValueError("bad header")
    pos = 16
    data[pos:pos + id_len].decode("utf-8")
    pos += id_len
    loss, samples, n_tensors = struct.unpack_from("<fII", data, pos)
    pos += 12
    if not math.isfinite(loss) or samples == 0:
        raise ValueError("bad header")
    staged, seen, entries = [], set(), 0
    for _ in range(n_tensors):
        tid, nnz = struct.unpack_from("<II", data, pos)
        pos += 8
        if tid >= len(elements) or tid in seen:
            raise ValueError("bad tensor id")
        seen.add(tid)
        n = elements[tid]
        idx, vals = [], []
        if nnz == 0:
            for i in range(n):
                (v,) = struct.unpack_from("<e", data, pos)
                pos += 2
                if not math.isfinite(v):
                    raise ValueError("bad value")
                idx.append(i)
                vals.append(v)
            entries += n
        elif flags == 0:
            for _ in range(nnz):
                i, v = struct.unpack_from("<If", data, pos)
                pos += 8
                if i >= n or not math.isfinite(v):
                    raise ValueError("bad entry")
                idx.append(i)
                vals.append(v)
            entries += nnz
        else:
            i = -1
            for _ in range(nnz):
                s, v = struct.unpack_from("<Be", data, pos)
                pos += 3
                i += s + 1
                if i >= n or not math.isfinite(v):
                    raise ValueError("bad entry")
                idx.append(i)
                vals.append(v)
            entries += nnz
        staged.append((tid, idx, vals))
    if pos != len(data):
        raise ValueError("trailing bytes")
    for tid, idx, vals in staged:  # validated: apply
        acc = accumulators[tid]
        for i, v in zip(idx, vals):
            acc[i] += weight * v
    return entries


# ---------------------------------------------------------------------------------------------


def wire_entries(packet: dgrd.Packet) -> int:
    return sum(s.values.size for s in packet.sections)


def time_best(fn, repeats):
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def pick(ids, size_of, budget):
    """The longest run of ids, from the first, whose sizes add up to at most budget."""
    out, total = [], 0
    for tid in ids:
        if total + size_of(tid) > budget:
            break
        out.append(tid)
        total += size_of(tid)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--density", type=float, default=0.01, help="fraction of entries kept (top-k)")
    ap.add_argument("--dense-elements", type=int, default=10_000_000,
                    help="elements in the Mode 3 packet (a subset of the model)")
    ap.add_argument("--naive-entries", type=int, default=150_000,
                    help="entries the per-entry Python decoder gets (its slice)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per mode; best is kept")
    args = ap.parse_args()

    named = gpt2_small_elements()
    elements = [n for _, n in named]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    sparse = []  # top-k of a random gradient, tensor by tensor to keep memory flat
    for tid, n in enumerate(elements):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)
        _, idx, vals = dgrd.topk_sections([g], args.density)[0]
        sparse.append((tid, idx, vals))
    dense_ids = pick(range(2, len(elements)), lambda t: elements[t], args.dense_elements)
    dense = [(tid, None, rng.standard_normal(elements[tid], dtype=np.float32) * np.float32(1e-2))
             for tid in dense_ids]
    gen_s = time.perf_counter() - t0

    nnz_of = lambda t: sparse[t][1].size  # noqa: E731
    slice_sparse = pick(range(2, len(elements)), nnz_of, args.naive_entries)
    # the smallest whole matrix at or over the budget (a prefix would be layer-norm vectors only)
    slice_dense = [min((t for t in dense_ids if elements[t] >= args.naive_entries),
                       key=lambda t: elements[t])]
    span = lambda ids: named[ids[0]][0].removeprefix("transformer.") + (  # noqa: E731
        f" .. {named[ids[-1]][0].removeprefix('transformer.')} ({len(ids)} tensors)"
        if len(ids) > 1 else "")
    cases = [  # mode, packet, packet of the naive slice, slice description
        ("1 (u32 idx, f32)", dgrd.encode(1, "bench", 3.0, 8, sparse, 0),
         dgrd.encode(1, "bench", 3.0, 8, [sparse[t] for t in slice_sparse], 0),
         span(slice_sparse)),
        ("2 (u8 skip, f16)", dgrd.encode(1, "bench", 3.0, 8, sparse, 1),
         dgrd.encode(1, "bench", 3.0, 8, [sparse[t] for t in slice_sparse], 1),
         span(slice_sparse)),
        ("3 (dense f16)", dgrd.encode(1, "bench", 3.0, 8, dense, 0),
         dgrd.encode(1, "bench", 3.0, 8, [d for d in dense if d[0] in slice_dense], 0),
         span(slice_dense)),
    ]

    accumulators = [np.ones(n, np.float32) for n in elements]  # touched: no page faults timed
    rows = []
    for mode, data, small, slice_desc in cases:
        packet = dgrd.decode(data, elements)
        n = wire_entries(packet)
        dec_s = time_best(lambda: dgrd.decode(data, elements), args.repeats)
        all_s = time_best(lambda: dgrd.accumulate(dgrd.decode(data, elements), accumulators, 0.5),
                          args.repeats)
        t = time.perf_counter()
        n_small = naive_ingest(small, elements, accumulators, 0.5)
        naive_s = time.perf_counter() - t
        # check the baseline agrees with the codec on the slice
        check = [np.zeros(e, np.float32) for e in elements]
        dgrd.accumulate(dgrd.decode(small, elements), check, 1.0)
        ref = [np.zeros(e, np.float32) for e in elements]
        naive_ingest(small, elements, ref, 1.0)
        assert all(np.allclose(a, b) for a, b in zip(check, ref))
        fast_rate, naive_rate = n / all_s, n_small / naive_s
        rows.append((mode, len(data) / 1e6, n, dec_s, all_s, len(data) / 1e6 / all_s, fast_rate,
                     slice_desc, n_small, len(small) / 1e6 / naive_s, naive_rate,
                     fast_rate / naive_rate))

    total = sum(elements)
    print(f"GPT-2 small: {len(elements)} tensors, {total:,} elements; density {args.density:g} "
          f"(top-k of random normal); Mode 3 on {len(dense_ids)} tensors, "
          f"{sum(elements[t] for t in dense_ids):,} elements. numpy {np.__version__}, "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs. "
          f"Best of {args.repeats}; setup {gen_s:.1f} s.\n")
    print("| mode | packet MB | wire entries | decode+validate s | decode+validate+accumulate s | MB/s "
          "| entries/s | per-entry Python: slice | slice entries | MB/s | entries/s | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:,} | {r[3]:.4f} | {r[4]:.4f} | {r[5]:,.0f} "
              f"| {r[6]:.3g} | {r[7]} | {r[8]:,} | {r[9]:.2f} | {r[10]:.3g} | {r[11]:,.0f}x |")
    print("\nPer-entry Python ran once on its slice (same checks, validate-then-apply); its rates "
          "are from that slice, the speedup compares entries/s. Mode 2 wire entries include the "
          "zero entries that bridge gaps over 256.")


if __name__ == "__main__":
    main()
