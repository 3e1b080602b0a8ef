#!/usr/bin/env bash
# benchmarks/device_check.py on a lent GPU machine, in one command.
#
# That machine has PyTorch, transformers, numpy and tokenizers but not the rest of what the engine imports, and
# reaches no package index; it gets the repository and the folders a run carries. So, here first (needs PyPI):
#
#     bash benchmarks/device_check.sh prepare    # wheels for Python 3.12 and the default model's tokenizer into
#                                                # .device/ (add /.device/ to .git/info/exclude; $PYTHON, default
#                                                # .venv/bin/python, finds the tokenizer)
#
# then there, from the repository root, with .device carried and $OUT the folder whose files come back:
#
#     bash benchmarks/device_check.sh run        # writes $OUT/device_check.json and $OUT/device_check.log
set -euo pipefail

WHEELS=(
    msgspec==0.23.0 gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5
    annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
)

case "${1:-}" in
prepare)
    mkdir -p .device/whl .device/tokenizer
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device/whl "${WHEELS[@]}"
    model=$("${PYTHON:-.venv/bin/python}" -c 'from hybridserve.models.loader import resolve_model
print(resolve_model(None).hf_dir)')
    cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja .device/tokenizer/
    du -sh .device
    ;;
run)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .device/whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 benchmarks/device_check.py --tokenizer .device/tokenizer --out "$OUT/device_check.json" 2>&1 |
        tee "$OUT/device_check.log"
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
