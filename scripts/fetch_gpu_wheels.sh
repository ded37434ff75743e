#!/usr/bin/env bash
# Download into ./.whl the cp312 manylinux wheels the server and its tests need that the
# GPU image lacks (it has httpx, httpcore, h11, anyio, prometheus-client, uvloop,
# typing-extensions, click). Pins match requirements-cpu.txt / the CI venv.
# On the GPU machine: python3 -m pip install --no-index --no-deps .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
  Jinja2==3.1.6 MarkupSafe==3.0.4   # model chat templates
  fla-core==0.6.0 einops==0.8.2     # KDA decode baseline in peregrine.bench.kernels_kda (pure Python + Triton)
  tiktoken==0.14.0 regex==2026.11.19 safetensors==0.8.0 tokenizers==0.23.3  # Kimi tokenizer, checkpoints
  # test-only: transformers' KimiLinearForCausalLM, the reference of tests/test_hf_conformance.py
  transformers==5.24.0 huggingface-hub==2.4.0 hf-xet==1.8.0 pyyaml==6.0.4 tqdm==4.70.1 typer==0.29.2
  shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
)
mkdir -p .whl
for p in "${PKGS[@]}"; do
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$p"
done
ls -1 .whl
