#!/usr/bin/env bash
# Multi-node pretraining under SLURM: one task per GPU, every task runs the same recipe command.
#
#   sbatch --nodes=4 scripts/slurm_pretrain.sh experiment=deepseek_llm_7b run_name=llm7b
#
# Lightning reads SLURM's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID, ...) and sets up the
# process group itself; trainer.num_nodes x trainer.devices must equal the job's tasks. A shared
# run_name (never the default timestamp) keeps every task in the same run directory, and rerunning
# the job with the same run_name resumes from the latest complete checkpoint. SLURM sends SIGTERM
# before preemption (--signal): every rank finishes its step, the step is saved, the job exits 143
# and --requeue starts it again. The same two-node path is tested on one machine with torchrun in
# tests/e2e/recipes/test_multi_node.py.
#SBATCH --job-name=dsl-lit
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --signal=SIGTERM@120
#SBATCH --requeue
#SBATCH --output=slurm-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
case " $* " in *" run_name="*) ;; *) echo "pass run_name=<name>: every task must share one run directory" >&2; exit 2;; esac
srun .venv/bin/python recipes/pretrain.py \
  trainer.num_nodes="$SLURM_JOB_NUM_NODES" trainer.devices="$SLURM_NTASKS_PER_NODE" trainer.accelerator=gpu "$@"
