"""Byte parity between the browser DGRD encoder (static/dgrd.js, run under Node) and bridge/dgrd.py."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dtrain.bridge import dgrd

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "js" / "dgrd_parity.mjs"


def _node() -> str:
    for cand in (shutil.which("node"), "/usr/bin/node"):
        if cand and Path(cand).exists():
            return cand
    pytest.skip("node not available")


def _f32_list(a) -> list[float]:
    return [float(v) for v in np.asarray(a, np.float32).reshape(-1)]


def _run_js(tmp_path: Path, spec: dict, name: str) -> bytes:
    inp, out = tmp_path / f"{name}.json", tmp_path / f"{name}.bin"
    inp.write_text(json.dumps(spec), encoding="utf-8")
    proc = subprocess.run([_node(), str(SCRIPT), str(inp), str(out)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# Values probing float16 rounding: subnormals, ties between f16 neighbours, the overflow edge.
EDGE = np.array([
    1e-6, -1e-6, 3e-8, 2.9802322e-08, 5.960464477539063e-08, 8.940696716308594e-08,
    6.097555160522461e-05, 6.1035156e-05, 6.100535e-05, 1.0 + 2**-11, 1.0 + 3 * 2**-11,
    1.0 + 2**-11 + 2**-23, 2048.0 + 1.0, 2048.0 + 3.0, 65504.0, 65519.99, -65519.0,
    0.0, -0.0, 0.1, -0.3333333, 1e-30, 7.0e-5, 3.14159265,
], np.float32)

TENSORS = [5000, 1200, 64, 40000, 7]


def _cases():
    r = _rng(1)
    # Mode 1: unsorted, repeated indices, kept as given
    idx1 = np.array([17, 3, 3, 4999, 0, 17, 2500, 3], np.int64)
    val1 = r.standard_normal(idx1.size).astype(np.float32)
    yield "mode1", 0, [(0, idx1, val1), (2, np.array([63, 1]), EDGE[:2])]
    # Mode 2: gaps 0 (repeat), 255, 256, 300, 1000, and an unsorted tail
    base = np.cumsum([0, 256, 257, 301, 1001, 1, 1]).astype(np.int64)
    idx2 = np.concatenate([base, base[[1, 3]], [5, 4]])
    val2 = np.concatenate([r.standard_normal(base.size), [0.25, -1e-6], [1e-6, 2.0]]).astype(np.float32)
    yield "mode2_gaps", 1, [(0, idx2, val2)]
    # Mode 2 strictly increasing with first index > 256 (bridged from the virtual -1), edge values
    idx3 = np.cumsum(np.array([700] + [1, 255, 256, 257, 0 + 1, 1000] * 4)[:EDGE.size]).astype(np.int64)
    yield "mode2_sorted_edge", 1, [(3, idx3, EDGE), (4, np.array([6]), np.float32([-0.0]))]
    # Mode 2 with -0.0 through the merge path, plus an empty section (left out)
    yield "mode2_merge_negzero", 1, [(2, np.array([9, 2, 9]), np.float32([-0.0, -0.0, 1e-6])),
                                     (1, np.array([], np.int64), np.float32([]))]
    # Dense only, edge values
    dense = np.concatenate([EDGE, r.standard_normal(TENSORS[2] - EDGE.size) * 1e-3]).astype(np.float32)
    yield "dense", 0, [(2, None, dense)]
    # Mixed: dense + sparse in both modes
    for flags in (0, 1):
        sp = r.choice(TENSORS[3], 3000, replace=True).astype(np.int64)
        yield f"mixed{flags}", flags, [
            (4, None, r.standard_normal(7).astype(np.float32)),
            (3, sp, (r.standard_normal(sp.size) * 1e-4).astype(np.float32)),
            (1, np.array([1199, 0]), np.float32([6.1e-5, -65504.0])),
        ]


CASES = list(_cases())


@pytest.mark.parametrize("name,flags,sections", CASES, ids=[c[0] for c in CASES])
def test_encode_parity(tmp_path, name, flags, sections):
    node_id = "nöde-🚀-42"
    want = dgrd.encode(123456, node_id, 2.718281828, 32, sections, flags=flags)
    spec = {
        "step": 123456, "nodeId": node_id, "trainLoss": 2.718281828, "samples": 32, "flags": flags,
        "sections": [{"tensorId": t, "indices": None if i is None else [int(x) for x in i],
                      "values": _f32_list(v)} for t, i, v in sections],
    }
    got = _run_js(tmp_path, spec, name)
    assert got == want
    pkt = dgrd.decode(got, TENSORS)
    assert pkt.node_id == node_id and pkt.step == 123456 and pkt.flags == flags


def test_topk_parity(tmp_path):
    r = _rng(7)
    grads = [r.standard_normal(n).astype(np.float32) * s
             for n, s in ((5000, 1.0), (1200, 1e-3), (64, 10.0), (40000, 1e-5), (5, 1.0))]
    for fraction in (0.01, 0.1, 0.5):
        for flags in (0, 1):
            want = dgrd.encode(3, "n", 1.5, 8, dgrd.topk_sections(grads, fraction), flags=flags)
            spec = {"step": 3, "nodeId": "n", "trainLoss": 1.5, "samples": 8, "flags": flags,
                    "topk": {"fraction": fraction, "grads": [_f32_list(g) for g in grads]}}
            got = _run_js(tmp_path, spec, f"topk_{fraction}_{flags}")
            assert got == want, (fraction, flags)
            dgrd.decode(got, [g.size for g in grads])


def test_f16_overflow_raises(tmp_path):
    spec = {"step": 0, "nodeId": "x", "trainLoss": 0.0, "samples": 1, "flags": 1,
            "sections": [{"tensorId": 0, "indices": [1], "values": [65520.0]}]}
    with pytest.raises(ValueError):
        dgrd.encode(0, "x", 0.0, 1, [(0, np.array([1]), np.float32([65520.0]))], flags=1)
    inp, out = tmp_path / "o.json", tmp_path / "o.bin"
    inp.write_text(json.dumps(spec))
    proc = subprocess.run([_node(), str(SCRIPT), str(inp), str(out)], capture_output=True, text=True)
    assert proc.returncode != 0 and "float16" in proc.stderr


def test_f16_conversion_matches_numpy(tmp_path):
    """Every float16 value, every midpoint between neighbours and its float32 neighbours, and
    random float32 bit patterns: JS f32ToF16Bits must equal numpy astype(float16)."""
    h = np.arange(0x7C00, dtype=np.uint32)  # finite non-negative float16 bit patterns
    vals = h.astype(np.uint16).view(np.float16).astype(np.float32)
    mids = (vals[:-1].astype(np.float64) + vals[1:]) / 2
    mids = np.append(mids, 65520.0).astype(np.float32)  # exact: float16 midpoints fit float32
    mb = mids.view(np.uint32)
    rnd = _rng(3).integers(0, 2**32, 300000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([vals.view(np.uint32), mb, mb - 1, mb + 1, rnd])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    f = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = f.astype(np.float16)
    want_bits = np.where(np.isfinite(want), want.view(np.uint16).astype(np.int32), -1)
    (tmp_path / "in.bin").write_bytes(bits.astype("<u4").tobytes())
    code = (
        "import {readFileSync, writeFileSync} from 'node:fs';"
        f"import {{f32ToF16Bits}} from {json.dumps((REPO / 'dtrain' / 'static' / 'dgrd.js').as_uri())};"
        "const b = readFileSync(process.argv[1]);"
        "const f = new Float32Array(b.buffer, b.byteOffset, b.length / 4);"
        "const o = new Int32Array(f.length);"
        "for (let i = 0; i < f.length; i++) o[i] = f32ToF16Bits(f[i]);"
        "writeFileSync(process.argv[2], o);"
    )
    proc = subprocess.run([_node(), "--input-type=module", "-e", code, str(tmp_path / "in.bin"),
                           str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = np.frombuffer((tmp_path / "out.bin").read_bytes(), "<i4")
    bad = np.flatnonzero(got != want_bits)
    assert bad.size == 0, [(hex(int(bits[i])), int(got[i]), int(want_bits[i])) for i in bad[:5]]


def test_error_feedback(tmp_path):
    code = (
        f"import {{ErrorFeedback, f16Round}} from {json.dumps((REPO / 'dtrain' / 'static' / 'dgrd.js').as_uri())};"
        "const ef = new ErrorFeedback(0.5, 1);"
        "const g = [Float32Array.from([1, -3, 0.5, 2]), Float32Array.from([0.1])];"
        "const s1 = ef.step(g);"
        "const out = {s1: s1.map(s => [s.tensorId, s.indices && Array.from(s.indices), Array.from(s.values)]),"
        " r1: ef.residuals.map(r => Array.from(r))};"
        "ef.step(g); out.r2 = ef.residuals.map(r => Array.from(r));"
        "console.log(JSON.stringify(out));"
    )
    proc = subprocess.run([_node(), "--input-type=module", "-e", code], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["s1"][0][:2] == [0, [1, 3]] and out["s1"][0][2] == [-3, 2]
    assert out["s1"][1][1] is None  # k >= n: dense
    assert out["r1"][0] == [1, 0, 0.5, 0]
    dense_err = float(np.float32(0.1) - np.float32(np.float16(np.float32(0.1))))
    assert out["r1"][1][0] == pytest.approx(dense_err, abs=1e-9)
    # step 2: residual [2, -3, 1, 2] -> keeps |-3| and one of the |2| ties (lowest index: 0)
    assert out["r2"][0] == [0, 0, 1, 2]


def _topk_reference(flat: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, NaN above +inf, the lowest indices first among equals; ascending."""
    mag = np.abs(flat.astype(np.float64))
    rank = np.where(np.isnan(flat), np.inf, mag)  # NaN: ranked by the tier below, not by value
    tier = np.where(np.isnan(flat), 1, 0)
    order = np.lexsort((np.arange(flat.size), -rank, -tier))  # last key first: tier, then magnitude, then index
    return np.sort(order[:k])


