"""What runs around the model in every process of a run: the distributed set-up (`distributed`), the
DeepSpeed engine (`engine`), verified checkpoints (`checkpoint`), the run directory's lock
(`runlock`), disks that fill up (`storage`), stop requests and preemption (`stopping`), the
processes a run starts and stops (`processes`), the metrics it logs (`metrics`) and the dtype rule
(`dtypes`). It sits above the recipe and below the models: nothing here knows a model family, a
loss or a reward."""
