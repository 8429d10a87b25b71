# Sourced by the experiments/gpu_*.sh study scripts: `prepare_data "$@"` builds the token cache of the runs' data
# once (nats-prepare) from the data settings among the study's Hydra overrides (data=..., data.*, paths.*; default
# data=pg19_subset), so that the runs started after it find the cache ready.
prepare_data() {
  local data=(data=pg19_subset) o
  for o in "$@"; do case $o in data=*) data[0]=$o ;; data.* | paths.*) data+=("$o") ;; esac; done
  nats-prepare "${data[@]}"
}
