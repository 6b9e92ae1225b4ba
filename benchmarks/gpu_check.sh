#!/usr/bin/env bash
# The GPU check a contributor runs on a CUDA machine, from the repository root:
#   benchmarks/gpu_check.sh [results-dir]        (default: results)
# Model-free kernel tests first (they need no model file), then the gpu and cuda_emu tests, then
# bench.py's throughput, speculative and gpu_decode sections (bench.py writes the dated .md/.json
# results files); each step's log goes beside them. A failing step is reported and the next runs.
# Needs only this checkout and its Python packages (requirements.txt, requirements-test.txt).
set -u
out="${1:-results}"
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu_check: no CUDA device visible to torch; nothing run" >&2; exit 2; }
stamp="$(date -u +%Y-%m-%d)-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)"
log="$out/$stamp-gpu-check"
status=0
step() {                                  # step NAME COMMAND...: run it, log it, remember a failure
    local name="$1"; shift
    echo "== $name: $*" | tee -a "$log.md"
    "$@" 2>&1 | tee "$log-$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc" | tee -a "$log.md"
    [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log.md"
step kernels python -m pytest -q -rs test_all.py -k "on_gpu or tensor_cores_and_16_byte_loads or compiles_for_sm80"
step gpu-tests python -m pytest -q -rs test_all.py -m "gpu or cuda_emu"
step bench python bench.py throughput speculative gpu_decode --out "$out"
echo "== graph use (every continuous step should replay a graph):" | tee -a "$log.md"
grep -h -E "graph steps|CUDA graphs:" "$log-bench.log" | tee -a "$log.md"
exit $status
