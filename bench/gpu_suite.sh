#!/usr/bin/env bash
# The GPU checks and benchmarks, each bounded in time, logs under $OUT (default bench/out). Parts by name:
#   bash bench/gpu_suite.sh tests linears rollout release sample train sync grpo
# (release: the engine and its FP8 linears at the release's layer shapes, one rollout GPU's 32 + 1 experts, 4 layers;
# sample: the sampler's kernels against their torch twins, and GRPO-shaped rollouts with top-p / top-k)
# Triton's compiled kernels (in TRITON_CACHE_DIR, default Triton's own ~/.triton/cache): after the parts, the
# binaries and metadata of everything in it go to $OUT/triton_cache.tar.gz. On a fresh machine TRITON_CACHE_TAR=that
# file unpacks them first, so unchanged kernels are not compiled again (the part `tests` on an H200: 418 s cold, 38 s
# from the cache). The cache's group files name their entries by absolute path: unpack into the same
# TRITON_CACHE_DIR as they were made in (elsewhere Triton finds none of them and compiles, nothing worse).
set -u
PARTS="tests linears rollout release sample train sync grpo"
for part in "$@"; do
  case " $PARTS " in
    *" $part "*) ;;
    *) echo "bench/gpu_suite.sh: no part '$part' (the parts: $PARTS)" >&2; exit 2 ;;
  esac
done
# the release's layer shapes on one GPU (configs/dsv4.yaml's model section with these overrides)
RELEASE=(model.num_hidden_layers=4 "model.compress_ratios=[0, 0, 4, 128]" model.n_routed_experts=32 model.num_hash_layers=1)
OUT=${OUT:-bench/out}
mkdir -p "$OUT" || exit 2
OUT=$(CDPATH= cd -- "$OUT" >/dev/null && pwd)
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
mkdir -p "$TRITON_CACHE_DIR" || exit 2
export TRITON_CACHE_DIR=$(CDPATH= cd -- "$TRITON_CACHE_DIR" >/dev/null && pwd)
if [ -n "${TRITON_CACHE_TAR:-}" ]; then
  if tar -xzf "$TRITON_CACHE_TAR" -C "$TRITON_CACHE_DIR"; then
    echo "triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files in $TRITON_CACHE_DIR"
  else
    echo "TRITON_CACHE_TAR=$TRITON_CACHE_TAR: not a readable .tar.gz; the kernels compile as they are used" >&2
  fi
fi
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
for part in "$@"; do
  case $part in
    tests)
      timeout 585 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/gpu_tests.log" 2>&1
      tail -3 "$OUT/gpu_tests.log" ;;
    linears)
      timeout 300 python3 bench/fp8_linear.py --batches 1,16,64,256,512,2048,8192 > "$OUT/linears.log" 2>&1
      grep -A40 "^summary" "$OUT/linears.log" ;;
    rollout)
      timeout 300 python3 bench/rollout.py --gen-len 256 --bf16-batches 64 --long-gen 32 --hf-tokens 8 \
        --json "$OUT/rollout.json" > "$OUT/rollout.log" 2>&1
      grep -E "^fp8|^bf16|^long|^transformers|^target" "$OUT/rollout.log" ;;
    release)
      timeout 300 python3 bench/rollout.py --config configs/dsv4.yaml --batches 1,16,64 --bf16-batches 1,16,64 \
        --long-batch 0 --hf-batch 0 --gen-len 64 --json "$OUT/rollout_release.json" "${RELEASE[@]}" \
        > "$OUT/rollout_release.log" 2>&1
      grep -E "^fp8|^bf16|^target|Error" "$OUT/rollout_release.log"
      timeout 200 python3 bench/fp8_linear.py --config configs/dsv4.yaml --batches 16,64 > "$OUT/linears_release.log" 2>&1
      grep -A12 "^summary" "$OUT/linears_release.log" ;;
    sample)
      timeout 200 python3 bench/sample.py --json "$OUT/sample.json" > "$OUT/sample.log" 2>&1
      grep -E "^rows|Error" "$OUT/sample.log"
      timeout 300 python3 bench/rollout.py --batches '' --bf16-batches '' --long-batch 0 --hf-batch 0 \
        --grpo-sampling plain,top_p=0.9,top_k=50,top_k=50/top_p=0.9 --json "$OUT/rollout_sampling.json" \
        > "$OUT/rollout_sampling.log" 2>&1
      grep -E "^grpo|Error" "$OUT/rollout_sampling.log" ;;
    train)
      timeout 200 torchrun --standalone --nproc-per-node 1 bench/train.py --json "$OUT/train1.json" 2>&1 | grep -E "MFU|Error"
      timeout 200 torchrun --standalone --nproc-per-node 1 bench/train.py --batch 4 --json "$OUT/train1_b4.json" 2>&1 | grep -E "MFU|Error"
      timeout 200 torchrun --standalone --nproc-per-node 1 bench/train.py --ckpt --json "$OUT/train1_ckpt.json" 2>&1 | grep -E "MFU|Error"
      [ "$NGPU" -ge 2 ] && timeout 240 torchrun --standalone --nproc-per-node 2 bench/train.py --json "$OUT/train2.json" 2>&1 | grep -E "MFU|Error" ;;
    sync)
      for mb in 64 256 1024; do
        timeout 200 torchrun --standalone --nproc-per-node 2 bench/sync.py --bucket-mb $mb --json "$OUT/sync$mb.json" > "$OUT/sync$mb.log" 2>&1
        grep -E "^sync|^sender|^DeepSeek|Error" "$OUT/sync$mb.log"
      done
      timeout 200 torchrun --standalone --nproc-per-node 2 bench/sync.py --eager --json "$OUT/sync_eager.json" > "$OUT/sync_eager.log" 2>&1
      grep -E "^sync|^sender|Error" "$OUT/sync_eager.log" ;;
    grpo)
      for op in 0 1; do
        timeout 290 torchrun --standalone --nproc-per-node 2 train_grpo.py --config configs/mini.yaml out_dir="$OUT/grpo$op" \
          train.steps=8 train.off_policy_steps=$op train.prompts_per_step=32 rollout.max_tokens=256 \
          train.dynamic_sampling=false eval.every=0 ckpt.every=0 ckpt.export_final=false > "$OUT/grpo$op.log" 2>&1
        python3 -c "import json,sys; [print($op, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in json.loads(l).items() if k in ('step','time_rollout_s','time_generate_s','time_train_s','time_sync_s','time_step_s','sync_gb_s','staleness','response_len','skipped_update','mismatch_kl')})) for l in open('$OUT/grpo$op/metrics.jsonl')]" 2>&1 || tail -5 "$OUT/grpo$op.log"
      done ;;
  esac
done
# the kernels' binaries (cubin / hsaco), metadata and launchers; the IR text files are not needed to load them
# (written under a temporary name: a run cut short leaves no half archive for the next one)
(cd "$TRITON_CACHE_DIR" && find . -type f \( -name '*.cubin' -o -name '*.hsaco' -o -name '*.json' -o -name '*.so' \) \
  | tar -czf "$OUT/triton_cache.tar.gz.tmp" -T -) && mv "$OUT/triton_cache.tar.gz.tmp" "$OUT/triton_cache.tar.gz" \
  && echo "triton cache: $OUT/triton_cache.tar.gz"