def test_topk_exact_on_ties_zeros_and_non_finite(tmp_path):
    """The histogram selection keeps exactly the k largest magnitudes (lowest index among equals, NaN largest),
    on data built to break it: ties across the threshold, one 16-bit bucket holding everything, +-0, subnormals,
    infinities and NaN in the top k."""
    r = _rng(11)
    near = np.float32(1.0) + np.arange(4000, dtype=np.float32) * np.float32(2**-23)  # one high-16-bit bucket
    cases = {
        "ties": r.integers(-3, 4, 5000).astype(np.float32),
        "one_bucket": r.permutation(np.concatenate([near, -near])).astype(np.float32),
        "all_equal": np.full(3000, -0.5, np.float32),
        "zeros": np.concatenate([np.zeros(500, np.float32), -np.zeros(500, np.float32), np.float32([1e-45, -1e-45])]),
        "non_finite": np.concatenate([r.standard_normal(3000), [np.inf, -np.inf, np.nan, np.nan, np.inf] * 8]
                                     ).astype(np.float32),
        "nan_over_k": np.concatenate([np.full(100, np.nan), [np.inf, -np.inf], r.standard_normal(900)]
                                     ).astype(np.float32),
        "random": r.standard_normal(20011).astype(np.float32),
    }
    names = list(cases)
    for i, name in enumerate(names):
        (tmp_path / f"{i}.bin").write_bytes(cases[name].astype("<f4").tobytes())
    fractions = [0.0001, 0.01, 0.03, 0.5, 0.999]
    code = (
        "import {readFileSync} from 'node:fs';"
        f"import {{topK}} from {json.dumps((REPO / 'dtrain' / 'static' / 'dgrd.js').as_uri())};"
        f"const out = []; for (let i = 0; i < {len(names)}; i++) {{"
        " const b = readFileSync(process.argv[1] + '/' + i + '.bin');"
        " const g = new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.length));"
        f" out.push({json.dumps(fractions)}.map((f) => {{ const s = topK([g], f)[0];"
        "  return s.indices === null ? null : Array.from(s.indices); }));"
        "} console.log(JSON.stringify(out));"
    )
    proc = subprocess.run([_node(), "--input-type=module", "-e", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for name, per_fraction in zip(names, got):
        flat = cases[name]
        for fraction, indices in zip(fractions, per_fraction):
            k = max(1, round(flat.size * fraction))
            want = _topk_reference(flat, k)
            assert indices == want.tolist(), (name, fraction, k)


def test_error_feedback_equals_topk_of_the_sums(tmp_path):
    """ErrorFeedback's fused add-and-count pass sends what topK(residual + grad) sends and keeps the same residual,
    to the bit, over steps in both modes, with ties and a tensor small enough to go dense."""
    code = (
        f"import {{ErrorFeedback, topK, f16Round}} from {json.dumps((REPO / 'dtrain' / 'static' / 'dgrd.js').as_uri())};"
        "let seed = 7; const rnd = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648 - 0.5;"
        "const shapes = [5000, 300, 64, 1]; const bad = [];"
        "for (const flags of [0, 1]) {"
        " const ef = new ErrorFeedback(0.02, flags); const ref = shapes.map((n) => new Float32Array(n));"
        " for (let step = 0; step < 4; step++) {"
        "  const grads = shapes.map((n, t) => Float32Array.from({ length: n }, (_, i) =>"
        "   t === 1 ? Math.round(rnd() * 4) : rnd() * 10 ** (-t)));"
        "  const got = ef.step(grads);"
        "  ref.forEach((r, t) => { for (let i = 0; i < r.length; i++) r[i] += grads[t][i]; });"
        "  const want = topK(ref, 0.02);"
        "  for (const s of want) { const r = ref[s.tensorId];"
        "   if (s.indices === null) for (let i = 0; i < r.length; i++) r[i] -= f16Round(s.values[i]);"
        "   else for (let m = 0; m < s.indices.length; m++) r[s.indices[m]] -= flags ? f16Round(s.values[m]) : s.values[m]; }"
        "  const same = (a, b) => (a === null && b === null) || (a !== null && b !== null && a.length === b.length"
        "   && a.every((v, i) => Object.is(v, b[i])));"
        "  want.forEach((s, t) => { if (!same(s.indices, got[t].indices) || !same(s.values, got[t].values))"
        "   bad.push(`flags ${flags} step ${step} tensor ${t}: sections differ`); });"
        "  ref.forEach((r, t) => { if (!same(r, ef.residuals[t])) bad.push(`flags ${flags} step ${step} tensor ${t}: residuals differ`); });"
        " }"
        "} console.log(JSON.stringify(bad));"
    )
    proc = subprocess.run([_node(), "--input-type=module", "-e", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
