#!/usr/bin/env bash
# One prepared GPU check: the CUDA tests, the benches and the `gpu` preset, each step under its own
# timeout and all of them within TOTAL_S (9 minutes), writing one markdown table of results
# (results.md) and one log of every step (steps.log) into the folder given.
#
#   bench/gpu_check.sh --fetch              # here, with network: wheels into .whl/, the shared data into .gpu-data/
#   bench/gpu_check.sh --dry-run OUT        # print the steps and their timeouts, run nothing
#   bench/gpu_check.sh OUT [STEP ...]       # on the GPU machine (default: every step, in order)
#
# On the device tool: carry [".whl", ".gpu-data"] and run `bash bench/gpu_check.sh $OUT`. It runs
# from the repository root with the image's python3 (torch, transformers) and installs the carried
# wheels (bench/gpu_wheels.txt) into /tmp/site. Steps: tests, roofline_demo, roofline_1b,
# profile_reward, peer_trl, peer_trl_rm, pipeline (the `gpu` preset shortened, its PPO under ZeRO-3:
# the ~1B PPO iteration on partitioned weights, which the eager decoder samples from).
# Two more steps run only when named (each needs minutes beyond the 9): ppo_8b_lora (one PPO
# iteration of a random Llama-3-8B with a LoRA actor, the frozen models in bf16) and ppo_full_fit
# (the largest full fine-tune the plan fits on one card with checkpointing, ZeRO-3 and offload),
# each printing its peak GPU memory against the plan (bench/gpu_ppo_fit.py):
#   TOTAL_S=540 bash bench/gpu_check.sh $OUT ppo_8b_lora ppo_full_fit
set -u
cd "$(dirname "$0")/.."
TOTAL_S=${TOTAL_S:-540}
PYTHON=${PYTHON:-python3}

if [[ "${1:-}" == "--fetch" ]]; then
    # PyPI has only a source archive of DeepSpeed: it is fetched as one and installed from it.
    set -e
    mkdir -p .whl .gpu-data
    grep -v '^#' bench/gpu_wheels.txt | grep -v '^deepspeed==' | xargs python3 -m pip download --no-deps \
        --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
    python3 -m pip download --no-deps --no-binary=:all: -d .whl "$(grep '^deepspeed==' bench/gpu_wheels.txt)"
    cp -r "${RLHF_DATA_DIR:-../shared/hub-mirror}/datasets" .gpu-data/  # the hub mirror: no hub there
    du -sh .whl .gpu-data
    exit 0
fi

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT=${1:?usage: bench/gpu_check.sh [--dry-run] OUT_DIR [STEP ...]}
shift
WANTED=" ${*:-tests roofline_demo roofline_1b profile_reward peer_trl peer_trl_rm pipeline} "
mkdir -p "$OUT"
RESULTS="$OUT/results.md"
LOG="$OUT/steps.log"
: >"$LOG"
START=$SECONDS

export PYTHONUNBUFFERED=1 RLHF_HOME=${RLHF_HOME:-/tmp/rlhf-gpu-check} RLHF_DATA_DIR=${RLHF_DATA_DIR:-$PWD/.gpu-data}
export RLHF_TEST_HUB_MIRROR=${RLHF_TEST_HUB_MIRROR:-$RLHF_DATA_DIR}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ $DRY == 0 ]]; then
    if compgen -G ".whl/*" >/dev/null; then
        $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >>"$LOG" 2>&1 || echo "wheel install failed (see steps.log)"
        # DeepSpeed from its source archive, its CUDA ops left to build on first use (none are used here).
        if compgen -G ".whl/deepspeed-*.tar.gz" >/dev/null; then
            DS_BUILD_OPS=0 PYTHONPATH=/tmp/site $PYTHON -m pip install -q --no-index --no-deps --no-build-isolation \
                --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz >>"$LOG" 2>&1 || echo "deepspeed install failed"
        fi
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    {
        echo "# GPU check $(date -u +%FT%TZ), tree $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
        echo
        $PYTHON - <<'EOF' 2>&1
import torch, transformers
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"{name}; torch {torch.__version__}, transformers {transformers.__version__}")
EOF
        echo
        echo "| step | status | seconds | result |"
        echo "|---|---|---|---|"
    } >"$RESULTS"
