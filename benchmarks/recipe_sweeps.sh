#!/usr/bin/env bash
# The ScaleCom recipe sweeps of docs/benchmarks-history.md ("Recipes"): every setting tried, with every knob explicit, so the
# settings do not depend on the defaults in recipes/configs/<task>/scalecom_cpu.yaml.
#
#   bash benchmarks/recipe_sweeps.sh image "0 1"          # tuning seeds
#   bash benchmarks/recipe_sweeps.sh translation "2 3"    # held-out seeds
#   TABLE=1 bash benchmarks/recipe_sweeps.sh image "0 1"  # only the table (and plot) of the summaries present
#
# Summaries: runs/sweep/<task>/<setting>/seed<seed>.json; plot: docs/figures/frontier_<task>.png.
set -euo pipefail
task=$1
seeds=$2
cd "$(dirname "$0")/.."

A=--trainer.strategy.init_args
wire="$A.compressor.init_args.value_dtype=float16 $A.compressor.init_args.index_coding=delta16"
wire32="$A.compressor.init_args.value_dtype=float32 $A.compressor.init_args.index_coding=int32"
ratio() { echo "$A.compressor.init_args.density=$1"; }
small() { echo "$A.small_param=$1 $A.min_numel=1024 $A.compress_1d=false"; }
all1d="$A.small_param=null $A.min_numel=1 $A.compress_1d=true"      # every tensor at the target density
dense_small="$A.small_param=null $A.min_numel=1024 $A.compress_1d=false"
warm() { echo "$A.start_step=2 $A.schedule='{\"class_path\":\"lightning_gradcomp.schedule.WarmupSchedule\",\"init_args\":{\"steps\":$1,\"start\":$2}}'"; }
nowarm="$A.start_step=2 $A.schedule=null"
dense_start() { echo "$A.start_step=$1 $A.schedule=null"; }

settings=(--setting "dense=dense_cpu")
case $task in
  image)
    settings+=(
      --setting "c1_all_w300_s10=scalecom_cpu $(ratio 0.01) $wire $all1d $(warm 300 0.1)"
      --setting "c1_all_nowarm=scalecom_cpu $(ratio 0.01) $wire $all1d $nowarm"
      --setting "c1_w300_s10_smalldense=scalecom_cpu $(ratio 0.01) $wire $dense_small $(warm 300 0.1)"
      --setting "sp25_nowarm=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $nowarm"
      --setting "sp25_w300_s05=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 300 0.05)"
      --setting "sp10_nowarm=scalecom_cpu $(ratio 0.01) $wire $(small 0.1) $nowarm"
      --setting "sp25_w150_s05=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 150 0.05)"
      --setting "sp25_w300_s03=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 300 0.03)"
    ) ;;
  translation)
    settings+=(
      --setting "c1_dense100_fp32=scalecom_cpu $(ratio 0.01) $wire32 $dense_small $(dense_start 100)"
      --setting "c1_dense100_compact=scalecom_cpu $(ratio 0.01) $wire $dense_small $(dense_start 100)"
      --setting "c1_all_w100_s05=scalecom_cpu $(ratio 0.01) $wire $all1d $(warm 100 0.05)"
      --setting "c1_all_w100_s05_fp32=scalecom_cpu $(ratio 0.01) $wire32 $all1d $(warm 100 0.05)"
      --setting "c1_w100_s05_smalldense=scalecom_cpu $(ratio 0.01) $wire $dense_small $(warm 100 0.05)"
      --setting "c1_all_w100_s25=scalecom_cpu $(ratio 0.01) $wire $all1d $(warm 100 0.25)"
      --setting "sp25_nowarm=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $nowarm"
      --setting "sp25_w100_s25=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 100 0.25)"
      --setting "sp25_w100_s25_lr1e3=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 100 0.25) --model.lr=1e-3"
      --setting "sp25_w200_s25=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 200 0.25)"
      --setting "sp25_w300_s25=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 300 0.25)"
      --setting "c2_dense100_fp32=scalecom_cpu $(ratio 0.02) $wire32 $dense_small $(dense_start 100)"
      --setting "c5_dense100_fp32=scalecom_cpu $(ratio 0.05) $wire32 $dense_small $(dense_start 100)"
      --setting "c2_dense200_fp32=scalecom_cpu $(ratio 0.02) $wire32 $dense_small $(dense_start 200)"
    ) ;;
  speech)
    settings+=(
      --setting "c1_sp25_w300_s25=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $(warm 300 0.25)"
      --setting "c2_sp25_w300_s25=scalecom_cpu $(ratio 0.02) $wire $(small 0.25) $(warm 300 0.25)"
      --setting "c5_dense100_fp32=scalecom_cpu $(ratio 0.05) $wire32 $dense_small $(dense_start 100)"
      --setting "c2_sp25_w100_s10=scalecom_cpu $(ratio 0.02) $wire $(small 0.25) $(warm 100 0.1)"
      --setting "c1_sp25_nowarm=scalecom_cpu $(ratio 0.01) $wire $(small 0.25) $nowarm"
    ) ;;
  *) echo "task: image, translation or speech" >&2; exit 2 ;;
esac

python benchmarks/recipe_sweep.py "$task" --seeds $seeds ${TABLE:+--table} --plot "docs/figures/frontier_$task.png" \
  "${settings[@]}"
