#!/bin/bash
# seed 1 of the two 40-minute variants within 0.5 point of each other (step-fixed, one thread each, side by side)
cd /work/main
V=.venv/bin/vitrain
run() { name=$1; shift; echo "$(date +%T) start $name" >> /work/runs-payoff/driver40.log; OMP_NUM_THREADS=1 $V train --recipe fmnist_10m --set train.progress=off --set train.budget=null --set train.epochs=null --set train.out_dir=/work/runs-payoff/$name --set train.seed=1 "$@" > /work/runs-payoff/$name.log 2>&1; echo "$(date +%T) end $name rc=$?" >> /work/runs-payoff/driver40.log; }
run ra-erase-40m-seed1 --set train.steps=5564 --set data.randaugment=rand-m9-mstd0.5-inc1 --set data.random_erase=0.25 &
run mix-40m-seed1 --set train.steps=7248 --set data.mixup=0.8 --set data.cutmix=1.0 &
wait