fi

# step NAME TIMEOUT_S RESULT_PATTERN COMMAND...: run COMMAND under `timeout`, at most the time left
# of TOTAL_S; its output goes to steps.log, the lines matching RESULT_PATTERN into the table.
step() {
    local name=$1 limit=$2 pattern=$3
    shift 3
    [[ "$WANTED" == *" $name "* ]] || return 0
    local left=$((TOTAL_S - (SECONDS - START)))
    ((limit > left)) && limit=$left
    if [[ $DRY == 1 ]]; then
        echo "$name (timeout ${limit}s): $*"
        return 0
    fi
    if ((limit < 20)); then
        echo "| $name | skipped: ${left}s left of ${TOTAL_S}s | | |" >>"$RESULTS"
        return 0
    fi
    echo "===== $name (timeout ${limit}s): $*" >>"$LOG"
    local began=$SECONDS rc status
    timeout --kill-after=10 "$limit" "$@" >"$OUT/.step.log" 2>&1
    rc=$?
    cat "$OUT/.step.log" >>"$LOG"
    case $rc in
        0) status=ok ;;
        124 | 137) status="timed out (${limit}s)" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    local result
    result=$(grep -E "$pattern" "$OUT/.step.log" | tail -n 12 | sed 's/|/\\|/g' | paste -sd '\n' - | sed ':a;N;$!ba;s/\n/<br>/g')
    [[ $rc != 0 && -z "$result" ]] && result=$(tail -n 3 "$OUT/.step.log" | sed 's/|/\\|/g' | paste -sd '<' - | sed 's/</<br>/g')
    echo "| $name | $status | $((SECONDS - began)) | $result |" >>"$RESULTS"
    rm -f "$OUT/.step.log"
}

step tests 90 '(passed|failed|error)' \
    $PYTHON -m pytest -q -p no:cacheprovider tests/test_static_sampling.py tests/test_deepspeed_cuda.py \
    tests/test_reward_server.py::test_on_a_gpu_the_server_scores_as_on_the_cpu
step roofline_demo 40 '^(roofline|batch)' \
    $PYTHON bench/roofline.py --device cuda --shape demo --batches 16 64 256 --new-tokens 64
step roofline_1b 60 '^(roofline|batch)' \
    $PYTHON bench/roofline.py --device cuda --shape 1b --batches 16 64 256 --new-tokens 64
step profile_reward 40 '^(profile_reward|step [0-9]+:)' \
    $PYTHON bench/profile_reward.py --device cuda --shape 1b --steps 5
step peer_trl 80 '(×|episodes/s|peak)' \
    $PYTHON bench/peer_trl.py --device cuda --precision bf16 --preset gpu --batch-size 64 --prompt-length 64 \
    --response-length 128 --iterations 2 --warmup 1
step peer_trl_rm 70 '(×|tokens/s|first)' \
    $PYTHON bench/peer_trl_rm.py --device cuda --precision bf16 --preset gpu --pairs 128 --turns 3
step pipeline 160 '^\|' \
    $PYTHON bench/gpu_pipeline.py --preset gpu --set sft.max_steps=8 --set reward.max_steps=8 \
    --set critic.max_steps=4 --set ppo.iterations=2 --set ppo.launch.deepspeed=zero3 \
    --set eval.ceval.max_questions_per_subject=1
step ppo_8b_lora 300 '^ppo_fit' \
    $PYTHON bench/gpu_ppo_fit.py --case 8b-lora
step ppo_full_fit 300 '^ppo_fit' \
    $PYTHON bench/gpu_ppo_fit.py --case full-fit --memory 80 --host-memory 100

if [[ $DRY == 0 ]]; then
    echo >>"$RESULTS"
    echo "total: $((SECONDS - START)) s of ${TOTAL_S} s" >>"$RESULTS"
    cat "$RESULTS"
fi
