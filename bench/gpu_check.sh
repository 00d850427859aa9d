#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run on a machine that has one (Python 3.12 with torch + CUDA, no network):
# the `gpu` tests, the CPU tests of what the device touches (with the GPU hidden, so `auto` is the CPU there),
# bench/bench_device.py's CPU-vs-GPU table and bench/bench_hardware.py's node-against-a-plain-loop rows. hivemind and what it needs beyond the machine's packages travel as cp312
# wheels in .whl/ (ignored by git), each at constraints.txt's version: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 ...`, and `pip wheel` for those PyPI has only as source (prefetch_generator, varint,
# python-baseconv). The C extension is built here for this Python, or numpy does its work.
#
#     OUT=/some/dir bash bench/gpu_check.sh      # logs and the table land in $OUT
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 --version
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && echo "wheels installed" || echo "WHEELS DID NOT INSTALL"
  python3 setup.py -q build_ext --inplace >/dev/null 2>&1 && echo "C extension built" || echo "no C extension"
} >"$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD

python3 - >>"$OUT/env.txt" 2>&1 <<'EOF'
import torch, numpy, transformers, hivemind
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "numpy", numpy.__version__,
      "transformers", transformers.__version__, "hivemind", hivemind.__version__)
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print("DHT up at", dht.get_visible_maddrs())
dht.shutdown()
from dtrain.bridge import sparse_check
print("C extension:", "built" if sparse_check.native is not None else "absent (numpy)")
EOF
cat "$OUT/env.txt"

# -W default: this machine's torch / transformers may warn where the pinned set does not; the checks are the asserts
PYTEST=(python3 -m pytest -p no:cacheprovider -W default -q -rs)
timeout 150 "${PYTEST[@]}" -m gpu tests/test_device_gpu.py -v >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: rc $?"; tail -15 "$OUT/gpu_tests.log"

timeout 170 python3 bench/bench_device.py 2>&1 | grep -v "loss_type" | tee "$OUT/bench_device.md"

# a node against a plain loop on the GPU (bench/bench_hardware.py): the rows docs/benchmarks.md keeps, each line
# bounded on its own so that what finished is kept (about 10 minutes in all: drop lines to fit a shorter lease)
HW=(python3 bench/bench_hardware.py --device cuda --window 30 --warmup 20 --quiet-wait 0)
timeout 240 "${HW[@]}" --configs configs/gpt2-small.json --shapes 8x64 --runs alone swarm \
  2>"$OUT/hw_small.err" | tee "$OUT/hw_small.md"
timeout 240 "${HW[@]}" --configs configs/gpt2-small.json configs/gpt2-medium.json --shapes 16x512 --runs alone \
  2>"$OUT/hw_16x512.err" | tee "$OUT/hw_16x512.md"
timeout 200 "${HW[@]}" --configs configs/gpt2-xl.json --shapes 8x512 --runs alone \
  2>"$OUT/hw_xl.err" | tee "$OUT/hw_xl.md"

CUDA_VISIBLE_DEVICES= timeout 80 "${PYTEST[@]}" tests/test_device.py tests/test_trainer.py tests/test_serve_engine.py \
  tests/test_split_engine.py tests/test_reference.py >"$OUT/cpu_tests.log" 2>&1
echo "cpu tests (GPU hidden): rc $?"; tail -4 "$OUT/cpu_tests.log"
