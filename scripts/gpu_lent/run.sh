#!/bin/bash
# kvforge on a lent GPU (docs/gpu.md): run from the repo root with .gpu/b carried and /tmp/kvf/ort.part00 left by a
# first call (the archive is split to fit 64 MiB a call). Unpack onnxruntime-gpu (sm_90 cubins only) and newer wheels, then the checks.
# Every step has its own timeout and writes under $OUT, so a step that fails leaves the others' results.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
el setup
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/b/whl/*.whl || exit 4
cat /tmp/kvf/ort.part00 .gpu/b/ort.part01 | PYTHONPATH=/tmp/site python3 -c "
import sys, zstandard, tarfile
r = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(sys.stdin.buffer)
tarfile.open(fileobj=r, mode='r|').extractall('/tmp/site')" || { echo "unpack failed"; ls -la /tmp/kvf; exit 3; }
ln -sfn "$PWD" /tmp/site/kvforge
export PYTHONPATH=/tmp/site
SP=$(python3 -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
export LD_LIBRARY_PATH=$(find "$SP/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:):${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import onnxruntime as o, transformers, torch, onnx, onnxscript; print('ort', o.__version__, o.get_available_providers(), 'transformers', transformers.__version__, 'torch', torch.__version__, 'onnx', onnx.__version__, 'onnxscript', onnxscript.__version__)"
python3 -c "import onnxruntime as o; o.preload_dlls() if hasattr(o,'preload_dlls') else None; s=o.InferenceSession" 
KV="python3 -m kvforge.tools.cli"
el "gpu tests + tiny benches (make gpu-check)"
timeout 240 python3 scripts/gpu_check.py --out "$OUT/gpu_check.json"; echo "gpu_check rc=$?"
el "SmolLM2-135M shape, random weights"
timeout 120 python3 -c "
from pathlib import Path; from tests.helpers import make_llama
make_llama(Path('/tmp/smol'), vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0)
print('saved')"
for dt in float32 float16; do
  el "compile smol $dt"
  timeout 150 $KV compile /tmp/smol -o /tmp/smol-$dt --target cuda --dtype $dt --max-batch 8 --max-seq 512 --max-prompt 128 --no-score-graph --quiet; echo "compile rc=$?"
  el "node placement smol $dt"
  timeout 60 python3 -c "
import onnxruntime as ort
so = ort.SessionOptions(); so.log_severity_level = 0
ort.InferenceSession('/tmp/smol-$dt/prefill.onnx', so, providers=[('CUDAExecutionProvider', {'enable_cuda_graph': '0'})])
" 2>&1 | grep -iE "placed on|CPUExecutionProvider|Memcpy|fallback|not supported|no kernel" | head -40
  el "compare smol $dt"
  timeout 90 $KV compare /tmp/smol-$dt --reference /tmp/smol --device cuda --backend ort --steps 32 --json "$OUT/compare_smol_$dt.json"; echo "compare rc=$?"
  el "bench smol $dt"
  timeout 120 $KV bench /tmp/smol-$dt --reference /tmp/smol --device cuda --backend ort --prompt-lens 128 --batch-sizes 1,8 --new-tokens 64 --repeat 3 --warmup 1 --json "$OUT/bench_smol_$dt.json"; echo "bench rc=$?"
done
el "bundled model fp16: compare"
timeout 60 $KV compile models/kvforge-tiny -o /tmp/tiny16 --target cuda --max-batch 8 --max-seq 512 --max-prompt 128 --no-score-graph --quiet && \
timeout 60 $KV compare /tmp/tiny16 --reference models/kvforge-tiny --device cuda --backend ort --json "$OUT/compare_tiny_f16.json"; echo "rc=$?"
el done
