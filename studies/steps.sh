# What the studies' wrappers share (sourced; $times names the file of wall-clock times): a timed
# step, and a training that keeps a checkpoint already there.
step() {  # step COMMAND...: run it, and append its wall-clock seconds to $times
    local t0=$SECONDS
    echo "+ $*"
    "$@"
    echo "$(( SECONDS - t0 ))s  $*" | tee -a "$times"
}
train() {  # train OUT_DIR ARGS...: train.py with ARGS into OUT_DIR, unless OUT_DIR/ckpt.pt exists
    if [ -f "$1/ckpt.pt" ]; then
        echo "$1/ckpt.pt exists: kept (remove it, or train with --overwrite_checkpoint=True, to retrain)"
    else  # no checkpoint: a log there is an interrupted run's of this study, replaced
        step python train.py "${@:2}" --out_dir="$1" --overwrite_checkpoint=True
    fi
}
